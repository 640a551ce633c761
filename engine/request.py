"""A request's state inside one engine: tokens, progress, blocks' hashes, status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pdserve.cache import BlockHash, RequestBlockHasher
from pdserve.engine.request_stamps import RequestStamps
from pdserve.engine.token_counts import TokenCounts
from pdserve.grammar import GrammarMatcher
from pdserve.messages.generation import StopReason
from pdserve.messages.kv_provenance import KVProvenance
from pdserve.messages.logprobs import TokenLogprobs
from pdserve.messages.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.kv_connector_base import PullSummary
    from pdserve.engine.spec_decode.proposer import DraftState
    from pdserve.messages.kv_transfer_params import KVTransferParams


class RequestStatus(enum.Enum):
    """Where a request is in its life.

    WAITING ──admit──▶ RUNNING ──stop / length / abort──▶ FINISHED_*
       │  ▲               │
       │  └──preempt──────┘  (blocks freed; recomputed from the prefix cache)
       └─remote KV─▶ WAITING_FOR_REMOTE_KVS ──loaded──▶ WAITING (prompt already computed)
    """

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One request, as the scheduler and the ledger see it (satisfies ``CacheRequest``).

    ``all_token_ids`` is the prompt followed by the outputs; ``num_computed_tokens`` counts
    how many of them have K/V in this engine's cache. Block hashes are kept up to date as
    tokens arrive, one per *full* block, so the ledger can cache a block the moment it fills.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        sampling_seed: int,
        block_hasher: RequestBlockHasher,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_id: str | None = None,
        remote_decode: bool = False,
        kv_transfer_params: KVTransferParams | None = None,
        arrival_time: float | None = None,
        grammar: GrammarMatcher | None = None,
        kv_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.sampling_seed = sampling_seed
        self.cache_salt = cache_salt
        # The adapter it runs: by name for the runner, by its weights' digest for the hashes.
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.remote_decode = remote_decode
        self.kv_transfer_params = kv_transfer_params
        # A decode worker's pull of a chunk-wise hand-off's offer: it loads the offered blocks
        # into the prefix cache and ends, computing and sampling nothing.
        self.kv_only = kv_only
        # Structured outputs: where the output is in its grammar; advances with every token
        # once it applies (``grammar``): a reasoning model's grammar waits for the end of its
        # reasoning (``reasoning_end_token_ids``), the first token may end it or lie in it.
        self._grammar = grammar
        self._reasoning_end = list(sampling_params.reasoning_end_token_ids)
        self.grammar_started = not self._reasoning_end
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.stamps = RequestStamps()
        self.finish_time: float | None = None
        self.error: str | None = None
        # Why a FINISHED_STOPPED request stopped, as vLLM's ``stop_reason``: the stop token
        # id or stop string it met, or what its grammar said when no token could continue
        # it (None: EOS, or the grammar completed).
        self.stop_reason: StopReason = None
        # Its last output token is the EOS or ``stop_token_ids`` token that ended it: that
        # token's id is output, its text is not (vLLM's rule).
        self.stopped_on_token = False
        # Set on a prefill worker when the request finished with its blocks leased out.
        self.kv_transfer_params_out: KVTransferParams | None = None
        self.num_cached_tokens = 0
        # Where the prompt's KV came from: fixed at the first admission and the first pull
        # (a preemption's recompute, mostly from the prefix cache, does not change it).
        self.kv_offered = kv_transfer_params is not None
        # The hand-off's lease, kept once its params are dropped (nothing left to pull): its
        # offers' blocks in the pool are marked with it (KVCacheBlock.pulled_early_for).
        self.handoff_lease_id = kv_transfer_params.lease_id if kv_transfer_params else None
        self.num_prompt_cache_hit_tokens: int | None = None
        self.num_pulled_early_tokens = 0  # its offers brought them: in the pool, not hits
        self.num_pulled_tokens = 0
        self.num_tier_tokens = 0  # loaded intact from this worker's KV tier
        # While in WAITING_FOR_REMOTE_KVS: the computed tokens once its load lands, and how
        # many of them the KV tier was to supply.
        self.num_tokens_from_tier = 0
        self.num_tokens_after_load = 0
        self.kv_pull: PullSummary | None = None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Aligned with output_token_ids when the params ask for logprobs (None: a token
        # sampled elsewhere, the first one a prefill worker handed over).
        self.output_logprobs: list[TokenLogprobs | None] = []
        # Each prompt token's logprob given the ones before it, when asked (None for the first).
        self.prompt_logprobs: list[TokenLogprobs | None] = (
            [None] if sampling_params.prompt_logprobs is not None else []
        )
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Speculative decoding's state for this request (made at its first drafting step).
        self.drafts: DraftState | None = None
        # Its tokens counted for the penalties (made at its first penalized sampling step).
        self.token_counts: TokenCounts | None = None
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    @property
    def grammar(self) -> GrammarMatcher | None:
        """The grammar that constrains the next token: None without one, or while the
        output's reasoning lasts (nothing constrains reasoning)."""
        return self._grammar if self.grammar_started else None

    def grammar_starts_within(self, run: list[int]) -> int | None:
        """Where in ``run`` (tokens about to be appended) the reasoning ends, so that the
        grammar applies to the tokens after that index; None if it does not end there (or
        no grammar waits). A speculative run is cut there: its later tokens were sampled
        unconstrained."""
        if self._grammar is None or self.grammar_started:
            return None
        end = self._reasoning_end
        tail = self.output_token_ids[-len(end) :]
        for index in range(len(run)):
            if (tail + run[: index + 1])[-len(end) :] == end:
                return index
        return None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs, and some are still to compute (a preempted request's
        recompute does not compute them again)."""
        return 0 < len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def record_first_admission(
        self, num_cache_hit_tokens: int, num_pulled_early_tokens: int = 0
    ) -> None:
        """The prefix-cache hit the request was first admitted with, and the tokens its
        offers had pulled into the pool before it (later admissions, after a preemption or
        a failed pull, keep the first)."""
        if self.num_prompt_cache_hit_tokens is None:
            self.stamps.admitted_at = time.perf_counter()
            self.num_prompt_cache_hit_tokens = min(num_cache_hit_tokens, self.num_prompt_tokens)
            self.num_pulled_early_tokens = num_pulled_early_tokens

    def kv_provenance(self) -> KVProvenance | None:
        """Where this engine got the prompt's KV; None if it never needed it (never admitted,
        e.g. a decode worker's request ended by the first token the prefill sampled).

        What neither the cache nor the peer supplied was computed here: *recomputed* when a
        peer had offered it (its pull failed), *computed* when none had."""
        hit = self.num_prompt_cache_hit_tokens
        if hit is None:
            return None
        early = self.num_pulled_early_tokens
        rest = self.num_prompt_tokens - hit - self.num_tier_tokens - early - self.num_pulled_tokens
        pull = self.kv_pull
        return KVProvenance(
            num_prompt_tokens=self.num_prompt_tokens,
            num_cache_hit_tokens=hit,
            num_tier_tokens=self.num_tier_tokens,
            num_pulled_early_tokens=early,
            num_pulled_tokens=self.num_pulled_tokens,
            num_recomputed_tokens=rest if self.kv_offered else 0,
            num_computed_tokens=0 if self.kv_offered else rest,
            num_blocks_pulled=pull.num_blocks if pull else 0,
            num_bytes_pulled=pull.num_bytes if pull else 0,
            transfer_s=pull.duration_s if pull else 0.0,
        )

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._grammar is not None:
            if self.grammar_started:
                self._grammar.accept(token_id)
            elif self.output_token_ids[-len(self._reasoning_end) :] == self._reasoning_end:
                self.grammar_started = True
        self._update_block_hashes()

    @property
    def text_token_ids(self) -> list[int]:
        """The output tokens whose text is output: all but the stop token that ended it."""
        return self.output_token_ids[:-1] if self.stopped_on_token else self.output_token_ids

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops the output tokens after the first ``num_output_tokens`` (a stop string
        found inside a speculative step's run: the tokens after it were never output).
        Only for a request that has finished; its blocks are already released."""
        cut = self.num_output_tokens - num_output_tokens
        if cut <= 0:
            return
        self.stopped_on_token = False  # it ends on the stop string's token now
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - cut :]
        del self.output_logprobs[num_output_tokens:]
        del self.block_hashes[len(self.all_token_ids) // self._block_hasher.block_size :]

    def _update_block_hashes(self) -> None:
        """Hash the blocks that just filled; a token that completes none costs one check."""
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self._block_hasher.block_size:
            self.block_hashes.extend(self._block_hasher.new_block_hashes(self))
