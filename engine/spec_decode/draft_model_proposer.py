"""A draft model (vLLM's ``draft_model``): a smaller model with the target's vocabulary
guesses the next tokens, one forward each, over its own paged KV.

    the engine's pool (target)                    the draft's pool (here)
    | prompt ............ | t | d0 d1 d2 |        | prompt ............ | t | d0 d1 |
    └ KV pulled or computed ┘  verified next        └ KV the draft wrote ┘  fed to get d1, d2

A step's drafting runs for all its requests at once: the first forward feeds each request
every token the draft has not seen (the whole prompt at its first drafting step: on a
decode worker the prompt's KV came from the prefill, for the target only; afterwards the
verified run's tokens from the first one that differs from what the draft fed), and its
last row gives each ``d0``; then one forward per further draft position, over the
requests still drafting (one token each: a decode batch). Pages written after a rejected
draft are stale, and simply written again: the draft remembers the tokens it fed and
recomputes from the first that differs.

    forward 0   | catch-up A (prompt) | catch-up B (t) | catch-up C (x y t) |  -> d0 each
    forward 1   | d0_A | d0_B | d0_C |                                         -> d1 each
    forward 2   | d1_A |        d1_C |   (B drafts 2: its acceptance pays no more)

Drafts are the draft's argmax: a one-hot proposal, so the target's verification by
coupling (``verification.py``) keeps the target's distribution exactly and a seeded request
reproducible whatever was drafted. The price: a sampled request accepts less often than
rejection sampling against the draft's own distribution would let it.

**What a draft costs.** Each draft is a forward of the draft model on top of its row in the
verification, so the request's drafting trade (``draft_acceptance.py``) weighs
``speculative_min_acceptance`` plus the draft forward's share of the model's decode step
(``speculative_draft_cost``, else measured at start-up: one-token forwards of both, side by
side, the median of a few). A draft as dear as the model never drafts.

**Its own pool, not the target's ledger.** The draft's pages have its own shape (its layers
and heads), so they cannot be the target's blocks; they hold nothing a peer, the router or
the tier may read (no hashes, no KV events, no transfer); and when the pool is full the
request skips drafting for that step: a draft never preempts a request. The pool holds as
many tokens as the target's, and a request's pages go back when it finishes, is aborted or
is preempted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.cache import cdiv
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import greedy_tokens
from pdserve.engine.spec_decode.draft_acceptance import DraftAcceptance
from pdserve.messages.engine_config import EngineConfig
from pdserve.model.architectures import CausalLM
from pdserve.model.loader import load_model
from pdserve.model.model_config import ModelConfig

# One-token forwards of each model timed at start-up (the first is a warm-up, dropped).
_COST_ROUNDS = 6


@dataclass(slots=True)
class DraftModelState:
    """One request's drafting state: the draft's pages for it and what they hold.

    ``fed`` are the tokens whose K/V the draft wrote, in position order; the first
    ``num_checked`` of them are known to equal the request's tokens."""

    acceptance: DraftAcceptance
    block_ids: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    num_checked: int = 0


class _Plan(NamedTuple):
    """One request's drafting in this step: ask ``ask``, fed from position ``start``."""

    ask: int
    state: DraftModelState
    tokens: list[int]
    start: int
    num_drafts: int


class DraftModel(NamedTuple):
    """A loaded draft model: the engine sizes its pool beside the model's before building it."""

    model: CausalLM
    model_config: ModelConfig


def load_draft_model(config: EngineConfig, target: ModelConfig) -> DraftModel:
    """The draft ``config.speculative_model`` names, refused where ``check_draft_model``
    refuses it."""
    assert config.speculative_model is not None  # EngineConfig checks it
    model, model_config, _ = load_model(
        config.speculative_model, config.dtype, config.device, config.quantization
    )
    check_draft_model(config, model_config, target)
    return DraftModel(model, model_config)


def check_draft_model(config: EngineConfig, draft: ModelConfig, target: ModelConfig) -> None:
    """Refuses a draft that cannot run beside ``target``: another vocabulary (its guesses
    would be other tokens) or more than one KV group (its pages are one pool's, which has no
    sliding-window groups). ``load_draft_model`` runs it on the loaded draft; ``pdserve up``
    on the two configs, before it deploys a worker (``deploy/preflight.py``)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_model {config.speculative_model} has a vocabulary of "
            f"{draft.vocab_size} tokens and the model {config.model} one of "
            f"{target.vocab_size}: a draft model must share the model's tokenizer"
        )
    if len(draft.kv_layer_groups) != 1:
        raise ValueError(
            f"speculative_model {config.speculative_model}: a draft model needs one KV "
            f"group (no interleaved sliding-window layers), it has "
            f"{len(draft.kv_layer_groups)}"
        )


class DraftModelProposer:
    """Proposes up to ``num_speculative_tokens`` drafts with a draft model."""

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        config: EngineConfig,
        num_blocks: int,
        target: ModelRunner,
    ) -> None:
        self.runner = ModelRunner.for_engine(config, model, model_config, num_blocks, draft=True)
        self.block_size = config.block_size
        self.max_positions = model_config.max_position_embeddings
        self.num_speculative_tokens = config.num_speculative_tokens
        self._free_block_ids = list(range(num_blocks - 1, 0, -1))  # block 0: the null block
        self.draft_cost = config.speculative_draft_cost
        if self.draft_cost is None:
            self.draft_cost = self._measured_cost(target)
        # A draft's cost in decode steps: its verification row and its own forward.
        self.cost_per_draft = config.speculative_min_acceptance + self.draft_cost

    def _measured_cost(self, target: ModelRunner) -> float:
        """The draft's one-token forward over the model's, medians of alternate runs (at
        start-up, into a free page of each pool: nothing reads it before it is allocated)."""
        chunks = {  # the model's other KV groups (Gemma 3's windowed layers) too
            runner: ScheduledChunk(
                "cost",
                [1],
                0,
                [1],
                True,
                other_block_ids=tuple([1] for _ in runner.group_windows[1:]),
            )
            for runner in (self.runner, target)
        }
        times: dict[ModelRunner, list[float]] = {runner: [] for runner in chunks}
        for _ in range(_COST_ROUNDS):
            for runner, chunk in chunks.items():
                started = time.perf_counter()
                runner.execute([chunk])
                times[runner].append(time.perf_counter() - started)
        draft, model = (statistics.median(measured[1:]) for measured in times.values())
        return draft / model

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def new_state(self) -> DraftModelState:
        """A request starts with a probe (one draft), not a full run as prompt lookup does:
        here every draft costs a forward, and most of a useless draft's cost is in the
        steps before its acceptance falls. At no cost (0) every step drafts the most."""
        cost = self.cost_per_draft
        return DraftModelState(DraftAcceptance(cost, rate=cost if cost > 0 else 1.0))

    def propose(self, asks: list[tuple[DraftModelState, list[int], int]]) -> list[list[int]]:
        """For each ``(state, token_ids, max_num_tokens)``: drafts to follow ``token_ids``
        (at most ``max_num_tokens``, the request's room, and as many as its acceptance pays
        for), or [] when it pauses drafting, the draft's positions end before them, or the
        pool has no room for it."""
        plans = []
        for index, (state, token_ids, max_num_tokens) in enumerate(asks):
            limit = state.acceptance.num_drafts(min(self.num_speculative_tokens, max_num_tokens))
            last_position = len(token_ids) + limit - 2  # the last draft fed, for the next
            if limit > 0 and last_position < self.max_positions:
                if self._reserve(state, last_position + 1):
                    start = self._first_unseen(state, token_ids)
                    plans.append(_Plan(index, state, token_ids, start, limit))
        drafts: list[list[int]] = [[] for _ in asks]
        chunks = [
            ScheduledChunk(
                "draft", plan.tokens[plan.start :], plan.start, plan.state.block_ids, True
            )
            for plan in plans
        ]
        for step in range(max((plan.num_drafts for plan in plans), default=0)):
            drafting = [plan for plan in plans if plan.num_drafts > step]
            for plan, token in zip(drafting, self._argmax(chunks)):
                drafts[plan.ask].append(token)
            chunks = [  # each request's newest draft, at its position
                ScheduledChunk(
                    "draft",
                    drafts[plan.ask][-1:],
                    len(plan.tokens) + step,
                    plan.state.block_ids,
                    True,
                )
                for plan in drafting
                if plan.num_drafts > step + 1
            ]
        for plan in plans:
            fed = plan.state.fed
            del fed[plan.start :]
            fed.extend(plan.tokens[plan.start :])
            fed.extend(drafts[plan.ask][:-1])
            plan.state.num_checked = len(plan.tokens)
        return drafts

    def _first_unseen(self, state: DraftModelState, token_ids: list[int]) -> int:
        """The first position whose K/V the draft must (re)compute: where what it fed ends or
        first differs from ``token_ids``; never past the last token (its row gives d0)."""
        fed, start = state.fed, state.num_checked
        end = min(len(fed), len(token_ids) - 1)
        while start < end and fed[start] == token_ids[start]:
            start += 1
        return min(start, end)

    def release(self, state: DraftModelState) -> None:
        """Gives the request's pages back (it finished, was aborted or preempted); its
        acceptance stays with it."""
        self._free_block_ids.extend(reversed(state.block_ids))
        state.block_ids = []
        state.fed.clear()
        state.num_checked = 0

    def _reserve(self, state: DraftModelState, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` positions, or False (nothing taken) when the pool has
        too few free."""
        num_needed = cdiv(num_tokens, self.block_size) - len(state.block_ids)
        if num_needed > len(self._free_block_ids):
            return False
        for _ in range(num_needed):
            state.block_ids.append(self._free_block_ids.pop())
        return True

    def _argmax(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The draft's next token after each chunk: one forward for all of them."""
        if not chunks:
            return []
        return greedy_tokens(self.runner.execute(chunks)).tolist()
