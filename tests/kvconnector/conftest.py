"""Fixtures: a KV peer process per transport (``start_peer``), a prefill engine in its own
process (``prefill_factory``) and the colocated reference engine (``colocated``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.engine import LLMEngine
from tests.kvconnector.kv_peer import PeerProcess, PeerSpec
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS, PrefillProcess, PrefillSpec


@pytest.fixture
def start_peer() -> Iterator:
    peers: list[PeerProcess] = []

    def start(spec: PeerSpec) -> PeerProcess:
        peers.append(PeerProcess(spec))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()


@pytest.fixture(scope="module")
def colocated() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)


@pytest.fixture
def prefill_factory() -> Iterator:
    started: list[PrefillProcess] = []

    def start(**spec: object) -> PrefillProcess:
        started.append(PrefillProcess(PrefillSpec(**spec)))
        return started[-1]

    yield start
    for process in started:
        process.close()
