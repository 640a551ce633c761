"""Continuous batching over the KV ledger: which tokens of which requests run this step.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). Running requests go first (a decode needs one token, a long prompt is
cut into chunks that fit the budget, and into chunks of at most
``long_prefill_token_threshold`` tokens when that is set, vLLM's knob: one long prompt, such
as a recompute fallback on a decode worker, then takes several short steps instead of one
long one that stalls every running decode; a prompt handed off chunk-wise ends with a
chunk of at most the connector's ``final_chunk_tokens``, so the pull after it is short);
then waiting requests are admitted in arrival order, each starting from its longest
prefix-cache hit. When the pool runs out, the most recently
admitted running request is preempted (its blocks freed, recomputed later mostly from the
prefix cache), so a full pool slows requests down but never deadlocks.

A request carrying ``KVTransferParams`` (a decode worker's request) is admitted with its
prompt's blocks allocated as *external*: it waits in ``WAITING_FOR_REMOTE_KVS`` while the
connector pulls them, then joins the batch as if its prompt had been computed here. A
*KV-only* request (``Request.kv_only``: a chunk-wise hand-off's offer) takes the same way
but ends where the others join the batch: its loaded blocks stay in the prefix cache for
the hand-off that follows. It never waits for room, nor takes the free blocks the running
requests' next tokens need (either way it is dropped: the hand-off then pulls those blocks
itself), and never fails a request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.cache import KVCacheBlocks, KVCacheManager
from pdserve.engine.kv_connector_base import (
    FinishedTransfers,
    KVConnectorBase,
    KVConnectorMetadata,
)
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.spec_decode import Proposer
from pdserve.messages.kv_transfer_params import KVTransferParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: ``chunks[i]`` belongs to ``requests[i]``."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    connector_metadata: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters the engine reports in its stats."""

    num_preemptions: int = 0
    num_recompute_fallbacks: int = 0
    num_load_failures: int = 0


class Scheduler:
    """Decides each step's chunks, and applies each step's sampled tokens."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: frozenset[int],
        connector: KVConnectorBase | None = None,
        failure_policy: str = "recompute",
        long_prefill_token_threshold: int = 0,
        proposer: Proposer[Any] | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no cap
        self.eos_token_ids = eos_token_ids
        self.connector = connector
        self.failure_policy = failure_policy
        self.proposer = proposer  # speculative decoding's drafts (None: off)
        self.counters = SchedulerCounters()

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode side: blocks allocated, bytes arriving from a prefill worker.
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self.ended_at_admission: list[Request] = []
        # Prefill side: finished, blocks held under a lease until the decode side is done.
        self.held_for_transfer: dict[str, Request] = {}

    @property
    def num_held_for_leases(self) -> int:
        """Finished requests whose blocks a lease still pins: a hand-off's
        (``held_for_transfer``), and a request whose lease ended without one while an
        offer's read may still serve its pinned blocks (see ``_release``)."""
        requests = self.requests
        ended = sum(owner not in requests for owner in self.kv_cache_manager.pinned_owners)
        return len(self.held_for_transfer) + ended

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` still has blocks here: a request in flight or held under
        its lease, or one whose ended lease's offered blocks are still pinned."""
        return request_id in self.requests or request_id in self.kv_cache_manager.pinned_owners

    # ---- requests in and out --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def is_unstarted(self, request_id: str) -> bool:
        """Whether ``request_id`` waits for its first step: queued, nothing allocated or
        computed, never preempted, no output. Only such a request can run elsewhere losing
        nothing (``LLMEngine.withdraw``)."""
        request = self.requests.get(request_id)
        return (
            request is not None
            and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
            and request.num_preemptions == 0
            and not request.output_token_ids
            and request in self.waiting
        )

    def abort_request(self, request_id: str) -> Request | None:
        """Finishes a request at once and frees its blocks, except blocks a transfer is
        still touching: those are freed when the connector reports the transfer over."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished and request_id not in self.held_for_transfer:
            return None
        if self.connector is not None:
            self.connector.request_aborted(request)
        if request.is_finished:  # held under a lease: the lease is released, freed later
            return request
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = RequestStatus.FINISHED_ABORTED
        if was_loading:
            return request  # freed when its pull reports done
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._release(request)
        return request

    def free_aborted_loads(self) -> None:
        """Frees aborted requests whose pull is over but whose "loaded" notice never reached
        ``update_from_kv_xfer_finished``: a step that failed after ``get_finished`` took the
        notice would otherwise leave their blocks allocated for good."""
        for request in list(self.requests.values()):
            request_id = request.request_id
            if (
                request.status == RequestStatus.FINISHED_ABORTED
                and request_id not in self.held_for_transfer
                and not (self.connector and self.connector.is_loading(request_id))
            ):
                self.waiting_for_remote_kvs.pop(request_id, None)
                self.kv_cache_manager.free(request)
                self._release_drafts(request)
                self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs)

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False

        # The running decodes' drafts, proposed together; each is cut below to the room the
        # step has left for it when its turn comes.
        planned = self._propose(
            [
                (
                    request,
                    self._draft_room(
                        request, request.num_tokens - request.num_computed_tokens, budget
                    ),
                )
                for request in self.running
            ]
        )
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = self._leave_final_chunk(
                request,
                self._chunk_size(request.num_tokens - request.num_computed_tokens, budget),
            )
            room = self._draft_room(request, num_new_tokens, budget)
            drafts = planned.get(request.request_id, [])[:room]
            while (
                self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=len(drafts)
                )
                is None
            ):
                if drafts:  # room for the step without speculation, before preempting anyone
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._schedule_chunk(output, request, num_new_tokens, drafts)
                budget -= num_new_tokens + len(drafts)
                index += 1

        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            num_scheduled = self._admit(output, self.waiting[0], budget)
            if num_scheduled is None:
                break
            self.waiting.popleft()
            budget -= num_scheduled

        if self.connector is not None:
            output.connector_metadata = self.connector.build_connector_meta()
        return output

    def _admit(self, output: SchedulerOutput, request: Request, budget: int) -> int | None:
        """Allocates a waiting request's blocks and schedules its first chunk.

        Returns the tokens it scheduled (0 while its KV loads from a peer), or None when
        the pool cannot hold it now."""
        manager = self.kv_cache_manager
        # Every prompt position of a prompt-logprobs request needs its logits: no cached KV
        # from any source serves it, neither a pool hit (as vLLM does) nor a tier or a peer.
        may_reuse_kv = (
            request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None
        )
        if may_reuse_kv:
            computed_blocks, num_local = manager.get_computed_blocks(request)
        else:  # its KV arrived from a prefill worker while it waited, or prompt logprobs
            computed_blocks, num_local = None, 0

        if self.connector is not None and may_reuse_kv:
            # Past the pool's hit: what a KV tier or a prefill worker holds (ext_comp).
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if request.kv_only and not load_async:  # every offered block is here already
                request.record_first_admission(num_local)
                self._end_kv_only(request)
                self.ended_at_admission.append(request)
                return 0
            if load_async:
                blocks = manager.allocate_slots(
                    request,
                    # The rest of the prompt's room too (an offer has no rest: it ends at its
                    # load). Why: a load that landed waits again holding its blocks; two that
                    # each then lacked room for their rest, with nothing running to preempt,
                    # stalled the engine for good.
                    0 if request.kv_only else request.num_tokens - num_local - num_external,
                    num_new_computed_tokens=num_local,
                    new_computed_blocks=computed_blocks,
                    num_external_computed_tokens=num_external,
                    delay_cache_blocks=True,
                    # An offer takes no room a running request's next block needs: it is
                    # worth no preemption (without it the hand-off pulls those blocks).
                    num_blocks_kept_free=len(self.running) if request.kv_only else 0,
                )
                if blocks is None and request.kv_only:  # no room: the hand-off pulls it
                    self.connector.request_aborted(request)
                    request.record_first_admission(num_local)
                    self._end_kv_only(request)
                    self.ended_at_admission.append(request)
                    return 0
                if blocks is None:
                    return None
                # A sliding window reads none of the blocks it will have left once the load
                # lands: they become the null block now, neither loaded nor cached.
                manager.remove_skipped_blocks(request, num_local + num_external)
                num_early = self._count_prefix_hit(request, computed_blocks, num_local)
                request.num_computed_tokens = num_local
                request.num_tokens_after_load = num_local + num_external
                # Pulled tokens are not cache hits, nor those its offers pulled early.
                request.num_cached_tokens = num_local - num_early
                request.record_first_admission(num_local - num_early, num_early)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.waiting_for_remote_kvs[request.request_id] = request
                self.connector.update_state_after_alloc(
                    request, manager.get_block_ids(request), num_external
                )
                return 0
            request.kv_transfer_params = None  # nothing to pull; the connector released it

        num_new_tokens = self._chunk_size(
            request.num_tokens - request.num_computed_tokens - num_local, budget
        )
        room = self._draft_room(request, num_new_tokens, budget, num_local)
        drafts = self._propose([(request, room)]).get(request.request_id, [])
        blocks = manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=num_local,
            new_computed_blocks=computed_blocks,
            num_lookahead_tokens=len(drafts),
        )
        if blocks is None and drafts:  # room without speculation, perhaps
            drafts = []
            blocks = manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_local,
                new_computed_blocks=computed_blocks,
            )
        if blocks is None:
            return None
        num_early = self._count_prefix_hit(request, computed_blocks, num_local)
        request.num_computed_tokens += num_local
        request.num_cached_tokens = max(request.num_cached_tokens, num_local - num_early)
        request.record_first_admission(num_local - num_early, num_early)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._schedule_chunk(output, request, num_new_tokens, drafts)
        return num_new_tokens + len(drafts)

    def _count_prefix_hit(
        self, request: Request, computed_blocks: KVCacheBlocks | None, num_local: int
    ) -> int:
        """Counts an admitted request's prefix lookup, once (a KV-only request's is no
        client's lookup), and returns how much of its hit its own offers had pulled into
        the pool before it came: a transfer made early, not a reuse of the cache."""
        if computed_blocks is None or request.kv_only:
            return 0
        num_early = self.kv_cache_manager.take_pulled_early(
            computed_blocks, request.handoff_lease_id
        )
        self.kv_cache_manager.record_prefix_cache_stats(request, num_local - num_early)
        return num_early

    def _end_kv_only(self, request: Request) -> None:
        """Ends a KV-only request: what it loaded stays cached, free for the hand-off."""
        request.status = RequestStatus.FINISHED_STOPPED
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)

    def take_ended_at_admission(self) -> list[Request]:
        """KV-only requests that ended at admission since the last call (the engine reports
        them; one that ended after its load is among ``update_from_kv_xfer_finished``'s)."""
        ended, self.ended_at_admission = self.ended_at_admission, []
        return ended

    def _chunk_size(self, num_remaining_tokens: int, budget: int) -> int:
        """This step's tokens of a request with ``num_remaining_tokens`` left to compute."""
        num_tokens = min(num_remaining_tokens, budget)
        if self.long_prefill_token_threshold:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        return num_tokens

    def _leave_final_chunk(self, request: Request, num_new_tokens: int) -> int:
        """This step's tokens of a prompt already running in chunks, cut short of its end
        where the connector wants a short last chunk (a chunk-wise hand-off's tail):

            prompt:  | computed | this step ........ | final chunk |
                                ^ num_computed      ^ boundary    ^ num_prompt_tokens

        ``boundary`` is the first block edge at most ``final_chunk_tokens`` from the prompt's
        end, so every block before it is full, offered and pulled while the final chunk
        computes, and the hand-off after it moves only the final chunk's blocks. Where no
        edge lies that close (the prompt's last, partial block is longer), it is the last
        edge inside the prompt: the final chunk is that block. It is never past the prompt,
        and a chunk is not cut where it lies in what is computed already. A prompt admitted
        whole (its rest fit one chunk) is never cut: the cut pays off only where the chunk
        before it has a pull to hide."""
        final = self.connector.final_chunk_tokens(request) if self.connector else 0
        num_computed, num_prompt = request.num_computed_tokens, request.num_prompt_tokens
        if not final or num_computed + num_new_tokens < num_prompt:
            return num_new_tokens
        block_size = self.block_size
        boundary = min(
            -(-(num_prompt - final) // block_size) * block_size,
            (num_prompt - 1) // block_size * block_size,
        )
        return boundary - num_computed if boundary > num_computed else num_new_tokens

    def _draft_room(
        self, request: Request, num_new_tokens: int, budget: int, num_new_computed: int = 0
    ) -> int:
        """How many drafts may follow this step's token: none unless a proposer is set and
        the step is the request's single last token (a decode, or a prompt's last token);
        else as many as leave room for every emitted token (``1 + drafts``) under
        ``max_tokens``, ``max_model_len`` and the step's token ``budget``. A prompt-logprobs
        request never drafts (its rows are the prompt's)."""
        if (
            self.proposer is None
            or num_new_tokens != 1
            or request.num_computed_tokens + num_new_computed + 1 != request.num_tokens
            or request.needs_prompt_logprobs
        ):
            return 0
        room = min(
            request.sampling_params.max_tokens - request.num_output_tokens,
            self.max_model_len - request.num_tokens,
            budget,
        )
        return max(0, room - 1)

    def _propose(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for each ``(request, room)`` with room, from one call to the proposer (a
        draft model runs its forwards for all of them together), each cut to what its
        request's grammar allows, in order."""
        proposer = self.proposer
        asks = [(request, room) for request, room in asks if room > 0]
        if proposer is None or not asks:
            return {}
        for request, _ in asks:
            if request.drafts is None:
                request.drafts = proposer.new_state()
        proposals = proposer.propose(
            [(request.drafts, request.all_token_ids, room) for request, room in asks]
        )
        drafts = {}
        for (request, _), proposal in zip(asks, proposals):
            grammar = request.grammar
            if proposal and grammar is not None:
                proposal = proposal[: grammar.num_valid_tokens(proposal)]
            drafts[request.request_id] = proposal
        return drafts

    def _schedule_chunk(
        self,
        output: SchedulerOutput,
        request: Request,
        num_tokens: int,
        drafts: list[int] | None = None,
    ) -> None:
        """Schedules the request's next ``num_tokens``, and ``drafts`` in its lookahead
        slots after them (counted as computed only once verified)."""
        start = request.num_computed_tokens
        end = start + num_tokens
        first, *others = self.kv_cache_manager.get_block_ids(request)
        drafts = drafts or []
        output.chunks.append(
            ScheduledChunk(
                request_id=request.request_id,
                token_ids=request.all_token_ids[start:end] + drafts,
                start_position=start,
                block_ids=first,
                sample=end == request.num_tokens,
                all_logits=request.needs_prompt_logprobs,
                other_block_ids=tuple(others),
                num_draft_tokens=len(drafts),
                lora_id=request.lora_id,
            )
        )
        output.requests.append(request)
        request.num_computed_tokens = end

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._release_drafts(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- applying results -----------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, new_token_ids: list[list[int]]
    ) -> list[Request]:
        """Appends each sampling chunk's new tokens (one, or a verified run of drafts and
        its bonus token), checking the stop conditions after each: a run stops at its first
        stop. Returns the requests that changed.

        The K/V of every appended token but the last was written by this step (the last
        token, and each accepted draft), so they count as computed; rejected drafts' slots
        are simply written again later."""
        changed: list[Request] = []
        tokens = iter(new_token_ids)
        sampled_at = time.perf_counter()
        for chunk, request in zip(output.chunks, output.requests):
            if not chunk.sample:
                continue
            run = next(tokens)
            if request.is_finished:  # aborted while the step ran
                continue
            request.stamps.first_token_at = request.stamps.first_token_at or sampled_at
            changed.append(request)
            for token_id in run:
                request.append_output_token(token_id)
                status = self.check_stop(request)
                if status is not None:
                    self.finish_request(request, status)
                    break
            else:
                request.num_computed_tokens += len(run) - 1
        return changed

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Whether the newest output token ends the request, noting why in its
        ``stop_reason`` (stop strings are the engine's: they need the text)."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        # Below min_tokens neither EOS nor a stop id ends it (vLLM's; the sampler bans both
        # there, so only a token it did not sample, a grammar's forced one, gets here).
        may_stop = request.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and last in self.eos_token_ids:
            request.stopped_on_token = True
            return RequestStatus.FINISHED_STOPPED
        if may_stop and last in params.stop_token_ids:
            request.stop_reason = last
            request.stopped_on_token = True
            return RequestStatus.FINISHED_STOPPED
        grammar = request.grammar
        if grammar is not None and grammar.finished:  # only EOS could follow
            return RequestStatus.FINISHED_STOPPED
        if grammar is not None and grammar.error is not None:
            # No token continues it (on a decode worker: the first token the prefill side
            # sampled is not in this grammar): a clean stop that says so, not a 500.
            request.stop_reason = f"grammar: {grammar.error}"
            return RequestStatus.FINISHED_STOPPED
        if (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        self._release(request)

    def stopped_after_finish(self, request: Request, stop: str) -> None:
        """A finished request whose text met ``stop`` at or before the token it finished on
        (found after the scheduler finished it: by length at that very token, or past it in
        a speculative run): it ended by that stop string. A hand-off lease granted for its
        length finish ends now: there is nothing left to decode."""
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = stop
        if request.kv_transfer_params_out is not None and self.connector is not None:
            self.connector.request_aborted(request)  # the lease: freed when no read holds it
            request.kv_transfer_params_out = None

    def offer_computed_blocks(
        self, output: SchedulerOutput
    ) -> list[tuple[Request, KVTransferParams]]:
        """A chunk-wise hand-off's offers: after this step's prefill chunks (of requests
        that hand off and are still prefilling), the blocks they filled.

        An offer's blocks are pinned (``KVCacheManager.pin_blocks``) while the lease names
        them: its checksums are taken later, off the engine thread (the worker's stream), and
        a block reused by another request meanwhile (its own was preempted, or its window
        moved on) would be vouched for with that request's K/V. The pins go when the
        connector reports the lease freeable (ended, no read in flight; see ``_release``)."""
        if self.connector is None:
            return []
        offers = []
        for chunk, request in zip(output.chunks, output.requests):
            if chunk.sample or not request.remote_decode or request.is_finished:
                continue
            offer = self.connector.offer_computed_blocks(
                request, self.kv_cache_manager.get_computed_block_ids_for_peer(request)
            )
            if offer is not None:
                self.kv_cache_manager.pin_blocks(request.request_id, offer.block_ids)
                offers.append((request, offer))
        return offers

    def _release_retired_pins(self) -> None:
        """Frees the blocks that left a lease at a later offer (a window moved on, a
        preempted prefill recomputed elsewhere) once no read of that lease is in flight:
        only a read begun before they left could still copy them."""
        assert self.connector is not None
        manager = self.kv_cache_manager
        for owner in [o for o in manager.retired_owners if not self.connector.is_being_read(o)]:
            manager.release_retired(owner)

    def _release(self, request: Request) -> None:
        """Frees a finished request's blocks, or hands them to the connector's lease.

        Its offers' pins stay until the connector reports its lease freeable: an offer's
        read may still be in flight (a prompt aborted, or ended by its first token, ends its
        lease at once), and its blocks must not be handed to another request under it."""
        self._release_drafts(request)
        delay_free = False
        if self.connector is not None and request.status != RequestStatus.FINISHED_ABORTED:
            block_ids = self.kv_cache_manager.get_block_ids(request)
            delay_free, params = self.connector.request_finished(request, block_ids)
            request.kv_transfer_params_out = params
        if delay_free:
            self.held_for_transfer[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
            self.requests.pop(request.request_id, None)

    def _release_drafts(self, request: Request) -> None:
        """What the drafter holds for a request leaving the running batch goes back."""
        if self.proposer is not None and request.drafts is not None:
            self.proposer.release(request.drafts)

    def update_from_kv_xfer_finished(self, finished: FinishedTransfers) -> list[Request]:
        """Frees leased blocks whose transfer is over; moves loaded requests on.

        A pull that lost blocks keeps what arrived intact up to the first bad block and
        recomputes from there (policy ``recompute``), or fails the request (``fail``).
        Returns requests whose state changed (finished or failed) for the engine to report.
        """
        changed: list[Request] = []
        self._release_retired_pins()
        for request_id in finished.freeable_request_ids:
            self.kv_cache_manager.unpin_blocks(request_id)  # its offers' blocks, if any
            request = self.held_for_transfer.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
                self.requests.pop(request_id, None)
        for request_id in finished.loaded_request_ids:
            request = self.waiting_for_remote_kvs.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.FINISHED_ABORTED:
                self.kv_cache_manager.free(request)
                self.requests.pop(request_id, None)
                continue
            request.kv_pull = finished.pulls.get(request_id)
            request.num_tokens_from_tier = finished.tier_tokens.get(request_id, 0)
            self._finish_load(
                request, finished.failed_block_ids, finished.load_errors.get(request_id)
            )
            if request.is_finished:
                changed.append(request)
        return changed

    def _finish_load(
        self, request: Request, failed_block_ids: set[int], load_error: str | None
    ) -> None:
        params = request.kv_transfer_params
        num_target = request.num_tokens_after_load
        tables = self.kv_cache_manager.get_block_ids(request)
        num_loaded = num_target
        num_before_load = request.num_computed_tokens
        first_block = num_before_load // self.block_size
        for block_ids in tables:  # the first bad position of any group
            end = min(len(block_ids), -(-num_target // self.block_size))
            for index in range(first_block, end):
                if block_ids[index] in failed_block_ids:
                    num_loaded = min(num_loaded, index * self.block_size)
                    break
        if num_loaded < num_target:
            self.counters.num_load_failures += 1
            if request.kv_only:  # an offer recomputes nothing: its hand-off pulls the rest
                logger.info(
                    "offer %s: %d of %d tokens arrived intact; the hand-off pulls the rest",
                    request.request_id,
                    num_loaded,
                    num_target,
                )
            elif self.failure_policy == "fail":
                source = params.engine_id if params is not None else "the KV tier"
                request.error = (
                    f"KV transfer from {source} failed for request "
                    f"{request.request_id} (policy 'fail'): "
                    f"{load_error or 'blocks arrived corrupt or incomplete'}"
                )
                request.status = RequestStatus.FINISHED_ERROR
                self._release(request)
                return
            else:
                self.counters.num_recompute_fallbacks += 1
                logger.warning(
                    "request %s: %d of %d prompt tokens arrived intact; recomputing the rest",
                    request.request_id,
                    num_loaded,
                    num_target,
                )
        if num_loaded < num_target and not self.kv_cache_manager.holds_blocks_from(
            request, num_loaded
        ):
            # Blocks a sliding window will have left were dropped for the load; recomputing
            # from the bad position would read or write them: the prompt starts over instead.
            num_loaded = request.num_computed_tokens = 0
        # | pool hit | tier | pull |: what landed intact, the tier's part first.
        num_landed = max(0, num_loaded - request.num_computed_tokens)
        request.num_tier_tokens = min(num_landed, request.num_tokens_from_tier)
        request.num_pulled_tokens = num_landed - request.num_tier_tokens
        # A tier hit is a cache hit (vLLM's cached_tokens counts it); a pull is not.
        request.num_cached_tokens = max(
            request.num_cached_tokens,
            request.num_computed_tokens - request.num_pulled_early_tokens + request.num_tier_tokens,
        )
        request.kv_transfer_params = None  # the lease is released; a preemption recomputes
        request.stamps.record_load(request.kv_pull)
        request.num_computed_tokens = max(request.num_computed_tokens, num_loaded)
        if request.kv_only:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if params is not None:  # an offer: its hand-off will name the same lease
                self.kv_cache_manager.mark_pulled_early(  # the peer's part, past the tier's
                    request,
                    num_before_load + request.num_tier_tokens,
                    request.num_computed_tokens,
                    params.lease_id,
                )
            self._end_kv_only(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        if request.num_computed_tokens == 0:
            # Nothing usable arrived: start over like a new request (prefix lookup included).
            self.kv_cache_manager.free(request)
            return
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
