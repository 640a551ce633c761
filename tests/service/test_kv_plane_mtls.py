"""Mutual TLS on the KV plane of a running NIXL app, both shapes: the hand-off crosses it and
every reply equals the colocated engine's.

(gRPC: 1+1 in ``tests/deploy/test_secure_deployment.py`` with the gateway's TLS and a key
too, 2+2 in the fault matrix, whose gRPC app runs with security on.) NIXL's agent metadata
rides the control plane's mutual-TLS gRPC; its UCX data path has no TLS of its own (README,
"Security and threat model").
"""

from __future__ import annotations

import pytest

from pdserve.deploy.certs import write_certificates
from tests.service.service_apps import (
    assert_completions_equal_colocated,
    openai_client,
    running_shape,
    worker_rows,
)

SHAPES = [(1, 1, "nixl"), (2, 2, "nixl")]
PROMPTS = [
    "Over mutual TLS: a prompt long enough to fill a few blocks of the tiny model's cache",
    "Another one, sharing nothing with the first, also pulled by its decode worker",
]


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory):
    return write_certificates(tmp_path_factory.mktemp("kv-mtls"), ["127.0.0.1"])


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{p}p{d}d-{t}" for p, d, t in SHAPES])
def app(request, ray_cluster, cert_dir):
    with running_shape(*request.param, kv_tls_dir=str(cert_dir)) as config:
        yield config


def test_replies_over_a_mutual_tls_kv_plane_equal_the_colocated_engine(app, colocated) -> None:
    def received() -> int:
        rows = worker_rows(app).values()
        return sum(row["num_blocks_received"] for row in rows if row["role"] == "consumer")

    before = received()
    assert_completions_equal_colocated(
        openai_client(app), colocated, PROMPTS, 6, dict(temperature=0.0)
    )
    assert received() > before, "no block crossed the KV plane"
