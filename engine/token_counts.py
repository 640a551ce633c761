"""Which vocabulary ids a request's prompt and output hold, and how often each was output:
what the penalties read (``logits_processors.py``).

Sparse, as the penalties are: only the ids the request has seen can be penalized, a few
hundred against a vocabulary of tens of thousands, so a step gathers and scatters those
logits alone (a dense ``[rows, vocab]`` pass cost 11 ms a step at batch 16 on this CPU,
the sparse one a fraction of a millisecond). Kept per request and brought up to date from
its output list before each step that samples it: a step adds only the tokens accepted
since the last one, never recounts. A decode worker builds the counts from the prompt and
the tokens it was handed (the prefill's first token included), so both sides of a hand-off
count alike::

    seen ids   [ prompt's ids, in first-seen order | ids first seen in the output ]
    output     [ 0 for a prompt-only id            | times output                  ]

    output_token_ids:  t0 t1 ... t(k-1) | tk ... t(n-1)
                       counted          added by sync()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenCounts:
    """A request's seen ids (``ids`` long) and their output counts (``output`` float32)."""

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self._prompt_ids = list(dict.fromkeys(prompt_token_ids))
        self._reset()

    def _reset(self) -> None:
        self._slot = {token: slot for slot, token in enumerate(self._prompt_ids)}
        capacity = max(16, 2 * len(self._prompt_ids))
        self._ids = torch.zeros(capacity, dtype=torch.long)
        self._ids[: len(self._prompt_ids)] = torch.tensor(self._prompt_ids, dtype=torch.long)
        self._output = torch.zeros(capacity)
        self._num_ids = len(self._prompt_ids)
        self.num_counted = 0

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: self._num_ids]

    @property
    def output(self) -> torch.Tensor:
        return self._output[: self._num_ids]

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Counts the output tokens added since the last call; starts again only after the
        output was cut shorter (a replay's check)."""
        if len(output_token_ids) < self.num_counted:
            self._reset()
        for token in output_token_ids[self.num_counted :]:
            slot = self._slot_of(token)  # first: it may grow the buffers
            self._output[slot] += 1.0
        self.num_counted = len(output_token_ids)

    def with_drafts(self, drafts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, output)`` as they would be with ``drafts`` output too (a draft's row of a
        speculative step), leaving these counts as they are."""
        ids, output = self.ids.clone(), self.output.clone()
        extra_ids: list[int] = []
        extra_counts: list[float] = []
        for token in drafts:
            slot = self._slot.get(token)
            if slot is not None:
                output[slot] += 1.0
            elif token in extra_ids:
                extra_counts[extra_ids.index(token)] += 1.0
            else:
                extra_ids.append(token)
                extra_counts.append(1.0)
        if not extra_ids:
            return ids, output
        return (
            torch.cat([ids, torch.tensor(extra_ids, dtype=torch.long)]),
            torch.cat([output, torch.tensor(extra_counts)]),
        )

    def _slot_of(self, token: int) -> int:
        slot = self._slot.get(token)
        if slot is None:
            slot = self._slot[token] = self._num_ids
            if slot == len(self._ids):
                self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
                self._output = torch.cat([self._output, torch.zeros_like(self._output)])
            self._ids[slot] = token
            self._num_ids += 1
        return slot
