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
    matchers: Sequence[GrammarMatcher | None], vocab_size: int
) -> torch.Tensor | None:
    """The bitmask of the rows' next tokens; None when no row has a grammar."""
    constrained = [(m.llmatcher, row) for row, m in enumerate(matchers) if m is not None]
    if not constrained:
        return None
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    _EXECUTOR.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), words * 4, len(matchers))
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
