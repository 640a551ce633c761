"""A 1 prefill + 1 decode app's security: its secret, its listeners, and tenant isolation.

- The deployment's KV-transfer secret reaches the workers (a peer without it is refused at
  the KV port) and nowhere else (not in ``/stats`` or ``/metrics``).
- Every listener (gateway HTTP, gateway gRPC, KV transfer) binds loopback by default; this is
  read from the kernel's socket table, no traffic leaves loopback.
- ``cache_salt`` separates tenants end to end: no prefix hit and no decode-side dedup across
  salts, the same salt still hits, and outputs equal the colocated engine's.
"""

from __future__ import annotations

import json
import pickle
import socket
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from ray import serve

from pdserve.deploy.certs import write_certificates
from pdserve.deploy.cluster import ServeOptionsError, base_url, deploy
from pdserve.kvconnector.transport.base import SECRET_METADATA_KEY, TransferError
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.messages.sampling_params import SamplingParams
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.service.service_apps import (
    SERVE_PORT,
    SHARED_SECRETS,
    assert_drained,
    expected_text,
    free_port,
    get_json,
    post_completion,
    running_app,
    wait_until_ready,
)

SECRET = SHARED_SECRETS["kv_transfer_secret"]
SECRET_METADATA = ((SECRET_METADATA_KEY, SECRET),)
GRPC_PORT = free_port()
KV_PORT = free_port()
PROMPT = "Tenant data: the quarterly numbers are confidential. Summarise them: "


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(
        num_prefill=1, num_decode=1, grpc_port=GRPC_PORT, kv_transfer_port=KV_PORT
    ) as config:
        yield config


@pytest.fixture(autouse=True)
def ends_drained(service):
    """Every test ends with every block free, no lease held and nothing in flight."""
    yield
    assert_drained(service)


def _worker(config, role: str) -> dict:
    return next(w for w in get_json(config, "/stats")["workers"] if w["role"] == role)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            text = socket.inet_ntop(family, raw)
            found.add(text.removeprefix("::ffff:"))  # gRPC: 127.0.0.1 as an IPv4-mapped socket
    return found


def _kv_client(secret: str | None) -> GrpcTransferClient:
    local = torch.zeros(1, 1, 2, 16, 1, 8)
    return GrpcTransferClient(
        local,
        KVLayout.from_kv_cache(local, "xxh3_128", 0),
        engine_id="outsider",
        secret=secret,
        timeout_s=5.0,
    )


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_every_listener_binds_loopback_by_default(service):
    assert post_completion(service, {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200
    for what, port in [
        ("gateway HTTP", SERVE_PORT),
        ("gateway gRPC", GRPC_PORT),
        ("KV transfer of prefill-0", KV_PORT),
    ]:
        assert _listening_addresses(port) == {"127.0.0.1"}, what


def test_an_app_asking_for_https_where_serve_runs_plain_http_is_refused(service, tmp_path):
    """Serve keeps the HTTP options of its first start (a later one only logs a warning): an
    app asking for HTTPS on this cluster, whose Serve answers plain HTTP, would have been
    served in plain HTTP, its API key in clear. It is refused before anything is deployed,
    naming what differs, and the running app still answers."""
    write_certificates(tmp_path, ["127.0.0.1"])
    https = service.model_copy(
        update={
            "app_name": "https-app",
            "route_prefix": "/https-app",
            "ssl_certfile": str(tmp_path / "gateway.crt"),
            "ssl_keyfile": str(tmp_path / "gateway.key"),
        }
    )
    with pytest.raises(ServeOptionsError, match="ssl_certfile: running None, asked"):
        deploy(https)
    assert "https-app" not in serve.status().applications
    assert get_json(service, "/health") is not None


def test_the_kv_port_refuses_a_peer_without_the_deployment_secret(service):
    address = f"127.0.0.1:{KV_PORT}"
    for secret in (None, "not-the-secret-0123456789"):
        client = _kv_client(secret)
        try:
            with pytest.raises(TransferError, match="UNAUTHENTICATED"):
                client.handshake(address)
        finally:
            client.close()
    member = _kv_client(SECRET)
    try:  # with the secret the call is authorized (the layouts differ on purpose)
        with pytest.raises(ValueError, match="layout|differ|mismatch"):
            member.handshake(address)
    finally:
        member.close()


def test_the_secret_is_not_served_in_stats_or_metrics(service):
    assert SECRET not in json.dumps(get_json(service, "/stats"))
    with urllib.request.urlopen(base_url(service) + "/metrics") as response:
        assert SECRET not in response.read().decode()


def test_no_prefix_hit_or_dedup_crosses_salts_and_outputs_equal_colocated(service, colocated):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    expected = expected_text(
        colocated, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    replies = []
    counters = []
    for salt in ["tenant-a", "tenant-b", "tenant-a"]:
        status, _, reply = post_completion(service, {**body, "cache_salt": salt})
        assert status == 200, reply
        replies.append(reply)
        prefill, decode = _worker(service, "producer"), _worker(service, "consumer")
        counters.append((prefill["prefix_cache_hits"], decode["num_dedup_skipped_blocks"]))
    assert [r["choices"][0]["text"] for r in replies] == [expected] * 3
    (hits_a, dedup_a), (hits_b, dedup_b), (hits_a2, dedup_a2) = counters
    assert hits_b == hits_a and dedup_b == dedup_a  # tenant-b found nothing of tenant-a's
    assert hits_a2 > hits_b and dedup_a2 > dedup_b  # tenant-a finds its own blocks


def test_grpc_generate_takes_a_cache_salt_and_refuses_a_bad_one(service, colocated):
    expected = expected_text(colocated, PROMPT, SamplingParams(max_tokens=4, temperature=0))
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        replies, hits = [], []
        for salt in ("grpc-tenant-x", "grpc-tenant-y", "grpc-tenant-x"):
            replies.append(
                list(
                    stub.Generate(
                        generate_pb2.GenerateRequest(
                            text=PROMPT, max_tokens=4, temperature=0, cache_salt=salt
                        ),
                        timeout=60,
                    )
                )
            )
            hits.append(_worker(service, "producer")["prefix_cache_hits"])
        assert ["".join(r.text for r in reply) for reply in replies] == [expected] * 3
        assert hits[1] == hits[0] < hits[2]
        for bad in ("", "x" * 257):
            with pytest.raises(grpc.RpcError) as caught:
                list(
                    stub.Generate(
                        generate_pb2.GenerateRequest(text=PROMPT, cache_salt=bad), timeout=60
                    )
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in caught.value.details()


def test_http_refuses_a_bad_cache_salt_with_400(service):
    for bad in ("", "x" * 257, 7):
        status, _, reply = post_completion(
            service, {"model": "tiny", "prompt": "hi", "cache_salt": bad}
        )
        assert status == 400 and "cache_salt" in json.dumps(reply), reply
    assert (
        post_completion(
            service, {"model": "tiny", "prompt": "hi", "max_tokens": 2, "cache_salt": "x" * 256}
        )[0]
        == 200
    )


class _RunsWhenUnpickled:
    """A pickle whose loading makes a directory: proof that a listener unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def test_no_listener_unpickles_what_a_client_or_peer_sends(service, tmp_path):
    """A crafted pickle to every port a client or peer reaches (gateway HTTP, gateway gRPC,
    the KV service's every method, with the secret so it gets past the door): each refuses
    it as a bad request and none runs it. Ray's own ports are trusted-network only (README)."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_RunsWhenUnpickled(marker))
    for path in ("/v1/completions", "/v1/chat/completions"):
        for content_type in ("application/json", "application/octet-stream"):
            request = urllib.request.Request(
                base_url(service) + path, data=payload, headers={"Content-Type": content_type}
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code in (400, 415), (path, content_type)
    calls = [
        (f"127.0.0.1:{GRPC_PORT}", "/pdserve.generate.Generate/Generate", "unary_stream", ()),
        *[
            (f"127.0.0.1:{KV_PORT}", f"/pdserve.kv.KvTransfer/{method}", kind, SECRET_METADATA)
            for method, kind in [
                ("Handshake", "unary_unary"),
                ("ReadBlocks", "unary_stream"),
                ("HoldBlocks", "stream_stream"),
                ("RenewLease", "unary_unary"),
                ("Release", "unary_unary"),
            ]
        ],
    ]
    for address, method, kind, metadata in calls:
        with grpc.insecure_channel(address) as channel:
            call = getattr(channel, kind)(method)  # no serializers: the raw bytes go as they are
            request = iter([payload]) if kind.startswith("stream") else payload
            with pytest.raises(grpc.RpcError) as refused:
                reply = call(request, metadata=metadata, timeout=30)
                if kind.endswith("stream"):
                    list(reply)
            assert refused.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.NOT_FOUND,
            ), (method, refused.value.code(), refused.value.details())
    assert not marker.exists(), "a listener unpickled a request"
    assert wait_until_ready(service)["ready"]  # and every part still serves
