"""One step's LoRA rows: which rows run which adapter, and the low-rank products added to the
fused projections' outputs, every adapter of the step at once.

Rows of different adapters (and none) share one step: the base matmul runs once over all of
them, then the step's adapters multiply their own rows in two batched matmuls per site. Each
adapter's rows are gathered into a padded group (by row index: the weights are read once an
adapter, not gathered per token), and each part's A and B (q_proj's, k_proj's, ... of a fused
projection) are stacked beside the other adapters'::

    rows      [adapters, m] (padded; a padded slot repeats row 0, its product masked to 0)
    x[rows]   [adapters, m, in]   @ A_stack^T [adapters, in, r]   -> low   [adapters, m, r]
    low                           @ B_stack^T [adapters, r, out]  -> delta [adapters, m, out]
    out[:, part's columns].index_add_(rows, delta * valid)

``r`` is the largest rank of the part among the step's adapters (smaller ones zero-padded);
an adapter without the part adds zeros. (One block-diagonal B per site would need one matmul
less, but reads three times q/k/v's bytes: on smollm2 the adapters' weights stream from
memory every step, so bytes are the cost.) The stacks depend only on which adapters a step runs,
so they are built once per set and kept (``LoRAStacks``): a decode batch's steps share them.
Per step and site this is six tensor operations whatever the adapters' count: with one small
matmul per adapter and part, smollm2's step at batch 16 over 4 adapters took 1.69x the base's.

The model runner makes a step's ``LoRAStep`` current (``active``) around its forward; the
layers add their sites' products where one is (``add_lora``). Without one the forward is the
base model's, untouched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from pdserve.model.lora.peft_adapter import TARGETS, LoRAAdapter

PartStack = tuple[tuple[int, int], torch.Tensor, torch.Tensor]
"""One part of a site for every adapter of a set: its columns of the fused output,
``A_stack`` ``[adapters, r, in]`` and ``B_stack`` ``[adapters, out, r]``."""
Stacks = dict[tuple[int, str], list[PartStack]]
"""By (layer, site): the parts any adapter of the set adapts there."""


class LoRAStacks:
    """The sites' stacked A and B of recent adapter sets (by their digests, in order): the
    few sets a server's steps run, kept so that no step rebuilds them."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._sets: OrderedDict[tuple[str, ...], Stacks] = OrderedDict()

    def of(self, adapters: list[LoRAAdapter]) -> Stacks:
        key = tuple(adapter.digest for adapter in adapters)
        stacks = self._sets.pop(key, None)
        if stacks is None:
            stacks = _stack(adapters)
            while len(self._sets) >= self.capacity:
                self._sets.popitem(last=False)
        self._sets[key] = stacks
        return stacks


def _stack(adapters: list[LoRAAdapter]) -> Stacks:
    """Each site's parts stacked over the adapters, ranks zero-padded to the largest, an
    adapter without the part all zeros."""
    stacks: Stacks = {}
    for key in sorted({key for adapter in adapters for key in adapter.sites}):
        by_target = [
            {part.target: part for part in adapter.sites.get(key, ())} for adapter in adapters
        ]
        targets = sorted({t for parts in by_target for t in parts}, key=lambda t: TARGETS[t][1])
        stacked = []
        for target in targets:
            present = [parts.get(target) for parts in by_target]
            some = next(part for part in present if part is not None)
            rank = max(part.a.shape[0] for part in present if part is not None)
            a = some.a.new_zeros(len(adapters), rank, some.a.shape[1])
            b = some.b.new_zeros(len(adapters), some.b.shape[0], rank)
            for index, part in enumerate(present):
                if part is not None:
                    a[index, : part.a.shape[0]] = part.a
                    b[index, :, : part.b.shape[1]] = part.b
            stacked.append((some.columns, a, b))
        stacks[key] = stacked
    return stacks


class LoRAStep:
    """The step's rows of each adapter, padded into groups, and the adapters' stacks."""

    def __init__(
        self,
        groups: list[tuple[LoRAAdapter, list[int]]],
        stacks: LoRAStacks,
        device: torch.device,
    ) -> None:
        """``groups``: each adapter the step runs and its rows (indices into the step's
        tokens)."""
        width = max(len(rows) for _, rows in groups)
        padded = [rows + [rows[0]] * (width - len(rows)) for _, rows in groups]
        self.rows = torch.tensor(padded, device=device)
        self.flat_rows = self.rows.flatten()
        valid = [[1.0] * len(rows) + [0.0] * (width - len(rows)) for _, rows in groups]
        self.valid = torch.tensor(valid, device=device).unsqueeze(-1)
        self.stacks = stacks.of([adapter for adapter, _ in groups])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the fused projection of ``x``) with each adapter's product added in its
        rows; in place."""
        parts = self.stacks.get((layer, site))
        if parts is None:
            return out
        grouped = x[self.rows]
        for (start, end), a, b in parts:
            low = torch.bmm(grouped, a.transpose(1, 2))
            delta = torch.bmm(low, b.transpose(1, 2)).mul_(self.valid.to(low.dtype))
            out[:, start:end].index_add_(0, self.flat_rows, delta.flatten(0, 1).to(out.dtype))
        return out


_current: ContextVar[LoRAStep | None] = ContextVar("pdserve_lora_step", default=None)


@contextmanager
def active(step: LoRAStep | None) -> Iterator[None]:
    """Makes ``step`` the current one for the forward inside."""
    token = _current.set(step)
    try:
        yield
    finally:
        _current.reset(token)


def add_lora(out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
    """``out`` with the current step's adapters' products at ``site`` of ``layer`` added."""
    step = _current.get()
    return out if step is None else step.add(out, x, layer, site)
