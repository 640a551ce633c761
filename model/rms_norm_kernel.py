"""RMSNorm of float32 rows on CPU in one pass a row: a small C++ kernel.

Why: torch's CPU ``rms_norm`` is a composite of six operations (``pow``, ``mean``, ``add``,
``rsqrt``, ``mul``, ``mul``), each a dispatch and a pass over the rows. On a decode step's
few rows the dispatches are the cost: ~16 us a call, where the arithmetic takes well under
one, and a Llama layer calls it twice (four times with q/k norms): about 1 ms of each
~9 ms token of smollm2 packed (``bench/bench_packed_decode.py``). The kernel reads each row
twice (its squares, then the scaled row), in transformers' order of operations::

    out = (x * rsqrt(mean(x^2) + eps)) * (weight + offset)     offset: Gemma's 1, else 0

Rows may be a view (the q/k heads of a fused qkv: ``[tokens, heads, head_dim]`` at the
projection's strides); the output is ``empty_like`` theirs (contiguous for such a view). It serves float32 rows of a float32 weight
on CPU where it is built (plain pybind11, no torch headers: a build of seconds, done by
``make setup``); anything else keeps torch's operations (``layers.py``'s ``RMSNorm``), as
does every row where it cannot be built (one warning says so). Its sum of squares is summed
16 lanes at a time, so it differs from torch's by float32 rounding, a few ulp.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
_kernel = native_build.LazyExtension(
    "the RMSNorm kernel",
    "pdserve_rms_norm",
    _SOURCE,
    _FLAGS,
    "RMSNorm runs as torch's operations",
    logger,
)


build = _kernel.get
"""The kernel, built (or loaded from the cache) on first call; None when it cannot be built
or loaded here, after one warning saying why."""


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: float32 rows on CPU, each contiguous, in at most two
    strided dimensions, normed by a contiguous float32 weight; and the kernel built."""
    return (  # asked at every norm: the cheapest checks (~0.1 us each) only
        x.is_cpu
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and 1 <= x.dim() <= 3
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and _kernel.get() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``x``'s rows normed (module doc), contiguous; call only where ``serves``."""
    kernel = build()
    assert kernel is not None, "rms_norm called where serves() is False"
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"an RMSNorm of width {weight.shape[0]} given rows of {x.shape[-1]}")
    out = torch.empty_like(x)  # 0.7 us; torch.empty(shape) parses its arguments for 1.6
    shape, strides = [1, 1, *x.shape][-3:], [0, 0, *x.stride()][-3:]
    out_strides = [0, 0, *out.stride()][-3:]
    kernel.rms_norm(
        x.data_ptr(),
        shape[0],
        shape[1],
        shape[2],
        strides[0],
        strides[1],
        out.data_ptr(),
        out_strides[0],
        out_strides[1],
        weight.data_ptr(),
        offset,
        eps,
    )
    return out


if __name__ == "__main__":  # build it now, not at the first norm
    _kernel.build_now()
