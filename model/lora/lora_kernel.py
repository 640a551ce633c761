"""A LoRA site of a layer for every adapter of a step, on float32 CPU rows: a C++ kernel.

Why: a decode step's LoRA products are skinny (a few rows an adapter, rank 16), and torch's
batched matmul runs them far below the CPU's peak: ~15 us for a 4 x 4 x 576 by 576 x 48
product already in cache, 59 GFLOP/s where a plain 16-row matmul reaches ~90, and each
site costs three to seven of them plus a gather and a scatter of its rows. On smollm2 at
batch 16 over 4 adapters of rank 16 that was ~10 ms a step, a third of the packed base's
step. The kernel does a site in one call: per adapter, its rows times A (every part's A
side by side, so each row of A is read once for all of its rows), then each part's B added
into the part's columns in tiles of 64 summed in registers::

    for each adapter g, its rows R_g (padding skipped):
        low[R_g, :]            = x[R_g, :] @ A_site^T[g]              (in x r_site)
        out[R_g, part's cols] += low[R_g, part's ranks] @ B_part^T[g]  (r_part x cols)

It serves float32 rows of float32 stacks on CPU where it is built (plain pybind11, no torch
headers: a build of seconds, at ``make setup`` or at the first adapter read); anything else
(a GPU, bfloat16, a prompt's many rows, where the batched matmul's arithmetic wins) runs the
batched matmuls (``lora_step.py``), as does every step where it cannot be built (one warning
says so). Its sums run in another order than torch's: float32 rounding, a few ulp.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

MAX_ROWS_PER_ADAPTER = 16
"""Above this many rows of one adapter in a step (a prompt's), the batched matmuls win."""
_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
_kernel = native_build.LazyExtension(
    "the LoRA kernel",
    "pdserve_lora",
    _SOURCE,
    _FLAGS,
    "LoRA products run as torch's batched matmuls",
    logger,
)


build = _kernel.get
"""The kernel, built (or loaded from the cache) on first call; None when it cannot be built
or loaded here, after one warning saying why."""


def serves(x: torch.Tensor, out: torch.Tensor, width: int) -> bool:
    """Whether the kernel takes a site: float32 CPU rows (each contiguous) into a float32
    CPU output, at most ``MAX_ROWS_PER_ADAPTER`` rows an adapter; and the kernel built."""
    return (
        width <= MAX_ROWS_PER_ADAPTER
        and x.is_cpu
        and x.dtype == torch.float32
        and out.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and out.stride(1) == 1
        and _kernel.get() is not None
    )


def add_site(
    out: torch.Tensor,
    x: torch.Tensor,
    groups: torch.Tensor,
    a_t: torch.Tensor,
    parts: torch.Tensor,
) -> None:
    """Adds a site's products into ``out`` (module doc); call only where ``serves``.

    ``groups``: int64 ``[adapters, width]`` row indices, -1 where padded; ``a_t``: float32
    ``[adapters, in, rank]`` contiguous; ``parts``: int64 ``[parts, 5]`` rows of (first
    column, end column, first rank, end rank, address of a contiguous float32 ``B^T``
    ``[adapters, part rank, columns]`` the caller keeps alive)."""
    kernel = build()
    assert kernel is not None, "add_site called where serves() is False"
    if a_t.shape[1] != x.shape[1] or a_t.shape[0] != groups.shape[0]:
        raise ValueError(f"A {list(a_t.shape)} does not fit rows {list(x.shape)}")
    kernel.lora_site(
        x.data_ptr(),
        x.stride(0),
        x.shape[1],
        groups.data_ptr(),
        groups.shape[0],
        groups.shape[1],
        a_t.data_ptr(),
        a_t.shape[2],
        parts.data_ptr(),
        parts.shape[0],
        out.data_ptr(),
        out.stride(0),
    )


if __name__ == "__main__":  # build it now, not at the first adapter
    _kernel.build_now()
