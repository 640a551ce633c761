"""Admission and availability at the gateway, without Ray: 429 when the in-flight queue is
full, 503 when no worker of a needed role answers, and routing resumes when it answers again.

The workers are fakes behind the same ``WorkerPool`` surface the gateway uses (``call``,
``stream``), so these run in milliseconds and can make a worker fail on purpose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.sampling_params import SamplingParams
from pdserve.tokenizer.tokenizer import ByteTokenizer
from pdserve.prefill.gateway.http_ingress import _error_response
from pdserve.prefill.gateway.config import GatewayConfig
from pdserve.prefill.gateway.openai_schema import APIError
from pdserve.prefill.gateway.orchestrator import RequestOrchestrator

PARAMS = SamplingParams(max_tokens=4, temperature=0, seed=1)


class FakeWorker:
    """Answers the event poll and streams a fixed reply, unless told to be down or to hang."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.down = False
        self.hang = False

    async def kv_events(self, since_seq: int) -> KVEventBatch:
        if self.hang:
            await asyncio.sleep(3600)
        if self.down:
            raise ConnectionError(f"{self.worker_id} is dead")
        return KVEventBatch(self.worker_id, "instance", since_seq, since_seq)

    async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        if self.down:
            raise ConnectionError(f"{self.worker_id} is dead")
        num_tokens = request.params.max_tokens
        yield GenerationChunk(request.request_id, [65] * num_tokens, "A" * num_tokens,
                              num_tokens, True, "length" if request.remote_decode else "stop")


class FakePool:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill = {w: FakeWorker(w) for w in prefill}
        self.decode = {w: FakeWorker(w) for w in decode}
        self.all = {**self.prefill, **self.decode}

    def stream(self, worker_id: str, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        return self.all[worker_id].generate(request)

    async def call(self, worker_id: str, method: str, *args):
        return await getattr(self.all[worker_id], method)(*args)


def make_service(pool: FakePool, **fields) -> RequestOrchestrator:
    config = GatewayConfig(model="tiny", model_name="tiny", worker_timeout_s=0.05, **fields)
    info = ModelInfo("tiny", 256, 16, "xxh3_128", 0, [256])
    return RequestOrchestrator(config, pool, info, ByteTokenizer(512))


async def run(service: RequestOrchestrator, prompt: str = "hello world") -> str:
    token_ids = service.tokenizer.encode(prompt)
    return "".join([d.text async for d in service.generate("r", token_ids, PARAMS)])


def test_requests_over_the_inflight_limit_get_429_until_one_is_released():
    service = make_service(FakePool(["prefill-0"], []), max_inflight_requests=2)
    service.admit()
    service.admit()
    with pytest.raises(APIError) as caught:
        service.admit()
    assert (caught.value.status, caught.value.body()["error"]["code"]) == (429, "rate_limit_exceeded")
    service.release()
    service.admit()


@pytest.mark.parametrize("failure", ["down", "hang"])
def test_with_every_decode_worker_failing_the_poll_requests_get_503_until_one_answers(failure):
    async def scenario() -> None:
        pool = FakePool(["prefill-0"], ["decode-0"])
        service = make_service(pool)
        assert await run(service) == "AAAA"
        setattr(pool.decode["decode-0"], failure, True)
        await service.poller.refresh("decode-0")
        with pytest.raises(APIError) as caught:
            await run(service)
        assert (caught.value.status, caught.value.body()["error"]["code"]) == (503, "no_worker_available")
        assert "decode" in caught.value.message
        setattr(pool.decode["decode-0"], failure, False)
        await service.poller.refresh("decode-0")
        assert await run(service) == "AAAA"

    asyncio.run(scenario())


def test_a_prefill_worker_that_dies_mid_call_gets_503_and_leaves_routing():
    async def scenario() -> None:
        pool = FakePool(["prefill-0", "prefill-1"], [])
        service = make_service(pool)
        pool.prefill["prefill-0"].down = True
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(await run(service))
            except APIError as error:
                outcomes.append(error.status)
        # At most the first pick of the dead worker fails; afterwards only prefill-1 serves.
        assert outcomes.count(503) <= 1 and outcomes[-2:] == ["AAAA", "AAAA"]
        assert not service.router.is_available("prefill-0")

    asyncio.run(scenario())


@pytest.mark.parametrize("status", [429, 503])
def test_refusals_to_retry_carry_retry_after_and_an_openai_error_body(status):
    service = make_service(FakePool(["prefill-0"], []), retry_after_s=2)
    response = _error_response(service, APIError(status, "busy", code="x"))
    assert response.status_code == status
    assert response.headers["retry-after"] == "2"
    assert json.loads(response.body)["error"]["message"] == "busy"
    assert service.metrics.rejected_by_status == {str(status): 1}


@pytest.mark.parametrize("refused, status", [(True, 400), (False, 500)])
def test_a_worker_refusal_is_the_clients_fault_and_a_worker_failure_is_the_servers(refused, status):
    class FailingWorker(FakeWorker):
        async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
            yield GenerationChunk(request.request_id, [], "", 0, True, "error",
                                  error="the worker said no", refused=refused)

    async def scenario() -> None:
        pool = FakePool(["prefill-0"], [])
        pool.prefill["prefill-0"] = pool.all["prefill-0"] = FailingWorker("prefill-0")
        with pytest.raises(APIError) as caught:
            await run(make_service(pool))
        assert caught.value.status == status
        assert "the worker said no" in caught.value.message

    asyncio.run(scenario())
