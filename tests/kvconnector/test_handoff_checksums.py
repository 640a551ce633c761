"""A prefill's hand-off is checksummed off the engine's step path, and still verified.

Issue 11, bug 7: ``PDConnector.request_finished`` hashed every page of the prompt on the
prefill engine thread, so a long prompt stalled every other request's step. The lease is now
granted on the engine thread without checksums; the worker's stream (``EngineHost.generate``)
computes and attaches them before the hand-off leaves the worker, and the lease refuses reads
until then. The workers run here without Ray, in this process, over real gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest

import pdserve.kvconnector.pd.pd_connector as pd_connector_module
from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.checksum import block_checksums
from pdserve.kvconnector.pd.lease import LeaseNotReadyError, LeaseTable
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

SECRET = "a-test-secret-of-enough-length"


def _worker_spec(worker_id: str, role: str) -> WorkerSpec:
    return WorkerSpec(
        worker_id,
        EngineConfig(engine_id=worker_id, hash_seed=0, **ENGINE_KWARGS),
        KVConnectorConfig(role=role, secret=SECRET),
    )


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


async def _stream(worker, request: WorkerRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in worker.generate(request)]


@pytest.mark.parametrize(
    "num_tokens, num_blocks, on_event_loop",
    [
        (200, 13, True),  # 13 pages of 64 KiB: checksummed inline, no thread hop
        (400, 25, False),
    ],
)  # 1.6 MiB, over the inline limit: on a worker thread
def test_the_prefill_engine_thread_never_checksums_and_the_hand_off_carries_the_checksums(
    monkeypatch, num_tokens, num_blocks, on_event_loop
) -> None:
    threads_that_checksummed: list[str] = []

    def spying_block_checksums(kv_cache, block_ids):
        threads_that_checksummed.append(threading.current_thread().name)
        return block_checksums(kv_cache, block_ids)

    monkeypatch.setattr(pd_connector_module, "block_checksums", spying_block_checksums)
    prefill = PrefillWorker(_worker_spec("prefill-0", "producer"))
    prompt = _prompt(7, num_tokens)
    try:
        chunks = asyncio.run(
            _stream(
                prefill,
                WorkerRequest(
                    "h0", prompt, SamplingParams(max_tokens=1, temperature=0.0), remote_decode=True
                ),
            )
        )
        params = chunks[-1].kv_transfer_params
        assert params is not None and len(params.block_ids) == num_blocks
        assert params.block_checksums == block_checksums(
            prefill.engine.runner.kv_cache, params.block_ids
        )
        assert chunks[0].timing.checksum_s > 0
        assert len(threads_that_checksummed) == 1, "nobody checksummed the hand-off"
        assert not threads_that_checksummed[0].startswith("prefill-0-engine"), (
            "the engine's step path hashed the prompt"
        )
        assert (threads_that_checksummed[0] == "MainThread") == on_event_loop
    finally:
        prefill.engine.shutdown()


def test_a_lease_granted_without_checksums_serves_no_read_until_they_are_attached() -> None:
    leases = LeaseTable()
    lease = leases.grant("r0", [3, 4], [b"h"], checksums=None)
    with pytest.raises(LeaseNotReadyError):
        leases.begin_read(lease.lease_id, [3, 4])
    leases.attach_checksums(lease.lease_id, {3: 11})
    with pytest.raises(LeaseNotReadyError):  # block 4 still has none
        leases.begin_read(lease.lease_id, [3, 4])
    leases.begin_read(lease.lease_id, [3])  # block 3 is verifiable now
    leases.end_read(lease.lease_id)
    leases.attach_checksums(lease.lease_id, {4: 12})
    leases.begin_read(lease.lease_id, [3, 4])
    leases.end_read(lease.lease_id)
    assert leases.checksums(lease.lease_id, [4, 3]) == [12, 11]


def test_a_page_changed_after_the_hand_off_is_still_caught_and_recomputed() -> None:
    prefill = PrefillWorker(_worker_spec("prefill-0", "producer"))
    decode = DecodeWorker(_worker_spec("decode-0", "consumer"))
    prompt = _prompt(8, 120)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = (
        LLMEngine.from_pretrained("tiny", hash_seed=0, **ENGINE_KWARGS)
        .generate([prompt], [params])[0]
        .output_token_ids
    )

    async def disaggregated() -> list[GenerationChunk]:
        prefilled = await _stream(
            prefill,
            WorkerRequest(
                "c0", prompt, dataclasses.replace(params, max_tokens=1), remote_decode=True
            ),
        )
        hand_off = prefilled[-1].kv_transfer_params
        # The page changes after its checksum was promised (a bad write, a bad link).
        prefill.engine.runner.kv_cache[hand_off.block_ids[2]].view(-1)[5] += 1.0
        return await _stream(
            decode, WorkerRequest("c0", prompt, params, kv_transfer_params=hand_off)
        )

    try:
        chunks = asyncio.run(disaggregated())
        tokens = [token for chunk in chunks for token in chunk.new_token_ids]
        assert tokens == expected
        stats = decode.engine.stats()
        assert stats.transfer.num_failed_blocks >= 1 and stats.num_recompute_fallbacks == 1
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()
