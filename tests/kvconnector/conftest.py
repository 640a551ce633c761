"""Fixtures: a KV peer process per transport, and a client over a local KV tensor."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kv_peer import PeerProcess, PeerSpec  # noqa: E402

from pdserve.kvconnector.grpc_client import GrpcTransferClient  # noqa: E402
from pdserve.kvconnector.layout import KVLayout  # noqa: E402
from pdserve.kvconnector.nixl_transport import NixlTransferClient, nixl_available  # noqa: E402
from pdserve.kvconnector.transport import KVTransferClient  # noqa: E402

TRANSPORTS = ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="nixl is not installed (pip install 'pdserve[nixl]')"))]


def make_client(spec: PeerSpec, local: torch.Tensor, secret: str | None = None,
                timeout_s: float = 10.0, hash_seed: int | None = None) -> KVTransferClient:
    layout = KVLayout.from_kv_cache(local, spec.hash_algorithm,
                                    spec.hash_seed if hash_seed is None else hash_seed)
    client_type = NixlTransferClient if spec.transport == "nixl" else GrpcTransferClient
    return client_type(local, layout, engine_id="decode-0", secret=secret,
                       timeout_s=timeout_s)


@pytest.fixture
def start_peer() -> Iterator:
    peers: list[PeerProcess] = []

    def start(spec: PeerSpec) -> PeerProcess:
        peers.append(PeerProcess(spec))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()
