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
"""

from __future__ import annotations

import asyncio
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

    async def generate(self, request_id: str, token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Runs one admitted request; the caller must ``release()`` after the stream ends.

        Raises ``APIError`` before the first delta if a worker refuses the request (400) or
        no worker of a needed role is available (503).
        """
        start = time.perf_counter()
        hashes = self.hasher.hash_request_blocks(token_ids, self.model_info.block_size)
        try:
            prefill_id = self.router.pick_prefill(hashes).worker_id
            decode_choice = None if params.max_tokens == 1 else self.router.pick_decode(hashes)
        except NoWorkerAvailable as error:
            raise no_worker_available(error.role) from None
        if decode_choice is None:
            prefill_request = WorkerRequest(request_id, token_ids, params)
        else:
            prefill_request = WorkerRequest(request_id, token_ids,
                                            dataclasses.replace(params, max_tokens=1),
                                            remote_decode=True)
        emitter = _Emitter(params.stop, len(token_ids), self.metrics, start)
        last: GenerationChunk | None = None
        self.router.begin(prefill_id)
        try:
            async for chunk in self._stream(prefill_id, prefill_request, first=True):
                last = chunk
                delta = emitter.update(chunk, final=decode_choice is None or chunk.finish_reason != "length")
                if delta is not None:
                    yield delta
        finally:
            self.router.end(prefill_id)
            asyncio.get_running_loop().create_task(self.refresh(prefill_id))
        if decode_choice is None or last is None or last.finish_reason != "length":
            return
        decode_id = decode_choice.worker_id
        decode_request = WorkerRequest(request_id, token_ids, params,
                                       kv_transfer_params=last.kv_transfer_params)
        emitter.restart_stream()
        self.router.begin(decode_id)
        completed = False
        try:
            async for chunk in self._stream(decode_id, decode_request, first=False):
                delta = emitter.update(chunk, final=True)
                if delta is not None:
                    yield delta
            completed = True
        finally:
            self.router.end(decode_id)
            if not completed and last.kv_transfer_params is not None:
                # The decode side may never pull: free the prefill's lease now, not at expiry.
                asyncio.get_running_loop().create_task(
                    self.workers.call(prefill_id, "abort", request_id))

    async def _stream(self, worker_id: str, request: WorkerRequest,
                      first: bool) -> AsyncIterator[GenerationChunk]:
        """One worker's chunks. A worker that fails before its first chunk (dead, unreachable)
        leaves routing and the request gets a 503 (on a stream already begun: an error event)."""
        stream = self.workers.stream(worker_id, request)
        answered = finished = False
        try:
            while not finished:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    return
                except Exception as error:
                    if answered:
                        raise
                    logger.warning("worker %s failed before answering: %r", worker_id, error)
                    self.router.set_available(worker_id, False)
                    raise no_worker_available("prefill" if first else "decode") from None
                answered = True
                if chunk.error is not None:
                    if first and chunk.num_output_tokens == 0:
                        raise APIError(400, chunk.error)
                    chunk.finish_reason = "abort"
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
        return stats_report(self.model_name, self.metrics.summary(self.in_flight), workers)


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
        self.sent_chars = 0
        self.num_cached_tokens = 0
        self.restart_stream()

    def restart_stream(self) -> None:
        self.stream_tokens: list[int] = []
        self.stream_text = ""

    def update(self, chunk: GenerationChunk, final: bool) -> StreamDelta | None:
        self.stream_tokens.extend(chunk.new_token_ids)
        self.stream_text += chunk.text_delta
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
        self.sent_chars += len(new_text)
        reason = chunk.finish_reason if finished else None
        if finished:
            self.metrics.record_finished(reason or "unknown", now - self.start)
            self.metrics.prompt_tokens.labels(self.metrics.model_name).inc(self.num_prompt_tokens)
        return StreamDelta(new_tokens, new_text, reason, self.num_prompt_tokens, self.num_cached_tokens)
