"""Fixtures: a KV peer process per transport (``kv_peer``: the peer, ``TRANSPORTS``, ``make_client``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kv_peer import PeerProcess, PeerSpec


@pytest.fixture
def start_peer() -> Iterator:
    peers: list[PeerProcess] = []

    def start(spec: PeerSpec) -> PeerProcess:
        peers.append(PeerProcess(spec))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()
