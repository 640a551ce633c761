"""Admission and availability at the gateway, without Ray: 429 when the in-flight queue is
full, 503 when no worker of a needed role answers, and routing resumes when it answers again.

The workers are fakes behind the same ``WorkerPool`` surface the gateway uses (``call``,
``stream``), so these run in milliseconds and can make a worker fail on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI, Request

from pdserve.gateway.admission import ReleaseSlotsAtRequestEnd
from pdserve.gateway.api.openai_schema import APIError, too_many_requests
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.http_ingress import _error_response, complete
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.gateway.worker_pool import NoModelInfo, WorkerPool
from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.sampling_params import SamplingParams
from pdserve.tokenizer.tokenizer import ByteTokenizer

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
        yield GenerationChunk(
            request.request_id,
            [65] * num_tokens,
            "A" * num_tokens,
            num_tokens,
            True,
            "length" if request.remote_decode else "stop",
        )


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

    async def admit_past_the_limit() -> None:
        await service.admit()
        await service.admit()
        with pytest.raises(APIError) as caught:
            await service.admit()
        assert (caught.value.status, caught.value.body()["error"]["code"]) == (
            429,
            "rate_limit_exceeded",
        )
        service.release()
        await service.admit()

    asyncio.run(admit_past_the_limit())


def test_a_replicas_429_names_its_share_and_the_services_limit():
    """With two gateway replicas each admits half; its 429 named only the half (2), which
    read as a wrong setting to a client that had configured 4. (Several replicas need the
    Ray app's board: the message is checked here, the split in test_gateway_replicas.py.)"""
    message = too_many_requests(2, 4).message
    assert "limit of 2 requests in flight (this gateway replica's share of 4)" in message
    assert "share" not in too_many_requests(4, 4).message


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
        assert (caught.value.status, caught.value.body()["error"]["code"]) == (
            503,
            "no_worker_available",
        )
        assert "decode" in caught.value.message
        setattr(pool.decode["decode-0"], failure, False)
        await service.poller.refresh("decode-0")
        assert await run(service) == "AAAA"

    asyncio.run(scenario())


def test_a_prefill_worker_that_dies_mid_call_gets_503_and_leaves_routing():
    async def scenario() -> None:
        pool = FakePool(["prefill-0", "prefill-1"], [])
        service = make_service(pool, max_attempts=1)  # no retry: the loss reaches the client
        pool.prefill["prefill-0"].down = True
        service.router.set_available("prefill-1", False)  # the request must pick prefill-0
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(await run(service))
            except APIError as error:
                outcomes.append(error.status)
            service.router.set_available("prefill-1", True)
        assert outcomes == [503, "AAAA", "AAAA"]
        assert not service.router.is_available("prefill-0")

    asyncio.run(scenario())


def test_the_only_prefill_worker_lost_before_answering_is_tried_again_once_restarted():
    """Its role's only worker: the router marks it down at the loss, and the retry must not
    answer 503 for that (it used to, when the kill raced the request's arrival); it tries
    the worker again after the backoff, as Serve restarts it, and the reply comes whole."""

    class RestartedAfterOneLoss(FakeWorker):
        calls = 0

        async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
            self.calls += 1
            self.down = self.calls == 1  # the first call meets the dying replica
            async for chunk in super().generate(request):
                yield chunk

    async def scenario() -> None:
        pool = FakePool(["prefill-0"], [])
        worker = pool.prefill["prefill-0"] = pool.all["prefill-0"] = RestartedAfterOneLoss(
            "prefill-0"
        )
        service = make_service(pool, retry_backoff_s=0.0)
        assert await run(service) == "AAAA"
        assert worker.calls == 2 and service.metrics.num_retries == 1

    asyncio.run(scenario())


class DiesMidStream(FakeWorker):
    """Runs requests whole (colocated): its first stream sends two tokens and dies; the
    next streams the whole reply, from the first token (``replayed`` in its place)."""

    def __init__(self, worker_id: str, replayed: int = 65) -> None:
        super().__init__(worker_id)
        self.replayed = replayed
        self.calls = 0

    async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        self.calls += 1
        rid = request.request_id
        if self.calls == 1:
            yield GenerationChunk(rid, [65, 65], "AA", 2, False, None)
            raise ConnectionError(f"{self.worker_id} died mid-stream")
        tokens = [self.replayed] + [65] * 3
        yield GenerationChunk(rid, tokens, "".join(map(chr, tokens)), 4, True, "length")


@pytest.mark.parametrize("replayed", [65, 66], ids=["same-tokens", "diverged"])
def test_a_request_run_whole_is_replayed_after_its_worker_dies_mid_stream(replayed):
    """Colocated (or run whole on a decode worker), the stream's worker dies after two
    tokens were sent: the request runs again with its seed and only the tokens after the
    two sent ones go out (it used to end with an error); a replay whose first tokens differ
    from those sent ends with an error, never a different reply."""

    async def scenario() -> None:
        pool = FakePool(["prefill-0"], [])
        worker = pool.prefill["prefill-0"] = pool.all["prefill-0"] = DiesMidStream(
            "prefill-0", replayed
        )
        service = make_service(pool, retry_backoff_s=0.0)
        deltas = []
        with pytest.raises(APIError) if replayed != 65 else contextlib.nullcontext() as caught:
            async for delta in service.generate("r", service.tokenizer.encode("hi"), PARAMS):
                deltas.append(delta.text)
        assert worker.calls == 2 and service.metrics.num_retries == 1
        if replayed == 65:
            assert deltas == ["AA", "AA"]  # every token once
        else:
            assert deltas == ["AA"] and caught.value.status == 500
            assert caught.value.code == "replay_diverged"

    asyncio.run(scenario())


def test_a_prefill_worker_that_dies_before_answering_is_routed_around_unseen():
    async def scenario() -> None:
        pool = FakePool(["prefill-0", "prefill-1"], [])
        service = make_service(pool)
        pool.prefill["prefill-0"].down = True
        assert [await run(service) for _ in range(4)] == ["AAAA"] * 4
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
            yield GenerationChunk(
                request.request_id,
                [],
                "",
                0,
                True,
                "error",
                error="the worker said no",
                refused=refused,
            )

    async def scenario() -> None:
        pool = FakePool(["prefill-0"], [])
        pool.prefill["prefill-0"] = pool.all["prefill-0"] = FailingWorker("prefill-0")
        with pytest.raises(APIError) as caught:
            await run(make_service(pool))
        assert caught.value.status == status
        assert "the worker said no" in caught.value.message

    asyncio.run(scenario())


# ---------------------------------------------------------------------- the slot's life (ASGI)


def completion_app(service: RequestOrchestrator):
    """The gateway's completion route on ``service``, with the gateway's middleware."""
    app = FastAPI()
    app.add_middleware(ReleaseSlotsAtRequestEnd)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(service, request)

    return app


async def call_asgi(app, body: dict, send) -> None:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    disconnected = asyncio.Event()

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    try:
        await app(scope, receive, send)
    finally:
        disconnected.set()


BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_the_body_starts_frees_its_slot(stream):
    """The connection resets as the status line goes out: the body never starts, and the
    slot must be freed anyway (it was freed only in the SSE body's ``finally`` before)."""

    async def scenario() -> None:
        service = make_service(FakePool(["prefill-0"], []), max_inflight_requests=1)

        async def reset_connection(message: dict) -> None:
            raise ConnectionResetError("the client reset the connection")

        with pytest.raises(ConnectionResetError):
            await call_asgi(completion_app(service), {**BODY, "stream": stream}, reset_connection)
        assert service.metrics.num_requests_in_flight == 0
        assert service.metrics.num_requests == 1  # it was admitted, then freed
        sent: list[dict] = []

        async def record(message: dict) -> None:
            sent.append(message)

        await call_asgi(completion_app(service), BODY, record)  # not a 429: the slot is free
        assert sent[0]["status"] == 200

    asyncio.run(scenario())


def test_a_request_cancelled_before_its_response_starts_frees_its_slot():
    async def scenario() -> None:
        service = make_service(FakePool(["prefill-0"], []))
        response_started = asyncio.Event()

        async def stall(message: dict) -> None:
            response_started.set()
            await asyncio.Event().wait()  # a proxy that never drives the body

        call = asyncio.ensure_future(
            call_asgi(completion_app(service), {**BODY, "stream": True}, stall)
        )
        await response_started.wait()
        assert service.metrics.num_requests_in_flight == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert service.metrics.num_requests_in_flight == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------------- start-up


class ModelInfoHandle:
    """A worker's Serve handle as far as ``model_info`` goes: answers, fails, or hangs (a
    dead worker Serve has not noticed yet: a real one cannot be held in that state)."""

    def __init__(self, behaviour: str) -> None:
        async def model_info() -> ModelInfo:
            if behaviour == "hang":
                await asyncio.Event().wait()
            if behaviour == "fail":
                raise ConnectionError("the actor died")
            return ModelInfo("tiny", 256, 16, "xxh3_128", 0, [256])

        self.model_info = type("Method", (), {"remote": staticmethod(model_info)})


@pytest.mark.parametrize("prefill_0", ["hang", "fail"])
def test_start_up_takes_the_model_from_any_prefill_worker_not_only_prefill_0(prefill_0):
    pool = WorkerPool(
        {"prefill-0": ModelInfoHandle(prefill_0), "prefill-1": ModelInfoHandle("answer")}, {}
    )
    info = asyncio.run(pool.first_model_info(timeout_s=60))
    assert info.model == "tiny"


def test_start_up_with_no_prefill_worker_answering_fails_within_its_timeout_naming_them():
    pool = WorkerPool(
        {"prefill-0": ModelInfoHandle("hang"), "prefill-1": ModelInfoHandle("fail")}, {}
    )
    with pytest.raises(NoModelInfo, match=r"prefill-0.*prefill-1.*the actor died"):
        asyncio.run(pool.first_model_info(timeout_s=0.2))


# ---------------------------------------------------------------------- worker errors


@pytest.mark.parametrize(
    "raised, lost",
    [
        (ValueError("a bug in the worker"), False),
        (ConnectionError("the actor died"), True),
    ],
)
def test_a_worker_bug_fails_the_request_but_keeps_the_worker_a_lost_worker_leaves_routing(
    raised, lost
):
    """A worker's deterministic error reaches the gateway as Ray's ``RayTaskError`` (built
    here as Ray builds it); a dead actor's as anything else."""
    from ray.exceptions import RayTaskError

    class BrokenWorker(FakeWorker):
        async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
            if not lost:
                raise RayTaskError("generate", "traceback", raised).as_instanceof_cause()
            raise raised
            yield  # an async generator

    async def scenario() -> None:
        pool = FakePool(["prefill-0"], [])
        pool.prefill["prefill-0"] = pool.all["prefill-0"] = BrokenWorker("prefill-0")
        service = make_service(pool)
        with pytest.raises(APIError) as caught:
            await run(service)
        assert caught.value.status == (503 if lost else 500)
        assert service.router.is_available("prefill-0") is not lost
        assert (service.metrics.num_retries > 0) is lost

    asyncio.run(scenario())


class LeasingWorker(FakeWorker):
    """A prefill worker whose first token comes with a lease (and a tail page), and that
    records releases; its hand-offs are kept."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(worker_id)
        self.released: list[str] = []
        self.handed_off: list[KVTransferParams] = []

    async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        params = KVTransferParams(
            "engine", "127.0.0.1:1", "lease-1", [1], [], [0], 5, 65, 1, time.time() + 30
        )
        params.tail_block_ids, params.tail_pages = [1], bytes(64)
        self.handed_off.append(params)
        yield GenerationChunk(
            request.request_id, [65], "A", 1, True, "length", kv_transfer_params=params
        )

    async def abort(self, request_id: str, call_serial: int | None = None) -> None:
        self.released.append(request_id)


def leasing_service() -> tuple[RequestOrchestrator, LeasingWorker]:
    """A gateway over one leasing prefill worker and a decode worker, always handing off."""
    pool = FakePool([], ["decode-0"])
    prefill = LeasingWorker("prefill-0")
    pool.prefill = {"prefill-0": prefill}
    pool.all = {**pool.prefill, **pool.decode}
    return make_service(pool, disagg_min_uncached_tokens=0), prefill


@pytest.mark.parametrize("hang_up_after", [1, 2])
def test_a_client_hanging_up_at_any_token_releases_the_prefill_lease_at_once(hang_up_after):
    """1: right after the first token, before the hand-off (the lease stayed held until its
    TTL before the fix); 2: mid-decode."""

    async def scenario() -> None:
        service, prefill = leasing_service()
        params = SamplingParams(max_tokens=4, temperature=0, seed=1)
        stream = service.generate("r", service.tokenizer.encode("hello"), params)
        for _ in range(hang_up_after):
            await anext(stream)
        await stream.aclose()  # the client went away
        for _ in range(20):  # the release runs as its own task
            await asyncio.sleep(0)
        assert prefill.released == ["r"]

    asyncio.run(scenario())


def test_no_reply_and_no_recent_request_carries_the_lease_id():
    """A lease id is a bearer capability for the prefill's KV pages: it stays between the
    workers and the gateway (before the fix every reply's kv_provenance and /v1/requests
    carried it)."""

    async def scenario() -> None:
        service, prefill = leasing_service()
        params = SamplingParams(max_tokens=4, temperature=0, seed=1)
        deltas = [d async for d in service.generate("r", service.tokenizer.encode("hi"), params)]
        provenance = deltas[-1].kv_provenance.to_json()
        assert provenance["transfer"]["handed_off"] is True
        assert "lease-1" not in json.dumps(provenance)
        assert "lease-1" not in json.dumps([r.to_json() for r in service.recent.latest(10)])

    asyncio.run(scenario())


def test_the_gateway_keeps_no_copy_of_a_hand_offs_tail_pages_once_decode_answers():
    """The decode worker got the pages with the hand-off; the reply's stream may last
    minutes, and the gateway holds none of them meanwhile."""

    class RecordingDecode(FakeWorker):
        tail_sizes: list[int] = []

        async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
            assert request.kv_transfer_params is not None
            self.tail_sizes.append(len(request.kv_transfer_params.tail_pages))
            async for chunk in super().generate(request):
                yield chunk

    async def scenario() -> None:
        service, prefill = leasing_service()
        decode = RecordingDecode("decode-0")
        service.workers.decode["decode-0"] = service.workers.all["decode-0"] = decode
        await run(service)
        assert decode.tail_sizes == [64]  # the decode call carried the page
        (params,) = prefill.handed_off
        assert params.tail_pages == b"" and params.lease_id == "lease-1"

    asyncio.run(scenario())
