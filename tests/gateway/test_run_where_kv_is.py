"""A turn run whole on a decode worker goes to the worker that holds its history.

``decide_disaggregation`` picks that worker by the longest prefix it holds, counting its KV
tier and each windowed group's window (``pick_decode_by_prefix``); the prefill phase must
send the request there and not re-pick by another measure. Without Ray: the gateway's
``RequestOrchestrator`` against workers that stand in for the real ones behind the same
``WorkerPool`` surface (``stream``, ``call``), fed the KV events a real worker would send,
so that a history can sit in a decode worker's tier, or lose its windowed group's old
blocks, exactly and at once. A real 1 + 1 app runs such a turn in
tests/service/test_conditional_disagg.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.cache import BlockHasher, BlockRemoved, BlockStored
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.worker_pool import WorkerPool
from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.sampling_params import SamplingParams

BLOCK_SIZE = 16
WINDOW = 32  # tokens: a windowed group needs the last two blocks of a prefix
PROMPT = list(range(1, 601))  # turn 2: turn 1's prompt (160), its answer (320), a message
HASHES = BlockHasher("xxh3_128", 0).hash_request_blocks(PROMPT, BLOCK_SIZE)
TURN_1 = HASHES[:10]  # what the prefill worker computed
HISTORY = HASHES[:30]  # turn 1's prompt and answer: only the decode worker that decoded it


class StandInPool(WorkerPool):
    """The pool, whose workers answer each request with one finished chunk (or break the
    stream of a worker in ``lost``, as a dead replica's does); records which worker each
    request went to."""

    def __init__(self, lost: frozenset[str] = frozenset(), num_prefill: int = 1) -> None:
        super().__init__(
            dict.fromkeys(f"prefill-{i}" for i in range(num_prefill)),
            dict.fromkeys(("decode-0", "decode-1")),
        )
        self.lost = lost
        self.streamed_to: list[str] = []

    def stream(self, worker_id: str, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        self.streamed_to.append(worker_id)

        async def chunks() -> AsyncIterator[GenerationChunk]:
            if worker_id in self.lost:
                raise ConnectionError(f"{worker_id} is gone")
            yield GenerationChunk(request.request_id, [7], "x", 1, True, "length")

        return chunks()

    async def call(self, worker_id: str, method: str, *args: object) -> KVEventBatch:
        assert method == "kv_events", method  # the poll after a finished run: nothing new
        (cursor,) = args
        return KVEventBatch(worker_id, "i0", cursor, cursor, [])


def stored(hashes, group=None, kind=None, window=None, medium=None) -> BlockStored:
    return BlockStored(list(hashes), None, [], BLOCK_SIZE, None, group, kind, window, medium)


def both_groups(hashes) -> list[BlockStored]:
    """A model with a full-attention group and a windowed one: a block of each per hash."""
    return [
        stored(hashes, 0, "full_attention"),
        stored(hashes, 1, "sliding_window", WINDOW),
    ]


def run_turn(
    pool: StandInPool, events: dict[str, list], in_flight: dict[str, int] | None = None
) -> RequestOrchestrator:
    """Runs PROMPT once, the router fed ``events`` and holding ``in_flight`` requests per
    worker (its load) beforehand."""
    config = GatewayConfig(
        model="tiny",
        model_name="tiny",
        disagg_min_uncached_tokens=0,
        decode_reuse_min_tokens=128,
        retry_backoff_s=0.0,
    )
    info = ModelInfo("tiny", 4096, BLOCK_SIZE, "xxh3_128", 0, [0])
    orchestrator = RequestOrchestrator(config, pool, info, None)  # type: ignore[arg-type]
    for worker_id, worker_events in events.items():
        orchestrator.router.apply(
            KVEventBatch(worker_id, "i0", 0, len(worker_events), worker_events)
        )
    for worker_id, count in (in_flight or {}).items():
        for _ in range(count):
            orchestrator.router.begin(worker_id)

    async def turn() -> list:
        run = await orchestrator.new_run("turn-2", PROMPT, SamplingParams(max_tokens=8), None)
        return [delta async for delta in orchestrator.run_phases(run)]

    assert asyncio.run(turn()), "the turn streamed nothing back"
    return orchestrator


@pytest.mark.parametrize(
    "decode_1_events",
    [
        # Its pool evicted the history to its CPU tier: still where it is.
        [stored(HISTORY, medium="cpu")],
        # The windowed group kept only the last window's blocks; a prefix needs no more.
        both_groups(HISTORY) + [BlockRemoved(list(HISTORY[:28]), 1)],
    ],
    ids=["in-its-tier", "windowed-group-evicted"],
)
def test_the_turn_runs_on_the_decode_worker_holding_its_history(decode_1_events) -> None:
    """decode-0 holds turn 1's prompt in every group (a count of pool blocks held would
    prefer it), decode-1 the whole history as a prefix: the turn runs there."""
    pool = StandInPool()
    orchestrator = run_turn(
        pool,
        {
            "prefill-0": both_groups(TURN_1),
            "decode-0": both_groups(TURN_1),
            "decode-1": decode_1_events,
        },
    )
    assert pool.streamed_to == ["decode-1"]
    assert orchestrator.metrics.num_turns_run_where_kv_is == 1


def test_a_turn_whose_decode_worker_is_lost_runs_on_the_one_with_the_next_longest_prefix() -> None:
    """decode-1, which holds the history, breaks before answering: the retry goes to the
    decode worker now holding most of the prompt's prefix (decode-0: turn 1's prompt), still
    run whole there, not handed to the prefill worker."""
    pool = StandInPool(lost=frozenset({"decode-1"}))
    run_turn(
        pool,
        {
            "prefill-0": [stored(TURN_1)],
            "decode-0": [stored(TURN_1)],
            "decode-1": [stored(HISTORY)],
        },
    )
    assert pool.streamed_to == ["decode-1", "decode-0"]


def test_a_prompt_whose_prefix_a_busy_prefill_worker_holds_is_still_handed_off() -> None:
    """decode-0 pulled a shared prefix (160 tokens, over decode_reuse_min_tokens) that
    prefill-0 computed; prefill-0 is too busy to be picked (5 requests in flight, over the
    load cap of 4) and prefill-1 holds nothing. No decode worker holds more than a prefill
    worker does, so the prompt goes to prefill-1 and is handed off, not computed whole on
    decode-0 between its rows' decode steps (the cold worker's empty cache is not the
    role's)."""
    pool = StandInPool(num_prefill=2)
    orchestrator = run_turn(
        pool,
        {"prefill-0": [stored(TURN_1)], "prefill-1": [], "decode-0": [stored(TURN_1)]},
        in_flight={"prefill-0": 5},
    )
    assert pool.streamed_to[0] == "prefill-1"
    assert orchestrator.metrics.num_requests_prefilled_on_decode == 0
    assert orchestrator.metrics.num_turns_run_where_kv_is == 0
