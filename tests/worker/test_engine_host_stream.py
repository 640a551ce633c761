"""The worker's stream (``EngineHost.generate``) sends text deltas that add up to the reply.

A stop string whose first characters arrive a step before the rest used to leave those
characters in the stream and in the gateway's reply: the host had already sent them when the
engine cut its text at the stop. The worker runs here without Ray, colocated (no connector).
"""

from __future__ import annotations

import asyncio

from pdserve.engine import SamplingParams
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

PROMPT = [5, 17, 99, 3, 42, 8, 230, 11, 64, 7]


def stream(worker: PrefillWorker, request_id: str, params: SamplingParams) -> list[GenerationChunk]:
    async def collect() -> list[GenerationChunk]:
        return [chunk async for chunk in worker.generate(WorkerRequest(request_id, PROMPT, params))]

    return asyncio.run(collect())


def test_streamed_text_adds_up_to_the_reply_when_a_stop_string_spans_two_chunks() -> None:
    worker = PrefillWorker(WorkerSpec("w0", EngineConfig(engine_id="w0", **ENGINE_KWARGS)))
    try:
        free_run = stream(worker, "free", SamplingParams(max_tokens=24, temperature=0.0))
        final = "".join(chunk.text_delta for chunk in free_run)
        ends, total = [], 0
        for chunk in free_run[:-1]:
            total += len(chunk.text_delta)
            ends.append(total)
        splits = [
            e for e in ends if 0 < e < len(final) and final.index(final[e - 1 : e + 1]) == e - 1
        ]
        assert splits, f"no chunk boundary to split a stop string over in {final!r}"
        for number, split in enumerate(splits[:4]):
            stop = final[split - 1 : split + 1]
            chunks = stream(
                worker, f"stop{number}", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])
            )
            assert chunks[-1].finished and chunks[-1].stop_reason == stop
            assert "".join(chunk.text_delta for chunk in chunks) == final[: split - 1], stop
    finally:
        worker.engine.shutdown()
