"""Decode attention on CPU that reads the KV pages in place: a small C++ kernel, built once
per machine with torch's extension builder.

Why a kernel: torch has no operation that reads rows at arbitrary page ids without copying
them, so the split-KV path (``model/split_kv.py``) gathers each chunk of pages into a buffer
before attending, and that copy costs as much as the attention's own read. Measured on one
thread with smollm2's heads (``bench/bench_flex_attention.py`` runs all three side by side):
the split-KV path took 1.6–3.2x the time of SDPA over a contiguous cache, PyTorch's
FlexAttention over the same pages (a block mask naming them) 3.5–5.9x at 16-token pages;
this kernel takes 1.1–1.2x.

It serves rows of a few queries (a decode's one, a speculative verification's last token
and drafts, each with its own causal limit) of a float32 model, over float32 pages or 16-bit
ones (``kv_cache_dtype``: widened as they are read, so the halved bytes are halved reads);
everything else (prefill chunks, 16-bit models, other devices) keeps the split-KV path, as does every row when the kernel cannot be built (no C++ compiler: a
warning says so once).

The build (≈ 20 s) happens at ``make setup`` (``python -m pdserve.model.paged_decode_kernel``)
or at the first engine start on a machine; later starts load it from the extension cache.
``model/native_build.py`` builds it: once per machine whatever the checkout's path, in a child
that a kill cannot leave holding a lock, waited for at most ``native_build.DEFAULT_TIMEOUT_S``
(then decode takes the torch path, with a warning naming the cause). It is built for the CPU
it runs on (``-march=native``), so the build's name digests the CPU's flags with the source
and compiler flags: a cache shared with another kind of machine never hands it a build it
cannot run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
# -ffast-math lets the compiler vectorize exp (glibc's vector math) and the reductions. It is
# a compile flag only: torch links the module without it, so GCC does not add crtfastmath,
# which would flush denormals to zero in the whole process.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
_PAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # widened to float32 as read
# Rows of more queries (a prefill chunk's) keep the chunks: the kernel scores query by query,
# where SDPA multiplies them as matrices. Measured against the chunks (smollm2's heads): 0.67-
# 0.76x the time at 3-5 queries a row, 0.84-0.93x at 8, 1.01x at 10, 1.19x at 16.
MAX_QUERIES_PER_ROW = 8
_kernel = native_build.LazyExtension(
    "the paged decode kernel",
    "pdserve_paged_decode",
    _SOURCE,
    _FLAGS,
    "decode attention gathers the pages first (model/split_kv.py)",
    logger,
)


build = _kernel.get
"""The kernel, built (or loaded from the cache) on first call; None when it cannot be built
or loaded here, after one warning saying why."""


def serves(query: torch.Tensor, layer_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these decode rows: a float32 query on the CPU (over float32
    or 16-bit pages), and the kernel built."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and layer_cache.dtype in _PAGE_DTYPES
        and query.stride(-1) == 1
        and layer_cache.stride(-1) == 1
        and build() is not None
    )


def paged_decode(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    tables: torch.Tensor,
    row_starts: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """``query`` ``[num_tokens, num_heads, head_size]`` attended over ``layer_cache``
    ``[blocks, entries, block_size, kv_heads, head_size]``: row ``b``'s tokens are
    ``row_starts[b] .. row_starts[b + 1]``, and token ``t`` sees keys ``[low[t], high[t])``
    of its row's pages ``tables[b]`` (counted from its first page). Call only where
    ``serves``."""
    kernel = build()
    assert kernel is not None, "paged_decode called where serves() is False"
    head_size = query.shape[-1]
    return kernel.paged_decode(
        query,
        layer_cache,
        tables,
        row_starts,
        low,
        high,
        head_size**-0.5 if scale is None else scale,
    )


if __name__ == "__main__":  # make setup: build it now, not at the first engine start
    _kernel.build_now()
