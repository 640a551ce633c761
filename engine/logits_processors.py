"""What a request's sampling fields do to its logits before a token is drawn, for a whole
batch at once: vLLM's definitions and order, so the same request gives vLLM's tokens.

In ``sampler.sample``, after the grammar's mask and before greedy and sampled rows part::

    logits ─▶ allowed_token_ids ─▶ bad_words ─▶ min_tokens ─▶ logit_bias ─▶ penalties ─▶ …
              others -inf          the word's   EOS and stop   + bias        repetition,
                                   last token   ids -inf                     frequency,
                                   -inf                                      presence

- ``repetition_penalty`` r, over the ids in the prompt or the output: a positive logit is
  divided by r, a negative one multiplied (vLLM's, after CTRL);
- ``frequency_penalty`` f and ``presence_penalty`` p, over the output's ids: ``logit -=
  f * count + p * (count > 0)`` (OpenAI's);
- ``bad_words``: a word of one token is never sampled; a longer one's last token is banned
  where the output ends with the rest of it (vLLM's, over the output only);
- ``min_tokens``: while fewer tokens were output, EOS (unless ``ignore_eos``) and the stop
  ids are banned (stop strings wait too: ``IncrementalDetokenizer``).

``min_p`` acts among temperature, top-k and top-p (``sampler._sample_rows``), as vLLM's
argmax-invariant processor: greedy rows never see it.

A speculative step's draft rows see the history they would have as plain steps: the request's
output, then the drafts before the row (``RowHistory``). Logprobs stay the raw model's
(vLLM's default), so only the drawn token changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.token_counts import TokenCounts
from pdserve.messages.sampling_params import SamplingParams


@dataclass(slots=True)
class RowHistory:
    """What a sampled row's history-dependent fields read: its request's counts (None when
    no penalty applies), its output so far and the drafts sampled before the row."""

    counts: TokenCounts | None
    output_token_ids: Sequence[int]
    drafts_before: Sequence[int] = ()

    def tail(self, length: int) -> list[int]:
        """The last ``length`` tokens of the output followed by the drafts (fewer when the
        output is shorter)."""
        drafts = list(self.drafts_before[len(self.drafts_before) - length :] if length else [])
        missing = length - len(drafts)
        if missing <= 0:
            return drafts
        return list(self.output_token_ids[-missing:]) + drafts


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[RowHistory],
    output_positions: Sequence[int],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with each row's fields applied (a copy when any row has
    one; the input when none has)."""
    rows = [r for r, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab_size = logits.shape[1]
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for r in rows:
        p = params[r]
        if p.allowed_token_ids is not None:
            keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab_size])
            allowed = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, keep, True)
            logits[r].masked_fill_(~allowed.to(logits.device), float("-inf"))
        for word in p.bad_words_token_ids:
            if len(word) == 1 or histories[r].tail(len(word) - 1) == list(word[:-1]):
                banned_rows.append(r)
                banned_ids.append(word[-1])
        if output_positions[r] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            banned_rows += [r] * len(stops)
            banned_ids += sorted(stops)
        for token_id, bias in p.logit_bias.items():
            bias_rows.append(r)
            bias_ids.append(token_id)
            bias_values.append(bias)
    device = logits.device
    banned_rows, banned_ids = _within(vocab_size, banned_rows, banned_ids)
    bias_rows, bias_ids, bias_values = _within(vocab_size, bias_rows, bias_ids, bias_values)
    if banned_rows:
        logits[_index(banned_rows, device), _index(banned_ids, device)] = float("-inf")
    if bias_rows:
        logits.index_put_(
            (_index(bias_rows, device), _index(bias_ids, device)),
            torch.tensor(bias_values, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    penalized = [r for r in rows if params[r].penalized]
    if penalized:
        _apply_penalties(logits, penalized, params, histories)
    return logits


def _apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    histories: Sequence[RowHistory],
) -> None:
    """The three penalties of ``rows``, in place, over the ids each row has seen only
    (``token_counts.py``): one gather and one scatter for the batch."""
    device = logits.device
    ids, outputs, lengths = [], [], []
    for r in rows:
        counts = histories[r].counts
        if counts is None:
            raise ValueError(f"row {r} has a penalty but its request's token counts are unset")
        drafts = histories[r].drafts_before
        row_ids, output = counts.with_drafts(drafts) if drafts else (counts.ids, counts.output)
        ids.append(row_ids)
        outputs.append(output)
        lengths.append(len(row_ids))
    seen = torch.cat(ids).to(device)
    output_counts = torch.cat(outputs).to(device=device, dtype=logits.dtype)
    row_of = torch.repeat_interleave(_index(rows, device), _index(lengths, device))

    def per_entry(name: str) -> torch.Tensor:
        values = [getattr(params[r], name) for r in rows]
        per_row = torch.tensor(values, dtype=logits.dtype, device=device)
        return torch.repeat_interleave(per_row, _index(lengths, device))

    values = logits[row_of, seen]
    repetition = per_entry("repetition_penalty")
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= per_entry("frequency_penalty") * output_counts
    values -= per_entry("presence_penalty") * (output_counts > 0)
    logits[row_of, seen] = values


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _within(vocab_size: int, rows: list, ids: list, *more: list) -> tuple[list, ...]:
    """The entries whose token id the model has (a tokenizer may count fewer ids than the
    model's padded vocabulary, never more: those entries can change nothing)."""
    kept = [i for i, token_id in enumerate(ids) if token_id < vocab_size]
    if len(kept) == len(ids):
        return (rows, ids, *more)
    return tuple([column[i] for i in kept] for column in (rows, ids, *more))
