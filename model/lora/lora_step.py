"""One step's LoRA rows: which rows run which adapter, and the low-rank products added to the
fused projections' outputs, every adapter of the step at once.

Rows of different adapters (and none) share one step: the base matmul runs once over all of
them, then the step's adapters multiply their own rows in batched matmuls. Each adapter's
rows are gathered into a padded group (by row index: the weights are read once an adapter,
not gathered per token); a site's parts (q_proj's, k_proj's, ... of a fused projection)
share its input, so their A are side by side and one matmul gives every part's low-rank
product; each part's B then makes its columns::

    groups    [adapters, m]  (padded where adapters have unequal rows, or the base model has
                              rows: a padded slot repeats a row, its input is zeroed)
    x[groups] [adapters, m, in]    @ A_site^T [adapters, in, r_q + r_k + r_v] -> low
    low[.., r_q's range]           @ B_q^T    [adapters, r_q, out_q]          -> delta
    out[:, q's columns] += delta[slot of each step row]   (a base row: a zeroed slot)

``r`` is the largest rank of the part among the step's adapters (smaller ones zero-padded);
an adapter without the part adds zeros. (One block-diagonal B per site would need fewer
matmuls but reads three times q/k/v's bytes; one matmul over all rows with every adapter's A
side by side does the adapters' count times the arithmetic, slower at 16 rows.) The stacks
depend only on which adapters a step runs, so they are built once per set and kept
(``LoRAStacks``): a decode batch's steps share them. With one small matmul per adapter and
part, smollm2's step at batch 16 over 4 adapters took 1.69x the base's.

The model runner makes a step's ``LoRAStep`` current (``active``) around its forward; the
layers add their sites' products where one is (``add_lora``). Without one the forward is the
base model's, untouched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from pdserve.model.lora import lora_kernel
from pdserve.model.lora.peft_adapter import TARGETS, LoRAAdapter


@dataclass(frozen=True, slots=True)
class SiteStack:
    """One site of a layer for every adapter of a set: the parts' A, transposed and side by
    side along the rank, and each part's B (transposed) with its columns of the fused output
    and its ranks' range in ``a_t``."""

    a_t: torch.Tensor
    """``[adapters, in, r_1 + r_2 + ...]``."""
    parts: tuple[tuple[tuple[int, int], tuple[int, int], torch.Tensor], ...]
    """Per part: (columns, ranks, ``B^T`` ``[adapters, r, out]``)."""
    parts_table: torch.Tensor
    """The parts as the CPU kernel reads them (``lora_kernel.add_site``)."""


Stacks = dict[tuple[int, str], SiteStack]
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
        a_parts, parts, rank_start = [], [], 0
        for target in targets:
            present = [parts_of.get(target) for parts_of in by_target]
            some = next(part for part in present if part is not None)
            rank = max(part.a.shape[0] for part in present if part is not None)
            a_t = some.a.new_zeros(len(adapters), some.a.shape[1], rank)
            b_t = some.b.new_zeros(len(adapters), rank, some.b.shape[0])
            for index, part in enumerate(present):
                if part is not None:
                    a_t[index, :, : part.a.shape[0]] = part.a.T
                    b_t[index, : part.b.shape[1]] = part.b.T
            a_parts.append(a_t)
            parts.append((some.columns, (rank_start, rank_start + rank), b_t))
            rank_start += rank
        table = [[*columns, *ranks, b_t.data_ptr()] for columns, ranks, b_t in parts]
        # Zero ranks up to a multiple of 16: the CPU kernel sums 16 ranks a register.
        a_parts.append(a_parts[0].new_zeros(len(adapters), a_parts[0].shape[1], -rank_start % 16))
        stacks[key] = SiteStack(
            torch.cat(a_parts, dim=2).contiguous(),
            tuple(parts),
            torch.tensor(table, dtype=torch.int64),
        )
    return stacks


class LoRAStep:
    """The step's rows of each adapter, padded into groups, and the adapters' stacks."""

    def __init__(
        self,
        groups: list[tuple[LoRAAdapter, list[int]]],
        num_rows: int,
        stacks: LoRAStacks,
        device: torch.device,
    ) -> None:
        """``groups``: each adapter the step runs and its rows (indices into the step's
        ``num_rows`` tokens)."""
        num_adapter_rows = sum(len(rows) for _, rows in groups)
        width = max(len(rows) for _, rows in groups)
        if num_adapter_rows < num_rows and width * len(groups) == num_adapter_rows:
            width += 1  # a padded slot, whose product is 0, for the base model's rows
        padded = [rows + [rows[0]] * (width - len(rows)) for _, rows in groups]
        # The CPU kernel's groups: the rows, -1 where padded (it skips those).
        self.groups = torch.tensor([rows + [-1] * (width - len(rows)) for _, rows in groups])
        self.shape = (len(groups), width)
        self.flat_rows = torch.tensor(padded, device=device).flatten()
        self.valid = None  # padded slots repeat a row: their input is zeroed
        if width * len(groups) > num_adapter_rows:
            valid = [[1.0] * len(rows) + [0.0] * (width - len(rows)) for _, rows in groups]
            self.valid = torch.tensor(valid, device=device).unsqueeze(-1)
        # Each step row's slot in the flattened groups; a base model's row: a padded one.
        zero_slot = next(
            (g * width + len(rows) for g, (_, rows) in enumerate(groups) if len(rows) < width), 0
        )
        slot_of_row = [zero_slot] * num_rows
        for g, (_, rows) in enumerate(groups):
            for slot, row in enumerate(rows):
                slot_of_row[row] = g * width + slot
        self.slot_of_row = torch.tensor(slot_of_row, device=device)
        self.stacks = stacks.of([adapter for adapter, _ in groups])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the fused projection of ``x``) with each adapter's product added in its
        rows; in place."""
        stack = self.stacks.get((layer, site))
        if stack is None:
            return out
        if lora_kernel.serves(x, out, self.shape[1]):
            lora_kernel.add_site(out, x, self.groups, stack.a_t, stack.parts_table)
            return out
        grouped = x.index_select(0, self.flat_rows).view(*self.shape, x.shape[1])
        if self.valid is not None:
            grouped.mul_(self.valid.to(grouped.dtype))
        low = torch.bmm(grouped, stack.a_t)
        for (start, end), (r0, r1), b_t in stack.parts:
            delta = torch.bmm(low[:, :, r0:r1], b_t).view(-1, end - start)
            out[:, start:end].add_(delta.index_select(0, self.slot_of_row))
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
