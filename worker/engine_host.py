"""One ``LLMEngine`` inside a Ray actor: the step loop, streams, KV events and stats.

The role workers (``prefill.worker.PrefillWorker``, ``decode.worker.DecodeWorker``) are this
host plus the calls only their role answers. The host builds the connector its
``WorkerSpec`` describes (``kvconnector.pd_with_tier.worker_connector``: the P/D side, a KV
tier, both, or none) and knows the engine only through the connector seam, so it sits above
the connector and below both roles, which import it.

The engine is not thread-safe, so exactly one thread ever touches it: the host's *engine
thread*. Calls from the actor's event loop (add, abort, stats) are queued as ops and applied
by that thread before its next step; outputs travel back to each request's asyncio queue.

    event loop (Ray calls)                  engine thread
    generate(req) ─▶ ops.append(add) ───┐
    (cancelled) ───▶ ops.append(abort) ─┼─▶ apply ops; engine.step(); take KV events
    stats() ───────▶ ops.append(read) ──┘
    queue.get() ◀── call_soon_threadsafe ◀─ RequestOutput (a delta) per changed request
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pdserve import IMPORTED_AT
from pdserve.engine.kv_connector_base import KVConnectorBase
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request_output import RequestOutput
from pdserve.engine.tensor_parallel_peers import TensorParallelGroupLost
from pdserve.grammar import GrammarError
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.pd_with_tier import pd_part, worker_connector
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.lora_adapters import LoRAAdapterReport
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.messages.worker_stats import WorkerStats, per_tier
from pdserve.model.model_config import resolve_device
from pdserve.stats.start_phases import StartPhases, start_phase
from pdserve.worker.kv_event_log import KVEventLog

logger = logging.getLogger(__name__)

# The id a chunk-wise hand-off's offer runs under on a decode worker: the request's, this,
# and the call's serial number.
OFFER_SUFFIX = "#offer"
# While only leased blocks remain, step this often so released leases free their blocks.
LEASE_POLL_S = 0.02
# Calls aborted before they arrived that a worker remembers (``EngineHost.abort``): one that
# never arrives (Serve's cancel did land) is forgotten after this many later ones.
_ABORTED_CALLS_KEPT = 1024
T = TypeVar("T")


def worker_engine_config(spec: WorkerSpec, instance_id: str) -> EngineConfig:
    """The engine a worker runs: its spec's, named for this instance (a restarted worker is
    a new KV peer), its device resolved, and no CUDA graphs on a prefill worker (``auto``
    means decode workers and colocated engines: a prefill worker's decode steps are few)."""
    return dataclasses.replace(
        spec.engine,
        engine_id=f"{spec.engine.engine_id}-{instance_id[:8]}",
        device=resolve_device(spec.engine.device),
        cuda_graphs="off" if spec.role == "producer" else spec.engine.cuda_graphs,
    )


class HostState(enum.Enum):
    """What the engine thread's last step left, and so how the loop waits for the next:

    BUSY     requests to step          → step again at once
    HOLDING  only leased blocks remain → wake every ``LEASE_POLL_S`` (a release frees them)
    IDLE     nothing                   → sleep until an op arrives
    """

    BUSY = "busy"
    HOLDING = "holding"
    IDLE = "idle"


class EngineHost:
    """Hosts one engine and serves ``generate`` streams, ``kv_events`` and ``stats``."""

    def __init__(self, spec: WorkerSpec) -> None:
        began = time.perf_counter()
        with StartPhases.recording() as phases:  # where the start's seconds go: in stats()
            self._build(spec)
        phases.add("other", time.perf_counter() - began - sum(phases.seconds.values()))
        self.start_seconds = {"imports": began - IMPORTED_AT, **phases.seconds}
        logger.info(
            "%s started: %s",
            self.worker_id,
            ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.start_seconds.items()),
        )

    def _build(self, spec: WorkerSpec) -> None:
        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"a worker is built from a WorkerSpec, got {type(spec).__name__}")
        self.spec = spec
        if spec.cpus is not None:
            _pin_to(spec.worker_id, spec.cpus)
        self.worker_id = spec.worker_id
        self.role = spec.role
        self.instance_id = uuid.uuid4().hex
        self.node_id, self.node_ip = _node_identity()
        engine_config = worker_engine_config(spec, self.instance_id)
        with start_phase("connector"):
            connector = self.make_connector(engine_config)
        self.engine = LLMEngine(
            engine_config, connector=connector, on_rank_lost=self._exit_for_lost_rank
        )
        self.events = KVEventLog(self.worker_id, self.instance_id)
        # The adapters' latest report, replaced (never changed) on the engine thread after
        # whatever changed them: ``kv_events`` reads it on the event loop.
        self._lora_report = self.engine.lora.report(self.instance_id)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{self.worker_id}-engine"
        )
        self._ops: list[Callable[[], object]] = []
        self._ops_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stream_calls: dict[str, int] = {}  # request id → the serial of its open call
        # Calls aborted before they arrived, oldest first (``abort``).
        self._aborted_calls: collections.OrderedDict[tuple[str, int], None] = (
            collections.OrderedDict()
        )
        self._offer_serials = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        # time.monotonic() when the engine thread's current step began; None between steps.
        self._step_began: float | None = None
        # Seconds the engine thread spent in steps that had requests: a worker's load.
        self._busy_s = 0.0

    def make_connector(self, engine_config: EngineConfig) -> KVConnectorBase | None:
        """The connector the spec describes (none for a colocated worker without a tier)."""
        return worker_connector(self.spec, engine_config)

    @property
    def pd_connector(self) -> PDConnector | None:
        """The P/D part of this worker's connector (None: colocated)."""
        return pd_part(self.engine.connector)

    # ------------------------------------------------------------------ Ray methods

    def model_info(self) -> ModelInfo:
        config = self.engine.config
        return ModelInfo(
            model=config.model,
            max_model_len=self.engine.max_model_len,
            block_size=config.block_size,
            hash_algorithm=config.hash_algorithm,
            hash_seed=config.hash_seed,
            eos_token_ids=list(self.engine.tokenizer.eos_token_ids),
        )

    async def kv_events(self, since_seq: int) -> KVEventBatch:
        """The gateway's event poll (its health check): answered on the actor's event loop,
        as a sync method would not be (Serve runs those on a thread, a hop per poll). It
        carries the engine's heartbeat (``engine_step_s``)."""
        batch = self.events.since(since_seq)
        batch.engine_step_s = self.engine_step_s()
        batch.lora = self._lora_report
        return batch

    def engine_step_s(self) -> float:
        """How long the engine thread has been inside its current step (0 between steps).
        Read on the actor's event loop, never queued behind the step it measures."""
        began = self._step_began
        return 0.0 if began is None else time.monotonic() - began

    def check_health(self) -> None:
        """Serve's health check: an engine stuck in one step past ``spec.hung_step_s`` fails
        it, and Serve restarts the worker (the gateway has moved its streams meanwhile)."""
        in_step_s = self.engine_step_s()
        if in_step_s > self.spec.hung_step_s:
            raise RuntimeError(
                f"{self.worker_id}'s engine has been inside one step for {in_step_s:.0f} s "
                f"(hung_step_s {self.spec.hung_step_s:.0f})"
            )

    async def load_lora_adapter(self, name: str, path: str) -> LoRAAdapterReport:
        """Reads the PEFT adapter in ``path`` (off the engine thread: no step waits on the
        files) and registers it as ``name``. Raises ``ValueError`` naming the adapter where
        it cannot be read or does not fit the model, or the name is taken."""
        adapter = await asyncio.to_thread(self.engine.lora.read, name, path)

        def register() -> LoRAAdapterReport:
            self.engine.lora.register(adapter, path)
            return self._report_lora()

        return await self._on_engine_thread(register)

    async def unload_lora_adapter(self, name: str) -> tuple[bool, LoRAAdapterReport]:
        """Unregisters adapter ``name`` (False: this worker did not have it); requests
        running it end on its weights."""

        def unload() -> tuple[bool, LoRAAdapterReport]:
            held = self.engine.lora.unload(name)
            return held, self._report_lora()

        return await self._on_engine_thread(unload)

    async def stats(self) -> WorkerStats:
        """A consistent reading, taken on the engine thread between two steps."""
        return await self._on_engine_thread(self._read_stats)

    async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks; cancelling the stream aborts the request.

        The request counts as done only once its last chunk has been handed over: a cancel
        that lands before (while a prefill's lease is checksummed, or at the last yield)
        comes from a caller that never got the lease, and nobody else would release it."""
        entered_at = time.perf_counter()
        self._ensure_loop()
        request_id = request.request_id
        spec = request.params.structured
        if spec is not None and spec not in self.engine.grammar_compiler:
            # Compiled here, off the engine thread: add_request then finds it in the cache.
            try:
                await asyncio.to_thread(self.engine.grammar_compiler.compile, spec)
            except GrammarError as error:
                yield GenerationChunk.failed(request_id, str(error), refused=True)
                return
        if (request_id, request.call_serial) in self._aborted_calls:
            # Given up on and aborted before it got here (a hung worker resumed): nobody
            # reads this call; run, it would lease blocks no one releases.
            del self._aborted_calls[(request_id, request.call_serial)]
            yield GenerationChunk.failed(request_id, "aborted by the gateway before it arrived")
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._stream_calls[request_id] = request.call_serial
        self._submit(lambda: self._add(request))
        finished = False
        first_chunk = True
        try:
            while not finished:
                output = await queue.get()
                while not queue.empty() and not isinstance(output, GenerationChunk):
                    later = queue.get_nowait()  # outputs are deltas: join those waiting
                    output = (
                        later if isinstance(later, GenerationChunk) else output.followed_by(later)
                    )
                if isinstance(output, GenerationChunk):  # refused, or the engine step failed
                    finished = True
                    yield output
                    return
                transfer_params = output.kv_transfer_params
                checksum_s = 0.0
                if transfer_params is not None:  # a prefill's hand-off: completed off the step path
                    started = time.perf_counter()
                    transfer_params = await self._complete(transfer_params)
                    checksum_s = time.perf_counter() - started
                timing = None
                is_offer = transfer_params is not None and not transfer_params.final
                if first_chunk and not is_offer:  # where the time to the first token went
                    timing = output.stamps.timing(entered_at, time.perf_counter(), checksum_s)
                    first_chunk = False
                yield GenerationChunk(
                    request_id=request_id,
                    new_token_ids=output.output_token_ids,
                    text_delta=output.text,
                    num_output_tokens=output.num_output_tokens,
                    finished=output.finished,
                    finish_reason=output.finish_reason,
                    num_cached_tokens=output.num_cached_tokens,
                    kv_transfer_params=transfer_params,
                    error=output.error,
                    stop_reason=output.stop_reason,
                    kv_provenance=self._signed(output.kv_provenance),
                    new_logprobs=output.output_logprobs,
                    prompt_logprobs=output.prompt_logprobs,
                    timing=timing,
                )
                finished = output.finished
        finally:
            self._streams.pop(request_id, None)
            self._stream_calls.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    async def _complete(self, params: KVTransferParams) -> KVTransferParams:
        """The connector's ``complete_transfer_params``: inline when the connector says it is
        cheap (a small lease on a CPU cache: microseconds, where a thread hop costs up to
        milliseconds under load), else on a thread, so the event loop never stalls."""
        connector = self.engine.connector
        if connector is None:  # only a connector's hand-off brings params to complete
            raise RuntimeError(f"{self.worker_id} has no KV connector to complete a hand-off")
        if connector.completes_inline(params):
            return connector.complete_transfer_params(params)
        return await asyncio.to_thread(connector.complete_transfer_params, params)

    async def pull_offer(self, request: WorkerRequest) -> KVProvenance | None:
        """Pulls a chunk-wise hand-off's offer into this (decode) worker's prefix cache and
        answers when it is there (or was dropped): what it pulled, or None when it was
        refused. The request's own hand-off follows and pulls only what is still missing.

        The offer runs as a KV-only request under its own id (``…#offer<n>``), so it never
        meets the request's stream. The gateway sends one offer of a request at a time, but
        a prefill retried elsewhere and back may send another while the first still runs:
        each call's id is its own (a shared one would leave the first call unanswered)."""
        self._ensure_loop()
        offer_id = f"{request.request_id}{OFFER_SUFFIX}{next(self._offer_serials)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[offer_id] = queue
        self._submit(lambda: self._add(dataclasses.replace(request, request_id=offer_id)))
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, GenerationChunk):  # refused, or the engine step failed
                    finished = True
                    return None
                finished = output.finished
            return self._signed(output.kv_provenance)
        finally:
            self._streams.pop(offer_id, None)
            if not finished:  # the gateway went away: the pull is not wanted any more
                self._submit(lambda: self.engine.abort(offer_id))

    async def abort(self, request_id: str, call_serial: int | None = None) -> None:
        """Aborts a request, or releases the lease a finished prefill still holds for it.

        A stream still open for the request ends with an error chunk: the gateway aborts a
        call it gave up on (``RequestOrchestrator.forget_unanswered_call``), and when that
        call's cancel never lands, its stream would otherwise wait for outputs that an
        aborted request no longer gets.

        ``call_serial`` names the call given up on. A resumed hung worker may run this abort
        before the call itself (both were queued while it hung): the call is remembered, and
        refused when it arrives (``generate``). A stream of another call of the request is
        left alone: the gateway has moved on to it."""
        self._ensure_loop()
        if call_serial is not None:
            open_call = self._stream_calls.get(request_id)
            if open_call is not None and open_call != call_serial:
                return
            if open_call is None:
                self._aborted_calls[(request_id, call_serial)] = None
                while len(self._aborted_calls) > _ABORTED_CALLS_KEPT:
                    self._aborted_calls.popitem(last=False)
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(GenerationChunk.failed(request_id, "aborted by the gateway"))
        self._submit(lambda: self.engine.abort(request_id))

    async def withdraw(self, request_id: str, call_serial: int) -> bool:
        """Takes back call ``call_serial`` of a request that has not started here, so that
        the gateway runs it on an idler worker (``PrefillRebalancer``); its stream ends with
        a ``withdrawn`` chunk. False, and the call runs on here, once its first step was
        scheduled, or for a call that is not the request's open one (not arrived yet, or
        already over): nothing is ever computed twice or lost."""
        self._ensure_loop()
        if self._stream_calls.get(request_id) != call_serial:
            return False
        withdrawn = await self._on_engine_thread(lambda: self.engine.withdraw(request_id))
        queue = self._streams.get(request_id)
        if withdrawn and queue is not None:
            queue.put_nowait(GenerationChunk.withdrawn_from(request_id))
        return withdrawn

    def _signed(self, provenance: KVProvenance | None) -> KVProvenance | None:
        """The engine's account of a request's prompt KV, with who and where this worker is."""
        if provenance is not None:
            provenance.worker_id, provenance.role = self.worker_id, self.role
            provenance.node_ip = self.node_ip
        return provenance

    def __del__(self) -> None:
        """Serve calls this when it stops the replica (scale-down, ``pdserve down``, a
        redeploy): the connector's servers and threads stop, and a disk tier deletes its
        pages, so no tenant's KV outlives its worker."""
        engine = getattr(self, "engine", None)  # None: the constructor failed
        if engine is not None:
            engine.shutdown()

    # ------------------------------------------------------------------ engine thread

    def _add(self, request: WorkerRequest) -> None:
        try:
            self.engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                cache_salt=request.cache_salt,
                remote_decode=request.remote_decode,
                kv_transfer_params=request.kv_transfer_params,
                lora_name=request.lora.name if request.lora is not None else None,
                lora_path=request.lora.path if request.lora is not None else None,
            )
        except (ValueError, TypeError) as error:
            self._deliver(GenerationChunk.failed(request.request_id, str(error), refused=True))
        finally:
            if request.lora is not None:  # it may have read the adapter on demand
                self._report_lora()

    def _report_lora(self) -> LoRAAdapterReport:
        """The adapters' report, made anew where they changed since the last one (engine
        thread only)."""
        if self.engine.lora.generation != self._lora_report.generation:
            self._lora_report = self.engine.lora.report(self.instance_id)
        return self._lora_report

    def _read_stats(self) -> WorkerStats:
        engine = self.engine
        stats = engine.stats()
        values: dict[str, Any] = {}
        if stats.transfer is not None:
            transfer = dataclasses.asdict(stats.transfer)
            values = {
                f.name: transfer[f.name]
                for f in dataclasses.fields(WorkerStats)
                if f.name in transfer
            }
            values["transfer_latency"] = stats.transfer.transfer_latency
        for tier in stats.tiers:
            for name, value in dataclasses.asdict(tier).items():
                if name != "medium":
                    values.setdefault(f"kv_tier_{name}", per_tier())[tier.medium] = value
        return WorkerStats(
            worker_id=self.worker_id,
            role=self.role,
            instance_id=self.instance_id,
            node_id=self.node_id,
            node_ip=self.node_ip,
            rank_pids=[os.getpid(), *engine.rank_pids],
            num_requests_running=engine.num_running,
            num_requests_waiting=engine.num_waiting,
            num_prompt_tokens_to_compute=engine.num_prompt_tokens_to_compute,
            busy_seconds=self._busy_s,
            num_requests=stats.num_requests,
            num_requests_withdrawn=stats.num_requests_withdrawn,
            num_generation_tokens=stats.num_generation_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            kv_cache_usage=stats.kv_cache_usage,
            num_evictions=stats.num_evictions,
            num_preemptions=stats.num_preemptions,
            num_leases_held=engine.num_leases_held,
            # The scheduler's count is the authority; the connector's counts the same events.
            num_recompute_fallbacks=stats.num_recompute_fallbacks,
            num_structured_requests=stats.num_structured_requests,
            num_constrained_rows=stats.num_constrained_rows,
            num_masked_tokens=stats.num_masked_tokens,
            num_grammar_compiles=stats.grammar.num_compiled,
            num_grammar_cache_hits=stats.grammar.num_cache_hits,
            grammar_compile_seconds=stats.grammar.compile_s,
            num_spec_decode_drafts=stats.spec_decode.num_drafts,
            num_spec_decode_draft_tokens=stats.spec_decode.num_draft_tokens,
            num_spec_decode_accepted_tokens=stats.spec_decode.num_accepted_tokens,
            spec_decode_accepted_tokens_per_pos={
                str(position): count
                for position, count in enumerate(stats.spec_decode.num_accepted_tokens_per_pos)
            },
            start_seconds=self.start_seconds,
            lora_requests=dict(engine.lora.requests_by_name),
            lora_adapters_resident=dict.fromkeys(self._report_lora().resident, 1),
            **values,
        )

    async def _on_engine_thread(self, read: Callable[[], T]) -> T:
        """Runs ``read`` as an op of the engine thread and returns its result."""
        loop = self._ensure_loop()
        future: asyncio.Future = loop.create_future()

        def op() -> None:
            try:
                result = read()
            except Exception as error:  # noqa: BLE001 — handed to the awaiting caller
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._submit(op)
        return await future

    def _submit(self, op: Callable[[], object]) -> None:
        """Queues ``op`` for the engine thread; what it returns is dropped."""
        with self._ops_lock:
            self._ops.append(op)
        if self._wakeup is not None and self._loop is not None:  # both set by _ensure_loop
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the engine thread reports to, its step task (re)started if needed."""
        if self._loop_task is None or self._loop_task.done():
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._loop_task = self._loop.create_task(self._run())
        if self._loop is None:  # set above, with the task
            raise RuntimeError("the engine host's event loop was not set")
        return self._loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wakeup = self._wakeup
        if wakeup is None:  # _ensure_loop sets it before it starts this task
            raise RuntimeError("the engine host's wakeup event was not set")
        state = HostState.IDLE
        while True:
            if state is not HostState.BUSY:
                with self._ops_lock:
                    pending = bool(self._ops)
                if not pending:
                    wakeup.clear()
                    if state is HostState.IDLE:
                        await wakeup.wait()
                    else:  # blocks held under a lease: poll for the decode side's release
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(wakeup.wait(), LEASE_POLL_S)
            state = await loop.run_in_executor(self._executor, self._step)

    def _step(self) -> HostState:
        """One engine step in the engine thread, timed for the heartbeat."""
        self._step_began = time.monotonic()
        try:
            return self._step_and_deliver()
        finally:
            self._step_began = None

    def _step_and_deliver(self) -> HostState:
        """Applies the queued ops, steps the engine, delivers; the state it leaves."""
        with self._ops_lock:
            ops, self._ops = self._ops, []
        for op in ops:
            op()
        if not self.engine.has_unfinished_requests():
            holding = self.engine.num_leases_held > 0
            if holding:
                self.engine.step()  # lets the connector report released or expired leases
            self._take_events()
            return HostState.HOLDING if holding else HostState.IDLE
        began = time.monotonic()
        try:
            outputs = self.engine.step(delta=True)
        except TensorParallelGroupLost:
            self._exit_for_lost_rank()
            raise
        except Exception:  # an engine bug must not take the actor down: fail the in-flight requests
            logger.exception("engine step failed on %s", self.worker_id)
            self.engine.abort_all()  # every request, streamed or not, loading included
            for request_id in list(self._streams):
                self._deliver(GenerationChunk.failed(request_id, "internal engine error"))
            return HostState.IDLE
        self._busy_s += time.monotonic() - began
        self._take_events()
        for output in outputs:
            self._deliver(output)
        if self.engine.has_unfinished_requests():
            return HostState.BUSY
        # A request that just finished may hold its blocks under a lease: keep polling.
        return HostState.HOLDING if self.engine.num_leases_held > 0 else HostState.IDLE

    def _exit_for_lost_rank(self) -> None:
        """A tensor-parallel rank died: this worker cannot step again. It exits, as a
        single-process worker that died would: Serve restarts it with all its ranks, and
        the gateway re-runs or recomputes what was in flight (``retry_or_fail``); its peers
        exit when their pipes close."""
        logger.error("%s lost a tensor-parallel rank; exiting to be restarted", self.worker_id)
        logging.shutdown()
        os._exit(1)

    def _take_events(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self.events.extend(events)

    def _deliver(self, output: RequestOutput | GenerationChunk) -> None:
        queue = self._streams.get(output.request_id)
        if queue is not None and self._loop is not None:  # a stream exists once the loop does
            self._loop.call_soon_threadsafe(queue.put_nowait, output)


def _node_identity() -> tuple[str, str]:
    """The id and address of the Ray node this worker runs on (both "" outside Ray, e.g. in
    unit tests): ``/stats`` shows them, so a multi-node deployment says where each worker is."""
    import ray

    if not ray.is_initialized():
        return "", ""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _pin_to(worker_id: str, cpus: tuple[int, ...]) -> None:
    """Pins every thread of this process to ``cpus``; threads started later inherit it.

    ``sched_setaffinity(0, …)`` sets the *calling thread's* mask only: the thread that runs
    an actor's constructor is not the one that later starts the engine thread, so pinning
    it alone left the engine (and its torch threads) unpinned. Linux lists a process's
    threads in ``/proc/self/task``."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(
            f"{worker_id} is to run on CPUs {sorted(cpus)}, but {missing} are not "
            f"among this node's usable CPUs {sorted(allowed)}"
        )
    for thread_id in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(thread_id), cpus)
