"""``pdserve up``'s checks: a port whose server just stopped is free, a listened one is not;
a draft model that is not there is named before anything starts.

The TIME_WAIT is real: a server on 127.0.0.1 accepts a connection and closes it first (the
side that closes first keeps the TIME_WAIT), then stops listening, as a stopped
``pdserve up`` leaves its HTTP port. Before the fix the probe bound without ``SO_REUSEADDR``
and reported that port "in use" for a minute.
"""

from __future__ import annotations

import socket

from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.preflight import _is_free, preflight_problems


def test_a_port_left_in_time_wait_is_free_and_a_listened_port_is_not() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert not _is_free("127.0.0.1", port)  # something listens
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its port enters TIME_WAIT
            client.recv(1)
    with socket.socket() as plain_probe:  # what the old probe saw
        try:
            plain_probe.bind(("127.0.0.1", port))
            time_wait_refused_a_plain_bind = False
        except OSError:
            time_wait_refused_a_plain_bind = True
    assert time_wait_refused_a_plain_bind, "no TIME_WAIT was left: the test proves nothing"
    assert _is_free("127.0.0.1", port)


def test_a_missing_draft_model_is_named_before_anything_starts(tmp_path) -> None:
    config = PDServeConfig.model_validate(
        {
            "speculative_method": "draft_model",
            "speculative_model": str(tmp_path / "no-draft"),
            "ray_address": "127.0.0.1:6390",  # an existing cluster: no port probes
        }
    )
    [problem] = preflight_problems(config)
    assert problem.startswith(f"--speculative-model '{tmp_path / 'no-draft'}'")
