"""P/D with a sliding-window model: the blocks the prefill's window had already left are not
leased, the decode worker pulls only the blocks its next token's window reads, and never
caches its own blocks before the window.

A prompt prefilled in chunks loses its first blocks to the window before it finishes (they
are the null block in its table). They used to go into the lease as repeated null ids, the
read was refused, and every such request was recomputed on the decode worker. The workers
run here without Ray, in this process, over real gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import transformers

from pdserve.cache import NULL_BLOCK_ID
from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.engine.hf_models import save_hf_model

WINDOW, BLOCK_SIZE = 8, 4
SECRET = "a-test-secret-of-enough-length"


async def _stream(worker, request: WorkerRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in worker.generate(request)]


def _windowed_engine(tmp_path) -> dict[str, object]:
    save_hf_model(tmp_path, transformers.MistralConfig, sliding_window=WINDOW)
    # 8-token chunks: the window leaves the prompt's first blocks while it is prefilled.
    return dict(
        model=str(tmp_path),
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_num_batched_tokens=8,
        hash_seed=0,
    )


def _workers(engine: dict[str, object]) -> tuple[PrefillWorker, DecodeWorker]:
    def spec(worker_id: str, role: str) -> WorkerSpec:
        return WorkerSpec(
            worker_id,
            EngineConfig(engine_id=worker_id, **engine),
            KVConnectorConfig(role=role, secret=SECRET),
        )

    return PrefillWorker(spec("prefill-0", "producer")), DecodeWorker(spec("decode-0", "consumer"))


def _hand_off(
    prefill: PrefillWorker,
    decode: DecodeWorker,
    prompt: list[int],
    params: SamplingParams,
    corrupt_block: int | None = None,
) -> tuple[list[GenerationChunk], list[GenerationChunk]]:
    """Prefills ``prompt`` and decodes it from the hand-off; ``corrupt_block``: that page of
    the hand-off changes after its checksum was promised, so the pull falls short there."""

    async def disaggregated() -> tuple[list[GenerationChunk], list[GenerationChunk]]:
        first = await _stream(
            prefill,
            WorkerRequest(
                "w0", prompt, dataclasses.replace(params, max_tokens=1), remote_decode=True
            ),
        )
        hand_off = first[-1].kv_transfer_params
        if corrupt_block is not None:
            prefill.engine.runner.kv_cache[hand_off.block_ids[corrupt_block]].view(-1)[5] += 1.0
        rest = await _stream(
            decode, WorkerRequest("w0", prompt, params, kv_transfer_params=hand_off)
        )
        return first, rest

    return asyncio.run(disaggregated())


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "a-page-changed"])
def test_a_windowed_prompt_pulls_only_the_blocks_its_window_still_reads(tmp_path, corrupt):
    """With a page changed after the hand-off, the pull falls short: the blocks before the
    window were dropped for it, so the prompt is computed again from the start."""
    engine = _windowed_engine(tmp_path)
    prompt = [random.Random(3).randrange(2, 96) for _ in range(30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first_read = (len(prompt) - WINDOW + 1) // BLOCK_SIZE  # the first block the window reads
    expected = LLMEngine.from_pretrained(**engine).generate([prompt], [params])[0].output_token_ids
    prefill, decode = _workers(engine)
    try:
        first, rest = _hand_off(prefill, decode, prompt, params, first_read if corrupt else None)
        hand_off = first[-1].kv_transfer_params
        dropped = [i for i, block_id in enumerate(hand_off.block_ids) if block_id == NULL_BLOCK_ID]
        held = len(hand_off.block_ids) - len(dropped)
        assert dropped == list(range(len(dropped))) and 0 < held < len(hand_off.block_ids)
        assert [t for chunk in rest for t in chunk.new_token_ids] == expected
        stats = decode.engine.stats()
        provenance = rest[-1].kv_provenance
        if corrupt:
            assert stats.num_recompute_fallbacks == 1 and stats.transfer.num_failed_blocks == 1
            assert provenance.num_recomputed_tokens == len(prompt)
            return
        assert stats.num_recompute_fallbacks == 0 and stats.transfer.num_failed_blocks == 0
        assert provenance.num_pulled_tokens == len(prompt)
        # Only the blocks the next token's window reads were sent: fewer than the prefill held.
        assert stats.transfer.num_blocks_received == len(hand_off.block_ids) - first_read < held
        # The decode worker's blocks before the window were never cached.
        manager = decode.engine.kv_cache_manager
        group_ids = manager.coordinator.kv_cache_group_ids

        def cached(index: int) -> bool:
            return (
                manager.block_pool.get_cached_block(hand_off.block_hashes[index], group_ids)
                is not None
            )

        assert not any(cached(i) for i in range(first_read))
        assert all(cached(i) for i in range(first_read, len(hand_off.block_hashes)))
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()


def test_a_pull_that_falls_short_after_a_local_prefix_hit_recomputes_over_held_blocks(tmp_path):
    """The decode worker holds the prompt's first 40 tokens (another request's), pulls the
    last 10, and the first pulled page arrives changed. Recomputing from there reads the
    window's 7 tokens before it, in prefix-hit blocks the admission had already given up
    to the window (the null block stood in their place, and the tokens came out wrong): the
    prompt starts over instead, from its prefix hit, and the tokens equal colocated."""
    engine = _windowed_engine(tmp_path)
    rng = random.Random(3)
    shared = [rng.randrange(2, 96) for _ in range(40)]  # 10 blocks
    other = shared + [rng.randrange(2, 96) for _ in range(6)]
    prompt = shared + [rng.randrange(2, 96) for _ in range(10)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLMEngine.from_pretrained(**engine).generate([prompt], [params])[0].output_token_ids
    prefill, decode = _workers(engine)
    try:
        decode.engine.generate([other], [dataclasses.replace(params, max_tokens=2)])
        # The null block's page is never read: filled with large values, any read of it
        # changes the tokens, whatever the random weights would have made of its contents.
        decode.engine.runner.kv_cache[NULL_BLOCK_ID].fill_(100.0)
        first, rest = _hand_off(prefill, decode, prompt, params, corrupt_block=10)
        assert [t for chunk in rest for t in chunk.new_token_ids] == expected
        stats = decode.engine.stats()
        assert stats.num_recompute_fallbacks == 1 and stats.transfer.num_failed_blocks == 1
    finally:
        decode.engine.shutdown()
        prefill.engine.shutdown()
