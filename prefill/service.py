"""The gateway's request flow, independent of the ingress (HTTP or gRPC).

    validate ─▶ tokenize ─▶ block hashes ─▶ Router ─▶ PrefillWorker (max_tokens=1, remote_decode)
                                                         │ first token: streamed at once
                     stop / max_tokens == 1 ◀────────────┤
                                                         ▼ KVTransferParams (or None: recompute)
                                                      DecodeWorker (user's params) ─▶ rest of the tokens

A colocated deployment (no decode workers) runs the whole request on the prefill worker.
Admission: more than ``max_inflight_requests`` at once → 429 (the client backs off); no
available worker of a needed role (dead, restarting, not answering the event poll) → 503.
The decode worker's stream repeats the first token; the gateway sends each token and each
character once, and holds back text that could still turn into a stop string, so a
streamed reply equals the non-streamed one.

Worker loss (the actor's process died; Serve restarts it under a new ``instance_id``):

    prefill lost before its first token   → nothing was sent: the request is routed again
    prefill lost after it (mid-transfer)  → the decode pull fails and the decode side recomputes
    decode lost mid-generation            → the request runs again (same seed, prompt
                                            recomputed) on another decode worker, or on the
                                            restarted one; the replay's first k tokens must
                                            equal the k already sent and are skipped, so the
                                            client sees one clean stream. A replay that
                                            differs, or a worker lost again, ends the stream
                                            with an error event: never a silent wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pdserve.cache import BlockHasher
from pdserve.engine.messages import GenerationChunk, ModelInfo, WorkerRequest, WorkerStats
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill.gateway_config import GatewayConfig
from pdserve.prefill.protocol import APIError, ParsedCompletion, no_worker_available, too_many_requests
from pdserve.prefill.router import NoWorkerAvailable, Router
from pdserve.prefill.stats import GatewayMetrics, stats_report

logger = logging.getLogger(__name__)

_EVENT_POLL_S = 0.25
_STATS_TIMEOUT_S = 10.0


class WorkerLost(Exception):
    """A worker's stream broke (its process died or became unreachable)."""

    def __init__(self, worker_id: str, answered: bool, cause: BaseException) -> None:
        super().__init__(f"worker {worker_id} was lost ({'mid-stream' if answered else 'before answering'}): "
                         f"{cause!r}")
        self.worker_id = worker_id
        self.answered = answered


class ReplayDiverged(Exception):
    """A retried request's tokens differ from those already sent to the client."""


@dataclass(slots=True)
class StreamDelta:
    """What the client gets next: new tokens and text; ``finish_reason`` on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class WorkerPool:
    """The workers by id: Serve deployment handles (one replica each) or Ray actor handles."""

    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.all = {**prefill, **decode}

    def stream(self, worker_id: str, request: WorkerRequest):
        handle = self.all[worker_id]
        if hasattr(handle, "options") and hasattr(handle, "deployment_name"):
            return handle.options(stream=True).generate.remote(request)
        return _actor_stream(handle.generate.options(num_returns="streaming").remote(request))

    async def call(self, worker_id: str, method: str, *args: Any) -> Any:
        return await getattr(self.all[worker_id], method).remote(*args)


async def _actor_stream(generator) -> AsyncIterator[Any]:
    async for ref in generator:
        yield await ref


def stop_safe_length(text: str, stops: list[str]) -> int:
    """How much of ``text`` can be sent now: all but a tail that may begin a stop string."""
    for cut in range(max((len(s) for s in stops), default=1) - 1, 0, -1):
        tail = text[-cut:] if cut <= len(text) else None
        if tail is not None and any(stop.startswith(tail) for stop in stops):
            return len(text) - cut
    return len(text)


class GenerationService:
    """Admission, routing and the prefill → decode hand-off for one gateway."""

    def __init__(self, config: GatewayConfig, workers: WorkerPool, model_info: ModelInfo,
                 tokenizer) -> None:
        self.config = config
        self.workers = workers
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.hasher = BlockHasher(model_info.hash_algorithm, model_info.hash_seed)
        self.router = Router(list(workers.prefill), list(workers.decode), config.max_load_imbalance)
        self.metrics = GatewayMetrics(self.model_name)
        self.in_flight = 0
        self._seed_rng = random.SystemRandom()
        self._poller: asyncio.Task | None = None
        self._refreshing: set[str] = set()
        self.num_retries = 0  # requests run again after their worker was lost

    # ------------------------------------------------------------------ KV events

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_events())

    async def _poll_events(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(w) for w in self.workers.all), return_exceptions=True)
            await asyncio.sleep(_EVENT_POLL_S)

    async def refresh(self, worker_id: str) -> None:
        """Pulls a worker's new KV events into the router (one refresh per worker at a time).

        The poll doubles as the health check: a worker that fails it or does not answer in
        ``worker_timeout_s`` leaves routing until it answers again.
        """
        if worker_id in self._refreshing:
            return
        self._refreshing.add(worker_id)
        try:
            batch = await asyncio.wait_for(
                self.workers.call(worker_id, "kv_events", self.router.next_seq(worker_id)),
                self.config.worker_timeout_s)
            self.router.apply(batch)
            if not self.router.is_available(worker_id):
                logger.info("worker %s answers again", worker_id)
            self.router.set_available(worker_id, True)
        except Exception as error:  # a dead worker: Serve restarts it, its new instance resets the index
            if self.router.is_available(worker_id):
                logger.warning("worker %s is unavailable: %r", worker_id, error)
            self.router.set_available(worker_id, False)
        finally:
            self._refreshing.discard(worker_id)

    # ------------------------------------------------------------------ requests

    def prepare(self, parsed: ParsedCompletion) -> tuple[list[int], SamplingParams]:
        """Validates the model and prompt; returns token ids and params with a seed."""
        if parsed.model != self.model_name:
            raise APIError(404, f"model {parsed.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        if parsed.prompt_token_ids is not None:
            token_ids = parsed.prompt_token_ids
            vocab_size = self.tokenizer.vocab_size
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                               param="prompt")
        else:
            token_ids = self.tokenizer.encode(parsed.prompt_text)
        max_len = self.model_info.max_model_len
        if len(token_ids) > max_len:
            raise APIError(400, f"the prompt has {len(token_ids)} tokens, more than this model's "
                                f"max_model_len of {max_len}; shorten it", param="prompt")
        if len(token_ids) + parsed.params.max_tokens > max_len:
            raise APIError(400, f"prompt ({len(token_ids)} tokens) plus max_tokens "
                                f"({parsed.params.max_tokens}) exceeds max_model_len ({max_len})",
                           param="max_tokens")
        params = parsed.params
        if params.seed is None:  # both sides must sample with the same seed
            params = dataclasses.replace(params, seed=self._seed_rng.getrandbits(63))
        return token_ids, params

    def admit(self) -> None:
        """Takes a place in the bounded in-flight queue, or refuses with 429."""
        if self.in_flight >= self.config.max_inflight_requests:
            raise too_many_requests(self.config.max_inflight_requests)
        self.in_flight += 1
        self.metrics.num_requests += 1
        self.metrics.in_flight.labels(self.model_name).set(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.labels(self.model_name).set(self.in_flight)

    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[StreamDelta]:
        """Runs one admitted request; the caller must ``release()`` after the stream ends.

        Raises ``APIError`` before the first delta if a worker refuses the request (400) or
        no worker of a needed role is available (503); after it, when the request cannot be
        finished correctly (the stream then ends with an error event).
        """
        start = time.perf_counter()
        # Salted like the workers' hashes: a tenant's prefix never routes by another's blocks.
        hashes = self.hasher.hash_request_blocks(token_ids, self.model_info.block_size,
                                                 cache_salt=cache_salt)
        emitter = _Emitter(params.stop, len(token_ids), self.metrics, start)
        remote_decode = params.max_tokens > 1 and self.router.has_decode_workers()
        if remote_decode:
            prefill_request = WorkerRequest(request_id, token_ids,
                                            dataclasses.replace(params, max_tokens=1),
                                            remote_decode=True, cache_salt=cache_salt)
        else:
            prefill_request = WorkerRequest(request_id, token_ids, params, cache_salt=cache_salt)
        last: GenerationChunk | None = None
        prefill_id = ""
        for attempt in range(self.config.max_attempts):
            prefill_id = self._pick("prefill", hashes)
            if remote_decode:
                self._pick("decode", hashes)  # 503 now, before any token, when none is up
            self.router.begin(prefill_id)
            try:
                async with contextlib.aclosing(self._stream(prefill_id, prefill_request, True)) as chunks:
                    async for chunk in chunks:
                        last = chunk
                        delta = emitter.update(chunk, final=not remote_decode or chunk.finish_reason != "length")
                        if delta is not None:
                            yield delta
                break
            except WorkerLost as lost:
                if emitter.sent_tokens or attempt + 1 == self.config.max_attempts:
                    raise self._lost_error(lost, "prefill", emitter) from None
                logger.warning("%s; routing request %s again", lost, request_id)
                self.num_retries += 1
            finally:
                self.router.end(prefill_id)
                asyncio.get_running_loop().create_task(self.refresh(prefill_id))
        if not remote_decode or last is None or last.finish_reason != "length":
            return
        kv_transfer_params = last.kv_transfer_params
        decode_id = ""
        completed = False
        try:
            for attempt in range(self.config.max_attempts):
                if attempt:
                    await asyncio.sleep(self.config.retry_backoff_s)  # let Serve see the dead replica
                decode_id = self._pick("decode", hashes, fallback=decode_id if attempt else None)
                decode_request = WorkerRequest(request_id, token_ids, params,
                                               kv_transfer_params=kv_transfer_params,
                                               cache_salt=cache_salt)
                emitter.restart_stream()
                self.router.begin(decode_id)
                try:
                    async with contextlib.aclosing(self._stream(decode_id, decode_request, False)) as chunks:
                        async for chunk in chunks:
                            delta = emitter.update(chunk, final=True)
                            if delta is not None:
                                yield delta
                    completed = True
                    return
                except ReplayDiverged as error:
                    raise APIError(500, f"request {request_id} was lost with its decode worker and "
                                        f"its replay diverged ({error}); the reply is cut short "
                                        f"after {emitter.sent_tokens} tokens", type="server_error",
                                   code="replay_diverged") from None
                except WorkerLost as lost:
                    if attempt + 1 == self.config.max_attempts:
                        raise self._lost_error(lost, "decode", emitter) from None
                    logger.warning("%s; replaying request %s after %d sent tokens", lost,
                                   request_id, emitter.sent_tokens)
                    self.num_retries += 1
                    # The replay recomputes the prompt: the lease may be gone with the pull.
                    self._abort_lease(prefill_id, request_id, kv_transfer_params)
                    kv_transfer_params = None
                finally:
                    self.router.end(decode_id)
        finally:
            if not completed:
                # The decode side may never pull: free the prefill's lease now, not at expiry.
                self._abort_lease(prefill_id, request_id, kv_transfer_params)

    def _pick(self, role: str, hashes: list, fallback: str | None = None) -> str:
        """A worker of ``role``; 503 when none is available, unless a ``fallback`` is given:
        after a loss, the lost worker itself, which Serve restarts (its handle queues calls)."""
        try:
            if role == "prefill":
                return self.router.pick_prefill(hashes).worker_id
            return self.router.pick_decode(hashes).worker_id
        except NoWorkerAvailable as error:
            if fallback is not None:
                return fallback
            raise no_worker_available(error.role) from None

    def _abort_lease(self, prefill_id: str, request_id: str, kv_transfer_params) -> None:
        if kv_transfer_params is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.workers.call(prefill_id, "abort", request_id))
        task.add_done_callback(_ignore_result)  # a dead prefill worker took the lease with it

    def _lost_error(self, lost: WorkerLost, role: str, emitter: _Emitter) -> APIError:
        self.router.set_available(lost.worker_id, False)
        if not emitter.sent_tokens:
            return no_worker_available(role)
        return APIError(503, f"the {role} worker serving this request was lost and "
                             f"{self.config.max_attempts} attempts did not finish it; the reply is cut short "
                             f"after {emitter.sent_tokens} tokens: retry the request",
                        type="server_error", code="worker_lost")

    async def _stream(self, worker_id: str, request: WorkerRequest,
                      first: bool) -> AsyncIterator[GenerationChunk]:
        """One worker's chunks. A worker whose stream breaks (dead, unreachable) leaves
        routing until its event poll answers again, and ``WorkerLost`` says so."""
        stream = self.workers.stream(worker_id, request)
        answered = finished = False
        try:
            while not finished:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    return
                except Exception as error:
                    logger.warning("worker %s failed %s: %r", worker_id,
                                   "mid-stream" if answered else "before answering", error)
                    self.router.set_available(worker_id, False)
                    raise WorkerLost(worker_id, answered, error) from None
                answered = True
                if chunk.error is not None:
                    if first and chunk.refused:
                        raise APIError(400, chunk.error)
                    # Never a silently short reply: the client gets an error event.
                    raise APIError(500, f"{worker_id} failed the request: {chunk.error}",
                                   type="server_error", code="worker_error")
                finished = chunk.finished
                yield chunk
        finally:
            if not finished and hasattr(stream, "cancel"):
                stream.cancel()  # the client went away: abort on the worker

    # ------------------------------------------------------------------ stats

    async def worker_stats(self) -> list[WorkerStats]:
        results = await asyncio.gather(
            *(asyncio.wait_for(self.workers.call(w, "stats"), _STATS_TIMEOUT_S) for w in self.workers.all),
            return_exceptions=True)
        return [r for r in results if isinstance(r, WorkerStats)]

    async def stats(self) -> dict:
        workers = await self.worker_stats()
        self.metrics.worker_collector.latest = workers
        gateway = self.metrics.summary(self.in_flight)
        gateway["retries"] = self.num_retries
        return stats_report(self.model_name, gateway, workers)


def _ignore_result(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


class _Emitter:
    """Turns workers' chunks into client deltas: each token and character sent once.

    The decode stream restarts the output from its first token (which the prefill already
    sent): ``restart_stream`` resets what the current stream has shown, not what was sent.
    """

    def __init__(self, stops: list[str], num_prompt_tokens: int, metrics: GatewayMetrics,
                 start: float) -> None:
        self.stops = stops
        self.num_prompt_tokens = num_prompt_tokens
        self.metrics = metrics
        self.start = start
        self.last_token_time = start
        self.sent_tokens = 0
        self.sent_token_ids: list[int] = []
        self.sent_chars = 0
        self.num_cached_tokens = 0
        self.restart_stream()

    def restart_stream(self) -> None:
        self.stream_tokens: list[int] = []
        self.stream_text = ""

    def update(self, chunk: GenerationChunk, final: bool) -> StreamDelta | None:
        overlap = min(len(self.stream_tokens) + len(chunk.new_token_ids), self.sent_tokens)
        self.stream_tokens.extend(chunk.new_token_ids)
        self.stream_text += chunk.text_delta
        if self.stream_tokens[:overlap] != self.sent_token_ids[:overlap]:
            raise ReplayDiverged(f"tokens {self.stream_tokens[:overlap]} where "
                                 f"{self.sent_token_ids[:overlap]} were sent")
        if chunk.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        finished = chunk.finished and final
        new_tokens = self.stream_tokens[self.sent_tokens:]
        end = len(self.stream_text) if finished else stop_safe_length(self.stream_text, self.stops)
        new_text = self.stream_text[self.sent_chars:end] if end > self.sent_chars else ""
        if not new_tokens and not new_text and not finished:
            return None
        now = time.perf_counter()
        if new_tokens:
            if self.sent_tokens == 0:
                self.metrics.record_first_token(now - self.start)
                if len(new_tokens) > 1:
                    self.metrics.record_tokens(len(new_tokens) - 1, now - self.last_token_time)
            else:
                self.metrics.record_tokens(len(new_tokens), now - self.last_token_time)
            self.last_token_time = now
        self.sent_tokens += len(new_tokens)
        self.sent_token_ids.extend(new_tokens)
        self.sent_chars += len(new_text)
        reason = chunk.finish_reason if finished else None
        if finished:
            self.metrics.record_finished(reason or "unknown", now - self.start)
            self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(self.num_prompt_tokens)
        return StreamDelta(new_tokens, new_text, reason, self.num_prompt_tokens, self.num_cached_tokens)
