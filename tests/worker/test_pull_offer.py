"""``DecodeWorker.pull_offer``: a chunk-wise hand-off's offer pulled into the decode worker's
prefix cache, here without Ray (the worker in this process, a producer engine's transfer
service on 127.0.0.1, real gRPC)."""

from __future__ import annotations

import asyncio

from pdserve.decode.worker import DecodeWorker
from pdserve.engine import SamplingParams
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import WorkerRequest
from pdserve.messages.worker_spec import WorkerSpec
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS
from tests.kvconnector.test_chunked_handoff import (
    first_offer,
    make_prefill_engine,
    wait_prefill_idle,
)


def test_two_pulls_of_one_requests_offer_at_once_both_answer() -> None:
    """A prefill retried elsewhere and back can have the gateway send a request's offer to
    the same decode worker while its first pull still runs: each call answers (one pulls
    the blocks, the other finds them there or pulls them too), and nothing is left held."""
    prefill = make_prefill_engine("grpc")
    decode = DecodeWorker(
        WorkerSpec(
            "decode-0",
            EngineConfig(engine_id="decode-0", hash_seed=0, **ENGINE_KWARGS),
            KVConnectorConfig(role="consumer", transfer_timeout_s=10.0),
        )
    )
    try:
        prompt = [(7 * i + 1) % 256 for i in range(200)]
        offer = first_offer(prefill, "r0", prompt)
        request = WorkerRequest(
            "r0",
            prompt[: offer.num_tokens],
            SamplingParams(max_tokens=1),
            kv_transfer_params=offer,
        )

        async def pull_twice():
            return await asyncio.wait_for(
                asyncio.gather(decode.pull_offer(request), decode.pull_offer(request)), 60
            )

        first, second = asyncio.run(pull_twice())
        assert first is not None and second is not None
        assert first.num_blocks_pulled + second.num_blocks_pulled >= len(offer.block_ids)
        prefill.abort("r0")
        wait_prefill_idle(prefill)
        assert decode.engine.kv_cache_manager.usage == 0
        assert not decode.engine.has_unfinished_requests()
    finally:
        prefill.shutdown()
        decode.engine.shutdown()
