"""The batch's token mask for structured outputs: filled by llguidance, applied in the sampler.

One int32 word holds 32 tokens' "may come next" bits, row ``r`` for sampled row ``r``:

    bitmask [rows, ceil(vocab / 32)]     bit t % 32 of word t // 32 = token t allowed
    row without a grammar                all bits set (-1): nothing masked

llguidance fills every constrained row in one call on its own threads (``LLExecutor``),
straight into the tensor's memory (``llguidance.torch`` is not imported: its module-level
``torch.compile`` would add seconds to every worker's start).
Applying unpacks the bits with one broadcast shift into a ``[rows, vocab]`` boolean and
fills the forbidden logits with -inf on a copy: the raw logits stay for logprobs.
(llguidance's own ``apply_token_bitmask_inplace`` is a ``torch.compile`` kernel, which would
cost a compile at the first constrained step of every process on CPU.)
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from pdserve.grammar import GrammarMatcher

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_BYTE_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int64)
_EXECUTOR: llguidance.LLExecutor | None = None


def fill_token_bitmask(
    rows: Sequence[tuple[GrammarMatcher | None, list[int]]], vocab_size: int
) -> torch.Tensor | None:
    """The bitmask of each sampling chunk's rows; None when no chunk has a grammar.

    A chunk is ``(its grammar, its draft tokens)`` and gets ``1 + len(drafts)`` rows: the
    next token's mask, then each draft's, in the state after the drafts before it
    (llguidance advances through the drafts and rolls back; the scheduler drafted only
    tokens the grammar allows)."""
    if all(matcher is None for matcher, _ in rows):
        return None
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    num_rows = sum(1 + len(drafts) for _, drafts in rows)
    bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
    constrained, first = [], 0
    for matcher, drafts in rows:
        if matcher is not None:
            constrained.append((matcher.llmatcher, first, drafts))
        first += 1 + len(drafts)
    # llguidance takes drafted rows and plain rows in separate calls (drafts never empty).
    drafted = [entry for entry in constrained if entry[2]]
    if drafted:
        _EXECUTOR.unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.data_ptr(), words * 4, num_rows
        )
    plain = [(llmatcher, row) for llmatcher, row, drafts in constrained if not drafts]
    if plain:
        _EXECUTOR.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, num_rows)
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with every token the bitmask forbids at -inf (a copy)."""
    allowed = allowed_tokens(bitmask, logits.shape[1]).to(logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask unpacked: ``[rows, vocab]`` booleans, True where the token may come next."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def num_masked_tokens(bitmask: torch.Tensor, rows: Sequence[int], vocab_size: int) -> int:
    """How many tokens the bitmask forbids over ``rows`` (a byte popcount; for the stats).
    Bits past the vocabulary in the last word are cleared before counting."""
    words = bitmask[list(rows)]
    tail = vocab_size % 32
    if tail:
        words[:, -1] &= (1 << tail) - 1
    allowed = int(_BYTE_POPCOUNT[words.view(torch.uint8).long()].sum())
    return len(rows) * vocab_size - allowed
