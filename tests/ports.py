"""A free loopback port, for servers a test starts on a fixed address."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at ``host``, so suites running side by side do not
    collide."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
