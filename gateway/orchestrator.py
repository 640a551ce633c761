"""A request's way through the service, in named phases, independent of the ingress.

    admit ─▶ route ─▶ prefill ─────────────▶ hand_off ─▶ decode stream
    (429)    (503)    PrefillWorker,           KVTransferParams   DecodeWorker, user's params:
                      max_tokens=1:            to the decode      the rest of the tokens
                      first token streamed     request
                      at once; offers of each
                      chunk's blocks relayed
                      to the decode worker
                      meanwhile (OfferRelay)

    retry policy: a worker lost before it answered is routed around; a worker lost
    mid-stream (decode, or one running the request whole) is replayed (same seed) and the
    replay's first tokens are checked, not resent.

A colocated deployment (no decode workers), or a request that ends at its first token,
runs whole on the prefill worker. ``generate`` reads top to bottom as those phases; each is
a method named after it. Worker loss (the actor's process died; Serve restarts it under a
new ``instance_id``):

    prefill lost before its first token   → nothing was sent: the request is routed again
                                            (its role's only worker: that one, restarted)
    prefill lost after it (mid-transfer)  → the decode pull fails; the decode side recomputes
    decode lost mid-generation            → run again on another (or the restarted) decode
                                            worker; a replay that differs, or a worker lost
                                            too often, ends the stream with an error event:
                                            never a silent wrong answer
    worker running it whole lost mid-stream → replayed as a decode is (colocated, or run on a
                                            decode worker: conditional disaggregation or a
                                            conversation's next turn, whose history's KV
                                            is recomputed)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ray.exceptions import RayActorError, RayTaskError

from pdserve.cache import BlockHash, BlockHasher
from pdserve.gateway.api.openai_schema import (
    APIError,
    ParsedCompletion,
    model_not_found,
    no_worker_available,
    too_many_requests,
)
from pdserve.gateway.autoscaler_view import autoscaler_report, report_json
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.kv_event_poller import KVEventPoller
from pdserve.gateway.metrics import GatewayMetrics, stats_report
from pdserve.gateway.off_loop import call_by_size
from pdserve.gateway.offer_relay import OfferRelay
from pdserve.gateway.prefill_rebalancer import CallWithdrawn, PrefillRebalancer, WaitingPrefill
from pdserve.gateway.readiness import Readiness
from pdserve.gateway.reasoning_parser import REASONING_PARSERS, ReasoningParser
from pdserve.gateway.replica_board import ReplicaShare
from pdserve.gateway.request_provenance import RecentRequests, RequestProvenance
from pdserve.gateway.request_timeline import RequestTimeline
from pdserve.gateway.router import NoWorkerAvailable, Router
from pdserve.gateway.service_admission import ServiceAdmission
from pdserve.gateway.stream_emitter import (
    ReplayDiverged,
    StreamDelta,
    StreamEmitter,
)
from pdserve.gateway.stream_watch import DeadlineExceeded, StreamAbandoned, StreamWatch
from pdserve.gateway.worker_pool import PoolChange, WorkerPool
from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.lora_adapters import LoRAAdapterRef
from pdserve.messages.sampling_params import SamplingParams
from pdserve.messages.worker_stats import WorkerStats
from pdserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 10.0
# Prompts longer than this (characters or token ids) are tokenized and hashed on a worker
# thread: up to 4 MiB of text would stall every stream the event loop serves.
_INLINE_PROMPT_SIZE = 16_384


def raised_by_worker_code(error: BaseException) -> TypeGuard[RayTaskError]:
    """True when the worker's own code raised (a bug, a request it cannot serve): the worker
    is alive and would fail the same way again, so it stays in routing and the request is
    not retried. Anything else (its actor died, is unreachable) is a lost worker."""
    return isinstance(error, RayTaskError) and not isinstance(error.cause, RayActorError)


class WorkerLost(Exception):
    """A worker's stream broke (its process died or became unreachable)."""

    def __init__(self, worker_id: str, answered: bool, cause: BaseException) -> None:
        super().__init__(
            f"worker {worker_id} was lost ({'mid-stream' if answered else 'before answering'}): "
            f"{cause!r}"
        )
        self.worker_id = worker_id
        self.answered = answered


@dataclass(slots=True)
class RequestRun:
    """One request's state as it moves through the phases."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    block_hashes: list[BlockHash]
    emitter: StreamEmitter
    timeline: RequestTimeline
    remote_decode: bool  # the prefill worker hands off to a decode worker
    lora: LoRAAdapterRef | None = None  # the adapter the request runs (None: the base model)
    # time.monotonic() past which the request ends (its timeout, the service's); None: never.
    deadline: float | None = None
    # The worker that runs the whole request (no hand-off) where its prompt's KV is: a decode
    # worker under conditional disaggregation; for a sibling choice, choice 0's worker.
    whole_on: str | None = None
    prefill_id: str = ""
    decode_id: str = ""
    last_prefill_chunk: GenerationChunk | None = None
    last_decode_chunk: GenerationChunk | None = None
    kv_transfer_params: KVTransferParams | None = field(default=None, repr=False)
    # A chunk-wise hand-off's offers, on their way to ``decode_id`` while the prompt prefills.
    offers: OfferRelay | None = field(default=None, repr=False)
    # A lease went to the decode worker (kept after a replay). Its id is a capability: it
    # stays inside the deployment, never in a reply or /v1/requests.
    handed_off: bool = False
    # Its prefill call was taken back once, unstarted, and routed again (PrefillRebalancer).
    prefill_moved: bool = False
    created: float = field(default_factory=time.time)
    # The worker whose stream ends the request (decode, or prefill when it runs whole),
    # set with ``final_stream_started`` at that stream's first delta: its cache then holds
    # every prompt block (what ``parallel_sampling`` waits for).
    serving_worker: str = ""
    final_stream_started: asyncio.Event = field(default_factory=asyncio.Event)

    def started_final_stream(self, worker_id: str) -> None:
        if not self.final_stream_started.is_set():
            self.serving_worker = worker_id
            self.final_stream_started.set()

    @property
    def needs_decode(self) -> bool:
        """True when the prefill stopped at its one token by length: decode goes on."""
        chunk = self.last_prefill_chunk
        return self.remote_decode and chunk is not None and chunk.finish_reason == "length"


class RequestOrchestrator:
    """Admission, routing, the prefill → decode hand-off and retries for one gateway."""

    def __init__(
        self,
        config: GatewayConfig,
        workers: WorkerPool,
        model_info: ModelInfo,
        tokenizer: Tokenizer,
        sampling_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """``sampling_defaults``: the model's own (``generation_defaults.py``), for the
        fields a request leaves out."""
        self.config = config
        self.sampling_defaults = dict(sampling_defaults or {})
        # The server's reasoning parser, with its tags' token ids (``_reasoning_lies_ahead``).
        self.reasoning: ReasoningParser | None = None
        self._reasoning_tags: tuple[list[int], list[int]] = ([], [])
        if config.reasoning_parser is not None:
            self.reasoning = REASONING_PARSERS[config.reasoning_parser]()
            self._reasoning_tags = (
                tokenizer.encode(self.reasoning.start, add_special_tokens=False),
                tokenizer.encode(self.reasoning.end, add_special_tokens=False),
            )
        self.workers = workers
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.model_name = config.model_name
        self.hasher = BlockHasher(model_info.hash_algorithm, model_info.hash_seed)
        self.router = Router(
            list(workers.prefill),
            list(workers.decode),
            config.max_load_imbalance,
            config.decode_load_weight,
            config.prefill_load_weight,
        )
        self.readiness = Readiness(workers, self.router, config.worker_timeout_s)
        self.poller = KVEventPoller(
            workers,
            self.router,
            config.worker_timeout_s,
            config.hung_step_s,
            after_each_round=self._after_poll_round,
            idle_max_s=config.event_poll_idle_max_s,
        )
        self.metrics = GatewayMetrics(self.model_name)
        self.rebalancer = PrefillRebalancer(self.router, self._withdraw)
        self.recent = RecentRequests(config.num_recent_requests)
        # With several gateway replicas: the board they answer the service's figures from.
        self.share = (
            ReplicaShare(config.app_name, uuid.uuid4().hex[:12], config.num_recent_requests)
            if config.num_replicas > 1
            else None
        )
        # ... and the service-wide in-flight limit they lease places of.
        self.admission = (
            ServiceAdmission(
                config.max_inflight_per_replica,
                self._lease_places,
                lambda: self.metrics.num_requests_in_flight,
            )
            if self.share is not None
            else None
        )
        self.seed_rng = random.SystemRandom()
        self._aborts: set[asyncio.Task] = set()
        self._call_serials = itertools.count(1)  # WorkerRequest.call_serial
        # (worker, request id) → the abort of a call there given up on before it answered.
        self._unanswered_aborts: dict[tuple[str, str], asyncio.Task] = {}

    def apply(self, change: PoolChange) -> None:
        """A scale step's new worker set, as ``WorkerPool.reshape`` took it: workers that
        joined enter routing once their first poll answers, retired ones leave it now (their
        requests in flight finish there). The poll runs at once for the new ones."""
        for role, added in (("prefill", change.added_prefill), ("decode", change.added_decode)):
            for worker_id in added:
                self.router.add_worker(worker_id, role)
        for worker_id in change.removed:
            self.router.remove_worker(worker_id)
        self.poller.wake()

    async def _after_poll_round(self) -> bool:
        """With the workers' loads and the router's index fresh: this round's prefill
        moves, then the readiness prewarm (whose answer paces the poll)."""
        if self.config.move_waiting_prefills:
            self.rebalancer.rebalance()
        return await self.readiness.prewarm()

    async def _withdraw(self, worker_id: str, request_id: str, call_serial: int) -> bool:
        return bool(
            await asyncio.wait_for(
                self.workers.call(worker_id, "withdraw", request_id, call_serial),
                self.config.worker_timeout_s,
            )
        )

    def start(self) -> None:
        self.poller.start()
        if self.share is not None and self.admission is not None:  # both or neither
            self.share.start(
                self.metrics.row,
                lambda: [
                    r.to_json()
                    for r in reversed(self.recent.latest(self.config.num_recent_requests))
                ],
                self.admission.declare,
            )

    # ------------------------------------------------------------------ validate, admit

    def adapter_for(self, model: str) -> LoRAAdapterRef | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 in
        OpenAI's shape for a name the service does not serve."""
        if model == self.model_name:
            return None
        adapter = self.router.lora_adapters().get(model)
        if adapter is None:
            raise model_not_found(model, self.served_models())
        return adapter

    def served_models(self) -> list[str]:
        """The names a request's ``model`` may take: the base, then its adapters."""
        return [self.model_name, *sorted(self.router.lora_adapters())]

    def prepare(self, parsed: ParsedCompletion) -> tuple[list[int], SamplingParams]:
        """Validates the model and prompt; returns token ids and params with a seed."""
        self.adapter_for(parsed.model)
        if parsed.prompt_token_ids is not None:
            token_ids = parsed.prompt_token_ids
            vocab_size = self.tokenizer.vocab_size
            bad = next((t for t in token_ids if t >= vocab_size), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                    param="prompt",
                )
        elif parsed.prompt_text is not None:
            token_ids = self.tokenizer.encode(parsed.prompt_text)
        else:  # validate_request sets one of the two
            raise ValueError("a parsed request carries neither prompt text nor token ids")
        max_len = self.model_info.max_model_len
        if len(token_ids) > max_len:
            raise APIError(
                400,
                f"the prompt has {len(token_ids)} tokens, more than this model's "
                f"max_model_len of {max_len}; shorten it",
                param="prompt",
            )
        params = parsed.params
        defaults = {k: v for k, v in self.sampling_defaults.items() if k in parsed.unset_fields}
        if defaults:
            params = dataclasses.replace(params, **defaults)
        if parsed.max_tokens_to_context:
            if len(token_ids) == max_len:
                raise APIError(
                    400,
                    f"the prompt's {len(token_ids)} tokens fill this model's max_model_len: "
                    "no room is left for an output; shorten it",
                    param="prompt",
                )
            params = dataclasses.replace(params, max_tokens=max_len - len(token_ids))
        if len(token_ids) + params.max_tokens > max_len:
            raise APIError(
                400,
                f"prompt ({len(token_ids)} tokens) plus max_tokens "
                f"({params.max_tokens}) exceeds max_model_len ({max_len})",
                param="max_tokens",
            )
        params = self._checked_logits_fields(params, parsed.bad_words)
        if params.structured is not None and self._reasoning_lies_ahead(token_ids):
            params = dataclasses.replace(params, reasoning_end_token_ids=self._reasoning_tags[1])
        if params.seed is None:  # both sides must sample with the same seed
            params = dataclasses.replace(params, seed=self.seed_rng.getrandbits(63))
        return token_ids, params

    async def prepare_off_loop(self, parsed: ParsedCompletion) -> tuple[list[int], SamplingParams]:
        """``prepare``, on a worker thread when the prompt is long."""
        size = len(parsed.prompt_text or "") + len(parsed.prompt_token_ids or ())
        return await call_by_size(size, _INLINE_PROMPT_SIZE, self.prepare, parsed)

    async def hash_blocks(
        self, token_ids: list[int], cache_salt: str | None, lora: LoRAAdapterRef | None = None
    ) -> list[BlockHash]:
        """The prompt's block hashes, salted and keyed by adapter weights like the workers'
        (a prefix never routes by another tenant's or another adapter's blocks); on a
        worker thread when the prompt is long."""
        return await call_by_size(
            len(token_ids),
            _INLINE_PROMPT_SIZE,
            self.hasher.hash_request_blocks,
            token_ids,
            self.model_info.block_size,
            lora_id=lora.digest if lora is not None else None,
            cache_salt=cache_salt,
        )

    async def admit(self) -> None:
        """Takes a place in the bounded in-flight queue, or refuses with 429. With several
        gateway replicas the bound is the service's (``service_admission.py``)."""
        limit = self.config.max_inflight_requests
        if self.admission is None:
            admitted = self.metrics.num_requests_in_flight < limit
        else:
            admitted = await self.admission.has_place()
            if not self.admission.board_answers:  # admitted on this replica's share only
                limit = self.config.max_inflight_per_replica
        if not admitted:
            raise too_many_requests(limit, self.config.max_inflight_requests)
        self.metrics.num_requests_in_flight += 1
        self.metrics.num_requests += 1

    def release(self) -> None:
        self.metrics.num_requests_in_flight -= 1
        if self.admission is not None:
            self.admission.released()

    async def _lease_places(self, held: int, wanted: int) -> int:
        assert self.share is not None  # an admission exists only beside the board
        return await self.share.lease(held, wanted, self.config.max_inflight_requests)

    # ------------------------------------------------------------------ the phases

    async def generate(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora: LoRAAdapterRef | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Runs one admitted request; the caller must ``release()`` after the stream ends.

        Raises ``APIError`` before the first delta if a worker refuses the request (400) or
        no worker of a needed role is available (503); after it, when the request cannot be
        finished correctly (the stream then ends with an error event).
        """
        run = await self.new_run(request_id, token_ids, params, cache_salt, lora=lora)
        async for delta in self.run_phases(run):
            yield delta

    def deadline_for(self, timeout_s: float | None) -> float | None:
        """The ``time.monotonic()`` deadline of a request sent now: its own ``timeout``, or
        the service's ``request_timeout_s`` when that is shorter (0: none)."""
        limits = [t for t in (timeout_s, self.config.request_timeout_s) if t]
        return time.monotonic() + min(limits) if limits else None

    async def new_run(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        deadline: float | None = None,
        lora: LoRAAdapterRef | None = None,
    ) -> RequestRun:
        """A request's state; ``deadline`` None: the service's (``deadline_for``); ``lora``:
        the adapter it runs (``adapter_for``)."""
        start = time.perf_counter()
        if lora is not None:
            self.metrics.lora_requests[lora.name] += 1
        return RequestRun(
            request_id,
            token_ids,
            params,
            cache_salt,
            block_hashes=await self.hash_blocks(token_ids, cache_salt, lora),
            emitter=StreamEmitter(params.stop, len(token_ids), self.metrics, start),
            timeline=RequestTimeline(start),
            remote_decode=params.max_tokens > 1 and self.router.has_decode_workers(),
            lora=lora,
            deadline=deadline if deadline is not None else self.deadline_for(None),
        )

    async def run_phases(self, run: RequestRun) -> AsyncGenerator[StreamDelta, None]:
        """``generate``'s body: the phases, in order, for an already built ``RequestRun``."""
        self.decide_disaggregation(run)
        completed = False
        try:  # from the first token on (a client may hang up at it), a lease may be held
            async for delta in self.prefill(run):
                yield self.account(run, delta)
            if not run.needs_decode:
                run.started_final_stream(run.prefill_id)  # it ended at its first token
                completed = True
                return
            await self.hand_off(run)
            async for delta in self.decode_stream(run):
                yield self.account(run, delta)
            completed = True
        finally:
            if not completed:
                # The decode side may never pull: free the prefill's lease now, not at expiry.
                self.release_lease(run)

    def decide_disaggregation(self, run: RequestRun) -> None:
        """Runs a request whole on a decode worker (no KV hand-off) when, per the router's
        index of that worker's cached prefix:

        - what it would compute is shorter than ``disagg_min_uncached_tokens``: the hand-off
          would cost more than it saves; or
        - it holds at least ``decode_reuse_min_tokens`` more of the prompt than any prefill
          worker: a conversation's next turn, whose history (the last answer above all)
          only that decode worker computed. The prefill worker would recompute it; here
          only the new message is computed, where the history's KV already is::

              turn 2 prompt:  | turn 1 prompt | answer 1 | new message |
              prefill holds:  |###############|
              decode holds:   |###############|##########|               → runs there

        Any prefill worker, not the one load would pick: a shared system prompt that the
        decode worker pulled is held by the busy prefill worker that computed it, and a
        cold one picked for load would make every long prompt run whole on the decode
        worker, its prompt computed between the decode steps of every row there.
        """
        threshold = self.config.disagg_min_uncached_tokens
        reuse = self.config.decode_reuse_min_tokens
        if not run.remote_decode or not (threshold or reuse):
            return
        block_size = self.model_info.block_size
        lora_name = run.lora.name if run.lora is not None else None
        try:
            choice = self.router.pick_decode_by_prefix(run.block_hashes, lora_name)
        except NoWorkerAvailable:
            return  # the prefill phase answers 503 with the usual message
        cached_tokens = choice.num_matched_blocks * block_size
        run_there = len(run.token_ids) - cached_tokens < threshold
        if not run_there and reuse:
            try:
                prefill_blocks = self.router.longest_prefill_prefix(run.block_hashes)
            except NoWorkerAvailable:
                return  # the prefill phase answers 503 with the usual message
            run_there = cached_tokens - prefill_blocks * block_size >= reuse
            self.metrics.num_turns_run_where_kv_is += run_there
        if run_there:
            run.remote_decode = False
            run.whole_on = choice.worker_id
            self.metrics.num_requests_prefilled_on_decode += 1

    async def prefill(self, run: RequestRun) -> AsyncIterator[StreamDelta]:
        """The prefill worker's stream: the first token (or, colocated or run whole on a
        decode worker, every token)."""
        params = dataclasses.replace(run.params, max_tokens=1) if run.remote_decode else run.params
        request = WorkerRequest(
            run.request_id,
            run.token_ids,
            params,
            remote_decode=run.remote_decode,
            cache_salt=run.cache_salt,
            lora=run.lora,
        )
        attempt = 0
        while True:
            # A retry follows a loss: the router has marked the lost worker down, and it may
            # have been its role's only one. It is tried again (Serve restarts it) rather
            # than failing with 503 a request no token of which was sent yet.
            lost_id = run.prefill_id if attempt else None
            if run.whole_on is None:
                run.prefill_id = self.route("prefill", run, fallback=lost_id)
            elif attempt:  # the worker chosen was lost: the one of its role holding most of it
                role = self.workers.role(run.whole_on)
                run.whole_on = self.route(role, run, fallback=lost_id, by_prefix=True)
                run.prefill_id = run.whole_on
            else:  # where the prompt's KV was found (no await since)
                run.prefill_id = run.whole_on
            if run.remote_decode:  # 503 now, before any token, when none is up
                run.decode_id = self.route("decode", run)
            run.timeline.called("prefill", run.prefill_id)
            run.emitter.restart_stream()
            try:
                async for chunk in self.worker_stream(run.prefill_id, request, run, first=True):
                    offer = chunk.kv_transfer_params
                    if offer is not None and not offer.final:  # the prompt is still prefilling
                        self.relay_offer(run, offer)
                        continue
                    run.timeline.answered("prefill", chunk)
                    run.last_prefill_chunk = chunk
                    # The lease the prefill granted: held from here, released if unused.
                    run.kv_transfer_params = chunk.kv_transfer_params
                    hands_off = run.remote_decode and chunk.finish_reason == "length"
                    delta = run.emitter.update(chunk, final=not hands_off)
                    if not run.remote_decode:
                        run.started_final_stream(run.prefill_id)
                    if delta is not None:
                        yield delta
                return
            except CallWithdrawn:  # unstarted, taken back: routed again now, not an attempt
                run.prefill_moved = True
                self.metrics.num_prefills_moved += 1
            except ReplayDiverged as error:
                raise self.replay_diverged(run, error) from None
            except WorkerLost as lost:
                # A request run whole (colocated, or on a decode worker) that had sent tokens
                # is replayed as a decode stream is: same seed, the replay's first tokens
                # checked against those sent and not sent again.
                retryable = not run.remote_decode or not run.emitter.sent_tokens
                self.retry_or_fail(lost, "prefill", run, attempt, retryable=retryable)
                attempt += 1
                await asyncio.sleep(self.config.retry_backoff_s)  # let Serve see the dead replica

    def relay_offer(self, run: RequestRun, offer: KVTransferParams) -> None:
        """Passes an offer on to the decode worker the request is routed to (a retried
        prefill may have routed it to another: its offers start a relay of their own)."""
        if run.offers is None or run.offers.decode_id != run.decode_id:
            run.offers = OfferRelay(
                self.workers, run.decode_id, run.request_id, run.token_ids, run.cache_salt, run.lora
            )
        run.offers.offer(offer)

    async def hand_off(self, run: RequestRun) -> None:
        """The prefill's ``KVTransferParams`` (None: the decode side recomputes) go to decode,
        once the offer in flight (if any) has landed there: the hand-off then finds its
        blocks cached and pulls only the rest."""
        if run.offers is not None:
            await run.offers.settle(self.config.worker_timeout_s)
        run.handed_off = run.kv_transfer_params is not None

    async def decode_stream(self, run: RequestRun) -> AsyncIterator[StreamDelta]:
        """The decode worker's stream, replayed on another worker if this one is lost."""
        for attempt in range(self.config.max_attempts):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s)  # let Serve see the dead replica
            # Once the first token is out, a decode worker that answered a moment ago (or the
            # one just lost, which Serve restarts) is tried rather than failing the stream
            # because the router's view flickered (polls slowed while workers start).
            if attempt or not self.holds_offers(run):
                run.decode_id = self.route("decode", run, fallback=run.decode_id)
            # The prompt's logprobs (if asked) came from the prefill worker.
            request = WorkerRequest(
                run.request_id,
                run.token_ids,
                dataclasses.replace(run.params, prompt_logprobs=None),
                kv_transfer_params=run.kv_transfer_params,
                cache_salt=run.cache_salt,
                lora=run.lora,
            )
            run.emitter.restart_stream()
            run.timeline.called("decode", run.decode_id)
            try:
                async for chunk in self.worker_stream(run.decode_id, request, run, first=False):
                    run.timeline.answered("decode", chunk)
                    if run.kv_transfer_params is not None:
                        # The decode worker has the hand-off's tail pages (landed or pulled
                        # before its first chunk): no copy of them (up to inline_tail_bytes)
                        # stays here for the rest of the stream. A retry recomputes anyway.
                        run.kv_transfer_params.tail_pages = b""
                    run.last_decode_chunk = chunk
                    run.started_final_stream(run.decode_id)
                    delta = run.emitter.update(chunk, final=True)
                    if delta is not None:
                        yield delta
                return
            except ReplayDiverged as error:
                raise self.replay_diverged(run, error) from None
            except WorkerLost as lost:
                self.retry_or_fail(lost, "decode", run, attempt, retryable=True)
                # The replay recomputes the prompt: the lease may be gone with the pull.
                self.release_lease(run)
                run.kv_transfer_params = None

    def holds_offers(self, run: RequestRun) -> bool:
        """Whether the decode worker the offers went to holds their blocks and is up: the
        request then stays with it rather than routing again (the router's index may not
        have seen those blocks yet)."""
        offers = run.offers
        return (
            offers is not None
            and offers.totals.num_blocks > 0
            and offers.decode_id == run.decode_id
            and self.router.is_available(run.decode_id)
        )

    def account(self, run: RequestRun, delta: StreamDelta) -> StreamDelta:
        """On the request's last delta: where its KV came from (both workers' accounts and
        the gateway's timing), kept in ``recent``, counted, and carried to the client."""
        if delta.finish_reason is None:
            return delta
        emitter = run.emitter
        decode = run.last_decode_chunk
        record = RequestProvenance(
            run.request_id,
            run.created,
            delta.finish_reason,
            len(run.token_ids),
            emitter.sent_tokens,
            self.model_info.block_size,
            prefill=run.last_prefill_chunk.kv_provenance if run.last_prefill_chunk else None,
            decode=decode.kv_provenance if decode is not None else None,
            handed_off=run.handed_off,
            offers=run.offers.totals if run.offers is not None else None,
            ttft_s=emitter.ttft_s(),
            itl_s=emitter.mean_itl_s(),
            e2e_s=time.perf_counter() - emitter.start,
            timeline=run.timeline.to_json(),
        )
        self.recent.add(record)
        if self.share is not None:
            self.share.finished(record.to_json())
        self.metrics.record_provenance(record)
        self.metrics.record_timeline(run.timeline)
        delta.kv_provenance = record
        return delta

    # ------------------------------------------------------------------ route, retry

    def route(
        self,
        role: str,
        run: RequestRun,
        fallback: str | None = None,
        by_prefix: bool = False,
    ) -> str:
        """A worker of ``role`` for ``run`` by adapter, prefix and load; 503 when none is
        available, unless a ``fallback`` is given: after a loss, the lost worker itself,
        which Serve restarts. A decode worker is picked by the blocks it holds (where a
        hand-off pulls least), or ``by_prefix``, by the longest prefix it holds (where a
        request runs whole)."""
        block_hashes = run.block_hashes
        lora_name = run.lora.name if run.lora is not None else None
        try:
            if role == "prefill":
                return self.router.pick_prefill(block_hashes, lora_name).worker_id
            if by_prefix:
                return self.router.pick_decode_by_prefix(block_hashes, lora_name).worker_id
            choice = self.router.pick_decode(block_hashes, lora_name)
            if choice is None:  # a colocated deployment has no decode worker to route to
                raise NoWorkerAvailable("decode")
            return choice.worker_id
        except NoWorkerAvailable as error:
            if fallback is not None:
                return fallback
            raise no_worker_available(error.role) from None

    def retry_or_fail(
        self, lost: WorkerLost, role: str, run: RequestRun, attempt: int, retryable: bool
    ) -> None:
        """The retry policy: returns to try again, or raises the error the client gets."""
        self.router.set_available(lost.worker_id, False)
        if retryable and attempt + 1 < self.config.max_attempts:
            logger.warning(
                "%s; running request %s again after %d sent tokens",
                lost,
                run.request_id,
                run.emitter.sent_tokens,
            )
            self.metrics.num_retries += 1
            return
        if not run.emitter.sent_tokens:
            raise no_worker_available(role)
        raise APIError(
            503,
            f"the {role} worker serving this request was lost and "
            f"{self.config.max_attempts} attempts did not finish it; the reply is "
            f"cut short after {run.emitter.sent_tokens} tokens: retry the request",
            type="server_error",
            code="worker_lost",
        )

    def deadline_exceeded(self, run: RequestRun) -> APIError:
        """The request ran past its deadline: before any token a 503 (with Retry-After:
        a worker of a needed role is hung or slow), after one an error event."""
        self.metrics.num_deadlines_exceeded += 1
        sent = run.emitter.sent_tokens
        return APIError(
            503 if not sent else 500,
            f"request {run.request_id} did not finish within its deadline (its 'timeout', "
            f"else the service's request_timeout_s of {self.config.request_timeout_s:g} s)"
            + (f"; the reply is cut short after {sent} tokens" if sent else ""),
            type="server_error",
            code="timeout",
        )

    @staticmethod
    def replay_diverged(run: RequestRun, error: ReplayDiverged) -> APIError:
        """A replay after a lost worker sampled other tokens than those already sent: the
        stream ends with an error event, never a silently different reply."""
        return APIError(
            500,
            f"request {run.request_id} was lost with its worker and its replay diverged "
            f"({error}); the reply is cut short after {run.emitter.sent_tokens} tokens",
            type="server_error",
            code="replay_diverged",
        )

    def _reasoning_lies_ahead(self, prompt: list[int]) -> bool:
        """With a reasoning parser, whether the reply opens with reasoning, which a grammar
        must not constrain: unless the prompt already closed it (thinking turned off)."""
        if self.reasoning is None:
            return False
        start, end = self._reasoning_tags
        return not self.reasoning.reasoning_ended_in(prompt, start, end)

    def _checked_logits_fields(
        self, params: SamplingParams, bad_words: list[str]
    ) -> SamplingParams:
        """The fields that name tokens, checked against the vocabulary, and ``bad_words``
        tokenized as vLLM does: each word alone and after a space (mid-text), the second
        kept where it is another token sequence of the same length."""
        if params.min_tokens > params.max_tokens:
            raise APIError(
                400,
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                f"({params.max_tokens})",
                param="min_tokens",
            )
        vocab_size = self.tokenizer.vocab_size
        for name, ids in (
            ("logit_bias", list(params.logit_bias)),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            outside = next((t for t in ids if t >= vocab_size), None)
            if outside is not None:
                raise APIError(
                    400,
                    f"{name} names token id {outside}, outside the vocabulary [0, {vocab_size})",
                    param=name,
                )
        if not bad_words:
            return params
        sequences: list[list[int]] = []
        for word in bad_words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not alone:
                raise APIError(400, f"bad word {word!r} has no tokens", param="bad_words")
            sequences.append(alone)
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return dataclasses.replace(params, bad_words_token_ids=sequences)

    def release_lease(self, run: RequestRun) -> None:
        """Tells the prefill worker to free the blocks it leased for this request."""
        if run.kv_transfer_params is not None:
            self.abort_on(run.prefill_id, run.request_id)

    def forget_unanswered_call(self, worker_id: str, request: WorkerRequest) -> None:
        """Aborts on the worker a call given up on before it answered (hung, lost, or the
        client left). Cancelling its stream is not enough: Serve's cancel is best effort,
        and a call already handed to a hung worker's process runs when the process resumes,
        where the cancel can land after the call finished: a prefill's lease, which no
        caller has, then stayed held until its TTL (issue 51: 18 blocks on the fault
        matrix's resumed prefill). A later call of the request to that worker waits for
        this abort (``worker_stream``): the abort must not end that call, nor the lease
        refuse it its request id. The abort names the call (``call_serial``): a resumed
        worker may run it before the call itself, which it then refuses."""
        key = (worker_id, request.request_id)
        abort = self.abort_on(worker_id, request.request_id, request.call_serial)
        self._unanswered_aborts[key] = abort
        abort.add_done_callback(functools.partial(self._unanswered_abort_done, key))

    def _unanswered_abort_done(self, key: tuple[str, str], abort: asyncio.Task) -> None:
        if self._unanswered_aborts.get(key) is abort:
            del self._unanswered_aborts[key]

    def abort_on(
        self, worker_id: str, request_id: str, call_serial: int | None = None
    ) -> asyncio.Task:
        """Aborts the request on the worker, or frees the lease it still holds for it.

        The call runs in a fresh context: made in the request's own, Serve would count it
        as the request's child and cancel it with the request (a client that hung up), and
        a lease would stay held until its TTL."""
        task = asyncio.get_running_loop().create_task(
            self.workers.call(worker_id, "abort", request_id, call_serial),
            context=contextvars.Context(),
        )
        self._aborts.add(task)
        task.add_done_callback(self._aborted)
        return task

    def _aborted(self, task: asyncio.Task) -> None:
        self._aborts.discard(task)
        if not task.cancelled():
            task.exception()  # a dead worker took the request and its lease with it

    async def worker_stream(
        self, worker_id: str, request: WorkerRequest, run: RequestRun, first: bool
    ) -> AsyncIterator[GenerationChunk]:
        """One worker's chunks, counted as its load. A worker whose stream breaks (dead,
        unreachable) or goes silent while it is hung (``stream_watch.py``) leaves routing
        until its event poll answers again: ``WorkerLost``."""
        # An earlier call of this request here was given up on before it answered: its
        # abort goes first (``forget_unanswered_call``). A worker that leaves it unanswered
        # for worker_timeout_s is still hung, and this call is watched as any other.
        abandoned = self._unanswered_aborts.get((worker_id, request.request_id))
        if abandoned is not None:
            await asyncio.wait((abandoned,), timeout=self.config.worker_timeout_s)
        request = dataclasses.replace(request, call_serial=next(self._call_serials))
        stream = self.workers.stream(worker_id, request)
        answered = finished = False
        # A worker already out of routing (a role's only one, tried while it restarts) is
        # waited for (up to the request's deadline); one in routing is given up on once it leaves.
        left_routing = self.router.left_routing(worker_id)
        if left_routing is not None and left_routing.is_set():
            left_routing = None
        watch = StreamWatch(left_routing, self.config.worker_timeout_s, run.deadline)
        if first and run.whole_on is None and not run.prefill_moved:
            lora_name = run.lora.name if run.lora is not None else None
            self.rebalancer.waiting(
                worker_id,
                WaitingPrefill(
                    request.request_id, request.call_serial, run.block_hashes, lora_name
                ),
            )
        self.router.begin(worker_id)
        self.poller.wake()  # traffic: the health check runs at its pace again
        try:
            while not finished:
                try:
                    chunk = await watch.next_chunk(stream)
                except StopAsyncIteration:
                    return
                except DeadlineExceeded:
                    raise self.deadline_exceeded(run) from None
                except Exception as error:  # noqa: BLE001 — sorted below: worker bug or lost
                    logger.warning(
                        "worker %s failed %s: %r",
                        worker_id,
                        "mid-stream" if answered else "before answering",
                        error,
                    )
                    if raised_by_worker_code(error):  # alive: neither retried nor unrouted
                        raise APIError(
                            500,
                            f"{worker_id} failed the request: {error.cause!r}",
                            type="server_error",
                            code="worker_error",
                        ) from None
                    if isinstance(error, StreamAbandoned):
                        self.metrics.num_stream_migrations += 1
                    raise WorkerLost(worker_id, answered, error) from None
                answered = True
                self.rebalancer.answered(worker_id, request.request_id)
                if chunk.withdrawn:
                    finished = True  # over on the worker: nothing to cancel there
                    raise CallWithdrawn()
                if chunk.finished:  # the next request routes by what this one cached
                    if chunk.kv_transfer_params is not None:  # a hand-off: the reply goes on
                        self.poller.refresh_soon(worker_id, request.request_id)
                    else:
                        await self.poller.refresh(worker_id)
                        await self.poller.settled(request.request_id)
                if chunk.error is not None:
                    if first and chunk.refused:
                        raise APIError(400, chunk.error)
                    # Never a silently short reply: the client gets an error event.
                    raise APIError(
                        500,
                        f"{worker_id} failed the request: {chunk.error}",
                        type="server_error",
                        code="worker_error",
                    )
                finished = chunk.finished
                yield chunk
        finally:
            self.rebalancer.answered(worker_id, request.request_id)
            self.router.end(worker_id)
            if not finished:
                with contextlib.suppress(Exception):
                    stream.cancel()  # the client went away: abort on the worker
                if not answered:
                    self.forget_unanswered_call(worker_id, request)

    # ------------------------------------------------------------------ stats

    async def worker_stats(self) -> list[WorkerStats]:
        results = await asyncio.gather(
            *(
                asyncio.wait_for(self.workers.call(w, "stats"), _STATS_TIMEOUT_S)
                for w in self.workers.all
            ),
            return_exceptions=True,
        )
        return [r for r in results if isinstance(r, WorkerStats)]

    async def stats(self) -> dict:
        """The ``/stats`` body; also refreshes the worker figures ``/metrics`` exposes, and the
        app's autoscaler report (``autoscaler``: absent when the app has none)."""
        workers, autoscaler = await asyncio.gather(
            self.worker_stats(), autoscaler_report(self.config.app_name)
        )
        self.metrics.latest_workers = workers
        self.metrics.autoscaler = autoscaler
        extra = {} if autoscaler is None else {"autoscaler": report_json(autoscaler)}
        if self.share is None:
            return stats_report(self.model_name, self.metrics.row(), workers) | extra
        service_row, replicas = await self.share.service_row()
        self.metrics.service_row = service_row
        return (
            stats_report(self.model_name, service_row, workers)
            | {"gateway_replicas": replicas}
            | extra
        )
