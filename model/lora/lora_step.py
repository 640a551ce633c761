"""One step's LoRA rows: which rows run which adapter, and the low-rank products added to the
fused projections' outputs, adapter by adapter.

Rows of different adapters (and none) share one step: the base matmul runs once over all of
them, then each adapter present multiplies its own rows by its site's stacked A (one matmul)
and each part's B, and adds the product into its columns. Grouped by adapter, not a
per-token gather of weights: an adapter's weights are read once a step whatever its row
count::

    out [rows, fused columns]   += for adapter k, rows R_k:
                                     low = x[R_k] @ A_site^T            [|R_k|, sum r]
                                     out[R_k, part columns] += low[:, part ranks] @ B_part^T

The model runner makes a step's ``LoRAStep`` current (``active``) around its forward; the
layers add their sites' products where one is (``add``). Without one the forward is the base
model's, untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from pdserve.model.lora.peft_adapter import LoRAAdapter


class LoRAStep:
    """The step's rows of each adapter (row indices into the step's tokens)."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the fused projection of ``x``) with each adapter's product added in its
        rows; in place."""
        for adapter, rows in self.groups:
            found = adapter.sites.get((layer, site))
            if found is None:
                continue
            low = x[rows] @ found.a.t()
            for part in found.parts:
                start, end = part.ranks
                delta = low[:, start:end] @ part.b.t()
                out[:, part.columns[0] : part.columns[1]].index_add_(0, rows, delta.to(out.dtype))
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
