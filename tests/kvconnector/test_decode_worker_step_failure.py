"""A decode worker whose engine step fails frees every request's blocks, loading ones too.

The worker (``DecodeWorker``, the Ray actor's body, run here without Ray) pulls from a real
prefill engine in another process. The step failure is injected: ``_finish_load`` raises as
an engine bug would, after the step took the pull's "loaded" notice from the connector.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.decode.worker import DecodeWorker
from pdserve.engine import SamplingParams
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from tests.kvconnector.disaggregation import random_prompts
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS


def test_a_step_failure_frees_a_request_whose_loaded_notice_it_took(
    prefill_factory, monkeypatch
) -> None:
    prefill = prefill_factory(transport="grpc")
    worker = DecodeWorker(
        WorkerSpec(
            "decode-0",
            EngineConfig(engine_id="decode-0", **ENGINE_KWARGS),
            KVConnectorConfig(role="consumer"),
        )
    )
    prompt = random_prompts(25, 1)[0]
    params = SamplingParams(max_tokens=5, temperature=0.0, seed=1)
    prefilled = prefill.prefill("s0", prompt, params)

    def engine_bug(*args: object) -> None:
        raise RuntimeError("an engine bug, injected by the test")

    monkeypatch.setattr(worker.engine.scheduler, "_finish_load", engine_bug)
    request = WorkerRequest(
        "s0", prompt, dataclasses.replace(params), kv_transfer_params=prefilled.kv_transfer_params
    )

    async def run() -> list:
        chunks = [chunk async for chunk in worker.generate(request)]
        await worker.stats()  # one more op on the engine thread: the failed step is over
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1].finish_reason == "error" and chunks[-1].error == "internal engine error"
    engine = worker.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0, "the loaded request's blocks leaked"
    assert not engine.connector.has_pending_loads()
    prefill.wait_until_idle()
    engine.shutdown()
