"""One ``LLMEngine`` inside a Ray actor: the step loop, streams, KV events and stats.

Both worker kinds (``PrefillWorker``, ``DecodeWorker``) are this host with a role; they
differ only in which connector side they run and which requests the gateway sends them.
It lives in ``engine`` because both sides run it: it knows a ``WorkerSpec``, never the
deployment's config, so ``prefill``/``decode`` import it and ``deploy`` builds the specs.

The engine is not thread-safe, so exactly one thread ever touches it: the host's *engine
thread*. Calls from the actor's event loop (add, abort) are queued and applied by that
thread before its next step; outputs travel back to each request's asyncio queue.

    event loop (Ray calls)                 engine thread
    generate(req) ─▶ ops.append(add) ──┐
    (cancelled) ───▶ ops.append(abort) ┼─▶ apply ops; engine.step(); take KV events
    queue.get() ◀── call_soon_threadsafe ◀─ RequestOutput (cumulative) per changed request
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pdserve.cache import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.messages import (
    GenerationChunk,
    KVEventBatch,
    ModelInfo,
    WorkerRequest,
    WorkerSpec,
    WorkerStats,
)
from pdserve.engine.request_output import RequestOutput

if TYPE_CHECKING:
    from pdserve.kvconnector.base import KVConnectorBase

logger = logging.getLogger(__name__)

_MAX_LOGGED_EVENTS = 65536
# While only leased blocks remain, step this often so released leases free their blocks.
_LEASE_POLL_S = 0.02
_BUSY, _HOLDING, _IDLE = "busy", "holding", "idle"


class KVEventLog:
    """A bounded, sequence-numbered log of one worker's KV events, read by cursor.

    Readers (gateways) keep their own cursor; when the log has dropped events a reader has
    not seen, it gets a snapshot of every held hash instead, so no reader can drift.
    """

    def __init__(self, worker_id: str, instance_id: str, max_events: int = _MAX_LOGGED_EVENTS) -> None:
        self.worker_id = worker_id
        self.instance_id = instance_id
        self._events: deque = deque(maxlen=max_events)
        self._first_seq = 0
        self._held: set[bytes] = set()
        self._lock = threading.Lock()

    def extend(self, events: list) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._held.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._held.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self._held.clear()
                if len(self._events) == self._events.maxlen:
                    self._first_seq += 1
                self._events.append(event)

    def since(self, seq: int) -> KVEventBatch:
        with self._lock:
            next_seq = self._first_seq + len(self._events)
            if seq < self._first_seq or seq > next_seq:
                return KVEventBatch(self.worker_id, self.instance_id, next_seq, next_seq,
                                    [], snapshot=list(self._held))
            events = list(self._events)[seq - self._first_seq:] if seq < next_seq else []
            return KVEventBatch(self.worker_id, self.instance_id, seq, next_seq, events)


class EngineHost:
    """Hosts one engine and serves ``generate`` streams, ``kv_events`` and ``stats``."""

    def __init__(self, spec: WorkerSpec) -> None:
        from pdserve.engine.llm_engine import LLMEngine

        if not isinstance(spec, WorkerSpec):
            raise TypeError(f"a worker is built from a WorkerSpec, got {type(spec).__name__}")
        self.spec = spec
        self.worker_id = spec.worker_id
        self.role = spec.role
        self.instance_id = uuid.uuid4().hex
        engine_config = dataclasses.replace(
            spec.engine, engine_id=f"{spec.engine.engine_id}-{self.instance_id[:8]}",
            device=_pick_device(spec.engine.device))
        self.engine = LLMEngine(engine_config, connector=_make_connector(spec, engine_config))
        self.events = KVEventLog(self.worker_id, self.instance_id)
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=f"{self.worker_id}-engine")
        self._ops: list[Callable[[], None]] = []
        self._ops_lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ Ray methods

    def model_info(self) -> ModelInfo:
        tokenizer = self.engine.tokenizer
        config = self.engine.config
        return ModelInfo(model=config.model, max_model_len=self.engine.max_model_len,
                         block_size=config.block_size, hash_algorithm=config.hash_algorithm,
                         hash_seed=config.hash_seed,
                         eos_token_id=getattr(tokenizer, "eos_token_id", None))

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def kv_events(self, since_seq: int) -> KVEventBatch:
        return self.events.since(since_seq)

    def stats(self) -> WorkerStats:
        return _worker_stats(self)

    async def generate(self, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks; cancelling the stream aborts the request."""
        self._ensure_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request.request_id
        self._streams[request_id] = queue
        self._submit(lambda: self._add(request))
        finished = False
        sent_tokens = sent_chars = 0
        try:
            while not finished:
                output = await queue.get()
                while not queue.empty() and not isinstance(output, GenerationChunk):
                    output = queue.get_nowait()  # outputs are cumulative: keep the newest
                if isinstance(output, GenerationChunk):  # add_request refused it
                    finished = True
                    yield output
                    return
                finished = output.finished
                yield GenerationChunk(
                    request_id=request_id,
                    new_token_ids=output.output_token_ids[sent_tokens:],
                    text_delta=output.text[sent_chars:],
                    num_output_tokens=len(output.output_token_ids),
                    finished=output.finished,
                    finish_reason=output.finish_reason,
                    num_cached_tokens=output.num_cached_tokens,
                    kv_transfer_params=output.kv_transfer_params,
                    error=output.error,
                )
                sent_tokens, sent_chars = len(output.output_token_ids), len(output.text)
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        """Aborts a request, or releases the lease a finished prefill still holds for it."""
        self._submit(lambda: self.engine.abort(request_id))
        self._ensure_loop()

    def num_unfinished(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ engine thread

    def _add(self, request: WorkerRequest) -> None:
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                    cache_salt=request.cache_salt,
                                    remote_decode=request.remote_decode,
                                    kv_transfer_params=request.kv_transfer_params)
        except (ValueError, TypeError) as error:
            self._deliver(GenerationChunk(request.request_id, [], "", 0, True, "error",
                                          error=str(error), refused=True))

    def _submit(self, op: Callable[[], None]) -> None:
        with self._ops_lock:
            self._ops.append(op)
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._loop_task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        state = _IDLE
        while True:
            if state != _BUSY:
                with self._ops_lock:
                    pending = bool(self._ops)
                if not pending:
                    self._wakeup.clear()
                    if state == _IDLE:
                        await self._wakeup.wait()
                    else:  # blocks held under a lease: poll for the decode side's release
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._wakeup.wait(), _LEASE_POLL_S)
            state = await loop.run_in_executor(self._executor, self._step)

    def _step(self) -> str:
        """One engine step in the engine thread: busy, holding (leases only) or idle."""
        with self._ops_lock:
            ops, self._ops = self._ops, []
        for op in ops:
            op()
        if not self.engine.has_unfinished_requests():
            holding = self.engine.num_leases_held > 0
            if holding:
                self.engine.step()  # lets the connector report released or expired leases
            self._take_events()
            return _HOLDING if holding else _IDLE
        try:
            outputs = self.engine.step()
        except Exception:  # an engine bug must not take the actor down: fail the in-flight requests
            logger.exception("engine step failed on %s", self.worker_id)
            for request_id in list(self._streams):
                self.engine.abort(request_id)
                self._deliver(GenerationChunk(request_id, [], "", 0, True, "error",
                                              error="internal engine error"))
            return _IDLE
        self._take_events()
        for output in outputs:
            self._deliver(output)
        if self.engine.has_unfinished_requests():
            return _BUSY
        # A request that just finished may hold its blocks under a lease: keep polling.
        return _HOLDING if self.engine.num_leases_held > 0 else _IDLE

    def _take_events(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self.events.extend(events)

    def _deliver(self, output: RequestOutput | GenerationChunk) -> None:
        queue = self._streams.get(output.request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, output)


def _make_connector(spec: WorkerSpec, engine_config: EngineConfig) -> KVConnectorBase | None:
    """The P/D connector of the spec's side; None for a colocated worker.

    Imported here, not at module level: the engine package must not load a connector
    implementation (and its transports) unless a worker asks for one.
    """
    if spec.connector is None:
        return None
    from pdserve.kvconnector.pd_connector import PDConnector

    connector_config = spec.connector
    if spec.advertise_node_address:
        import ray

        connector_config = dataclasses.replace(connector_config,
                                               host=ray.util.get_node_ip_address())
    return PDConnector(connector_config, engine_config.engine_id,
                       engine_config.hash_algorithm, engine_config.hash_seed)


def _pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _worker_stats(host: EngineHost) -> WorkerStats:
    """Maps the engine's counters onto the worker's stats message."""
    engine = host.engine
    stats = engine.stats()
    result = WorkerStats(
        worker_id=host.worker_id, role=host.role, instance_id=host.instance_id,
        num_running=engine.num_running,
        num_waiting=engine.num_waiting,
        num_requests=stats.num_requests,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_blocks=stats.num_blocks,
        # Read from the ledger, not the step's record, so an idle worker reports its pool.
        num_free_blocks=engine.kv_cache_manager.get_num_free_blocks(),
        kv_cache_usage=engine.kv_cache_manager.usage,
        num_evictions=stats.num_evictions,
        num_preemptions=stats.num_preemptions,
        num_leases_held=engine.num_leases_held,
        # The scheduler's count is the authority; the connector's counts the same events.
        recompute_fallbacks=stats.num_recompute_fallbacks,
    )
    transfer = stats.transfer
    if transfer is not None:
        result.blocks_sent = transfer.num_blocks_sent
        result.blocks_received = transfer.num_blocks_received
        result.bytes_sent = transfer.num_bytes_sent
        result.bytes_received = transfer.num_bytes_received
        result.dedup_skipped_blocks = transfer.num_dedup_skipped_blocks
        result.transfer_latency_p50_s = transfer.transfer_duration_p50_s
        result.transfer_latency_p99_s = transfer.transfer_duration_p99_s
        result.transfer_failures = transfer.num_failed_transfers
        result.lease_expiries = transfer.num_lease_expiries
    return result
