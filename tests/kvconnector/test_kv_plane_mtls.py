"""Mutual TLS on the KV plane: a decode worker pulls over it, a peer without the deployment's
certificate is refused by the TLS layer before any message is read (and counted), and the
server's files rotate live: new connections get the new ones.

Certificates come from ``pdserve certs``' own functions (``deploy/certs.py``): the
deployment's CA and worker certificate, a foreign CA's worker certificate, an expired one of
the deployment's CA. Everything runs in one process on loopback, over real gRPC with TLS.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.deploy.certs import issue, load_issued, write_certificates
from pdserve.deploy.config import PDServeConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.transport import grpc_client
from pdserve.kvconnector.transport.base import TransferError
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_plane_tls import KV_PEER_NAME, KVPlaneTLS
from tests.kvconnector.test_kv_plane_security import ENGINE_KWARGS, SECRET, run

PROMPT = list(range(7, 7 + 70))
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, KVPlaneTLS]:
    """The deployment's files, and four peers that must be refused."""
    root = tmp_path_factory.mktemp("certs")
    deployment = write_certificates(root / "deployment", ["127.0.0.1"])
    foreign = write_certificates(root / "foreign", ["127.0.0.1"])
    ca = load_issued(deployment, "ca")
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=400)
    expired = root / "expired"
    expired.mkdir()
    issue(ca, KV_PEER_NAME, [KV_PEER_NAME], days=30, valid_from=long_ago).write(expired, "worker")
    return {
        "deployment": KVPlaneTLS.in_directory(deployment),
        # A foreign CA's worker, trusting the deployment's CA (so only its own cert is wrong).
        "foreign": KVPlaneTLS(
            str(deployment / "ca.crt"), str(foreign / "worker.crt"), str(foreign / "worker.key")
        ),
        "expired": KVPlaneTLS(
            str(deployment / "ca.crt"), str(expired / "worker.crt"), str(expired / "worker.key")
        ),
        # The deployment CA's other certificate: the gateway's, on every proxy node.
        "gateway": KVPlaneTLS(
            str(deployment / "ca.crt"),
            str(deployment / "gateway.crt"),
            str(deployment / "gateway.key"),
        ),
    }


def engine(role: str, tls: KVPlaneTLS, grpc_streams: int = 0) -> LLMEngine:
    connector = PDConnector(
        KVConnectorConfig(role=role, secret=SECRET, tls=tls, grpc_streams=grpc_streams),
        engine_id=f"{role}-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    return LLMEngine.from_pretrained("tiny", connector=connector, **ENGINE_KWARGS)


@pytest.mark.parametrize("streams", [1, 3])
def test_a_pull_over_mutual_tls_equals_the_colocated_engine(certs, streams, monkeypatch) -> None:
    """On one connection, and striped over three (each its own TLS session)."""
    monkeypatch.setattr(grpc_client, "STRIPE_MIN_BYTES", 0)  # tiny's pull: stripe anyway
    stripes_pulled: list[int] = []
    pull_stripe = grpc_client.GrpcTransferClient._pull_stripe

    def counted(client, address, lease_id, stripe, *rest):
        stripes_pulled.append(stripe)
        return pull_stripe(client, address, lease_id, stripe, *rest)

    monkeypatch.setattr(grpc_client.GrpcTransferClient, "_pull_stripe", counted)
    expected = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS).generate([PROMPT], PARAMS)[0]
    prefill, decode = (
        engine("producer", certs["deployment"]),
        engine("consumer", certs["deployment"], grpc_streams=streams),
    )
    try:
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        handed = run(prefill, "m0", PROMPT, first, remote_decode=True).kv_transfer_params
        assert handed is not None
        out = run(decode, "m0", PROMPT, PARAMS, kv_transfer_params=handed)
        assert out.output_token_ids == expected.output_token_ids
        assert decode.stats().transfer.num_blocks_received == len(handed.block_ids)
        assert sorted(set(stripes_pulled)) == list(range(streams))  # every stream pulled
    finally:
        decode.connector.shutdown()
        prefill.connector.shutdown()


def _server(tls: KVPlaneTLS) -> tuple[GrpcTransferServer, torch.Tensor]:
    prefill = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    kv_cache = prefill.runner.kv_cache
    layout = KVLayout.from_kv_cache(kv_cache, "xxh3_128", 0)
    return GrpcTransferServer(kv_cache, LeaseTable(), layout, secret=SECRET, tls=tls), kv_cache


@pytest.mark.parametrize("peer", ["plaintext", "foreign", "expired"])
def test_a_peer_without_the_deployments_certificate_is_refused_before_any_message(
    certs, peer
) -> None:
    server, kv_cache = _server(certs["deployment"])
    layout = KVLayout.from_kv_cache(kv_cache, "xxh3_128", 0)
    try:
        tls = None if peer == "plaintext" else certs[peer]
        client = GrpcTransferClient(
            torch.zeros_like(kv_cache), layout, secret=SECRET, tls=tls, timeout_s=5.0
        )
        with pytest.raises(TransferError):
            client.handshake(server.address)
        client.close()
        assert not server.activity.is_set(), "the server read a message from the peer"
        refused = server.stats.snapshot().num_tls_connections_refused
        assert refused >= 1
        # The same server still serves a peer with the deployment's certificate, which is
        # not counted as refused.
        good = GrpcTransferClient(
            torch.zeros_like(kv_cache), layout, secret=SECRET, tls=certs["deployment"]
        )
        good.handshake(server.address)
        good.handshake(server.address)  # the same connection: still one served
        good.close()
        assert server.activity.is_set()
        assert server.stats.snapshot().num_tls_connections_refused == refused
    finally:
        server.stop()


def test_the_gateways_certificate_passes_tls_but_is_refused_at_its_first_call(certs) -> None:
    """The gateway's certificate is the deployment CA's too, so its TLS handshake succeeds;
    with the deployment secret as well (both may sit on one proxy node), its first call is
    still refused, naming the worker certificate's name, and nothing is served."""
    server, kv_cache = _server(certs["deployment"])
    layout = KVLayout.from_kv_cache(kv_cache, "xxh3_128", 0)
    try:
        client = GrpcTransferClient(
            torch.zeros_like(kv_cache), layout, secret=SECRET, tls=certs["gateway"], timeout_s=5.0
        )
        with pytest.raises(TransferError, match=f"does not name '{KV_PEER_NAME}'"):
            client.handshake(server.address)
        client.close()
        assert not server.activity.is_set(), "the server served the gateway's certificate"
    finally:
        server.stop()


def test_a_deployment_hands_every_worker_its_tls_files(tmp_path: Path) -> None:
    config = PDServeConfig(kv_transfer_secret=SECRET, hash_seed=0, kv_tls_dir=str(tmp_path))
    for role in ("producer", "consumer"):
        assert config.worker_spec(role, 0).connector.tls == KVPlaneTLS.in_directory(tmp_path)
    assert (
        PDServeConfig(kv_transfer_secret=SECRET, hash_seed=0)
        .worker_spec("producer", 0)
        .connector.tls
        is None
    )
    with pytest.raises(ValueError, match="cannot read the KV plane's TLS files"):
        KVPlaneTLS.in_directory(tmp_path / "missing").read()


def test_the_servers_files_rotate_for_new_connections(certs, tmp_path: Path) -> None:
    """The server's directory is rewritten with another deployment's CA and certificate
    while it runs: a new client of the new deployment is served, a new client of the old
    one is refused; the server was never restarted."""
    deployment = Path(certs["deployment"].ca_file).parent
    rotated = Path(certs["foreign"].cert_file).parent  # another CA's whole deployment
    served = tmp_path / "served"
    served.mkdir()
    for name in ("ca.crt", "worker.crt", "worker.key"):
        shutil.copy(deployment / name, served / name)
    server, kv_cache = _server(KVPlaneTLS.in_directory(served))
    layout = KVLayout.from_kv_cache(kv_cache, "xxh3_128", 0)

    def handshake(files: Path) -> None:
        client = GrpcTransferClient(
            torch.zeros_like(kv_cache),
            layout,
            secret=SECRET,
            tls=KVPlaneTLS.in_directory(files),
            timeout_s=5.0,
        )
        try:
            client.handshake(server.address)
        finally:
            client.close()

    try:
        handshake(deployment)
        with pytest.raises(TransferError):
            handshake(rotated)
        for name in ("ca.crt", "worker.crt", "worker.key"):  # as a Secret's update lands
            shutil.copy(rotated / name, served / f".{name}.new")
            os.replace(served / f".{name}.new", served / name)
        handshake(rotated)
        with pytest.raises(TransferError):
            handshake(deployment)
        assert server.stats.snapshot().num_tls_connections_refused >= 2
    finally:
        server.stop()
