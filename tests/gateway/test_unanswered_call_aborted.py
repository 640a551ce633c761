"""A call the gateway gives up on before it answered is aborted on its worker.

Issue 51: the fault matrix's resumed prefill (SIGSTOP, then SIGCONT) still held a lease of 18
blocks. The gateway had given the call up once the worker left routing and cancelled its
stream, but Serve's cancel is best effort: the call, already handed to the stopped process,
ran when it resumed, and its cancel could land after it had finished and leased the prompt's
blocks for a hand-off nobody would pull. The gateway now also sends the worker ``abort`` for
the request, and a later call of the request to that same worker waits for that abort, which
would otherwise end it (or leave the request id held, refusing it).

Without Ray: the gateway's ``RequestOrchestrator`` against stand-in workers behind the same
``WorkerPool`` surface (``stream``, ``call``). A real app's hung prefill is the fault matrix's
row (tests/service/test_fault_matrix.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.cache import BlockHasher, BlockStored
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.sampling_params import SamplingParams
from tests.async_wait import until

BLOCK_SIZE = 16
PROMPT = list(range(1, 101))
HASHES = BlockHasher("xxh3_128", 0).hash_request_blocks(PROMPT, BLOCK_SIZE)


class HungPrefillPool:
    """prefill-0 is hung: every call to it waits until ``resumed`` is set, as Serve holds
    calls to a stopped process, and its event poll fails once it is called (it leaves
    routing). Any other worker answers at once. ``calls`` lists each call as it is made
    (a stream) or answered (an abort)."""

    def __init__(self, prefill_ids: tuple[str, ...]) -> None:
        self.prefill = dict.fromkeys(prefill_ids)
        self.decode: dict[str, None] = {}
        self.all = dict(self.prefill)
        self.resumed = asyncio.Event()
        self.calls: list[tuple[str, str]] = []
        self.serials: list[tuple[str, object]] = []  # each call's WorkerRequest.call_serial
        self.orchestrator: RequestOrchestrator | None = None

    def stream(self, worker_id: str, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        self.calls.append(("stream", worker_id))
        self.serials.append(("stream", request.call_serial))

        async def chunks() -> AsyncIterator[GenerationChunk]:
            if worker_id == "prefill-0" and not self.resumed.is_set():
                assert self.orchestrator is not None
                self.orchestrator.router.set_available(worker_id, False)  # its poll failed
                await self.resumed.wait()
            yield GenerationChunk(request.request_id, [7], "x", 1, True, "length")

        return chunks()

    async def call(self, worker_id: str, method: str, *args: object) -> object:
        if method == "kv_events":  # the poll after a finished run: nothing new
            (cursor,) = args
            return KVEventBatch(worker_id, "i0", cursor, cursor, [])
        if method == "engine_step_s":  # the heartbeat of a worker that is not hung
            return 0.0
        assert method == "abort", method
        if worker_id == "prefill-0":
            await self.resumed.wait()
        self.calls.append(("abort", worker_id))
        self.serials.append(("abort", args[1]))
        return None


def orchestrator_for(pool: HungPrefillPool) -> RequestOrchestrator:
    config = GatewayConfig(model="tiny", model_name="tiny", retry_backoff_s=0.0)
    info = ModelInfo("tiny", 4096, BLOCK_SIZE, "xxh3_128", 0, [0])
    orchestrator = RequestOrchestrator(config, pool, info, None)  # type: ignore[arg-type]
    # prefill-0 holds the prompt's prefix: the router sends the request there first.
    orchestrator.router.apply(
        KVEventBatch(
            "prefill-0", "i0", 0, 1, [BlockStored(list(HASHES), None, [], BLOCK_SIZE, None)]
        )
    )
    pool.orchestrator = orchestrator
    return orchestrator


async def complete(orchestrator: RequestOrchestrator) -> list:
    run = await orchestrator.new_run("r0", PROMPT, SamplingParams(max_tokens=1), None)
    return [delta async for delta in orchestrator.run_phases(run)]


def test_a_prefill_given_up_on_is_told_to_abort_the_request_once_it_resumes() -> None:
    pool = HungPrefillPool(("prefill-0", "prefill-1"))
    orchestrator = orchestrator_for(pool)

    async def scenario() -> None:
        assert await complete(orchestrator), "the request streamed nothing back"
        assert pool.calls == [("stream", "prefill-0"), ("stream", "prefill-1")]
        pool.resumed.set()
        await until(lambda: ("abort", "prefill-0") in pool.calls)
        # The abort names the call given up on, and only that one: a worker refuses that
        # call should the abort reach it first, and no other (EngineHost.abort).
        first_serial, retry_serial = (s for kind, s in pool.serials if kind == "stream")
        assert ("abort", first_serial) in pool.serials and first_serial != retry_serial

    asyncio.run(scenario())


def test_a_retry_on_the_worker_given_up_on_waits_for_the_abort_of_its_first_call() -> None:
    """A role's only prefill worker hangs: the retry goes to it again, after the abort."""
    pool = HungPrefillPool(("prefill-0",))
    orchestrator = orchestrator_for(pool)

    async def scenario() -> None:
        request = asyncio.ensure_future(complete(orchestrator))
        await until(lambda: not orchestrator.router.is_available("prefill-0"))
        await asyncio.sleep(0.5)  # given up on, retried: the retry waits for the worker
        pool.resumed.set()
        assert await request, "the request streamed nothing back"
        assert pool.calls == [
            ("stream", "prefill-0"),
            ("abort", "prefill-0"),
            ("stream", "prefill-0"),
        ]

    asyncio.run(scenario())
