"""A C++ kernel that multiplies float32 activations by 4-bit planes held in torch's int4 CPU
layout (``int4_planes.py``), two ways, reading the same bytes (the weight is packed once):

- **exact** (``int4_tiles_mm``): the codes widened to float32 in registers, every operation
  in float32: per group of 32 inputs ``S sum x q + Z sum x``, which differs from
  ``x @ dequantize().T`` by float32's rounding of the sums (a few ulp of ``sum |x| (16 |S| +
  |Z|)``). Why not torch's ``_weight_int4pack_mm_for_cpu``: it is fast only with bfloat16
  activations, and 11x slower than float32's ``mm`` with float32 ones.
- **integer dot** (``int4_tiles_dot``, where the CPU has AVX-512 VNNI and VBMI): x rounded to
  16 bits per group of 32 (``x_k ~ e A_k``, ``e = max |x_g| / (127 * 254)``, nearest), held
  as two int8 digits ``A = 254 A_1 + A_0``; the codes multiplied by each digit in int32
  (``vpdpbusd``: 64 products an instruction against 16 float ones, no widening of the
  codes), then ``S e (254 sum A_1 q + sum A_0 q) + Z sum x`` with the group's exact float
  sum. Bound, from ``|x_k - e A_k| <= e / 2``: per output, ``|y - x @ dequantize().T| <=
  sum_g (max |x_g| / 64516) sum_{k in g} |s c_k|`` (``s c_k = w_k - Z_g``, the code times
  its scale), plus float32's rounding as above; ``tests/model/test_quantized_weight.py``
  checks it (about a tenth of it is reached on random data).

  Why two digits: with one (int8 activations, as llama.cpp's ``Q8`` blocks) smollm2 decoded
  1.3x faster at batch 1 and matched llama.cpp's speed, but its perplexity on
  ``tests/engine/test_smollm2_packed.py``'s text rose 3.4 % over the dequantized model's
  (its activations have outliers of 8x a group's typical value); the issue asks 1 %. Two
  digits put the rounding 254x finer, far inside bfloat16's, for one more ``vpdpbusd`` a
  quad. Measured on a Zen 5 (one thread, smollm2 decoding, side by side against the exact
  kernel): 0.97x at batch 1 (both stream the same bytes from memory) and 1.4x at batch 16;
  a 512-row prefill chunk multiplies without dequantizing (``int4_planes.py``).

The dot variant serves wherever it is built (``int4_planes.py``'s ``matmul``); the exact one
on CPUs without VNNI and VBMI (AVX2 machines, Skylake-X), and for tiles of 32 rows.

Built once per machine by ``model/native_build.py`` (``-march=native``): it reads both of
torch's tiled layouts, AVX-512's 64 rows a tile and AVX2's 32 (``int4_planes.py``); a CPU
with neither, or a machine without a compiler, serves with torch's kernel after one warning.
``python -m pdserve.model.quantization.int4_tiles_kernel`` builds it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native"]


def _unsupported() -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith(("AVX512", "AVX2")):
        return None
    return f"needs AVX2 or AVX-512, torch dispatches to {capability} here"


_kernel = native_build.LazyExtension(
    "the int4 tiles kernel",
    "pdserve_int4_tiles",
    _SOURCE,
    _FLAGS,
    "packed weights multiply with torch's kernel, bfloat16 activations",
    logger,
    _unsupported,
)


build = _kernel.get
"""The kernel, built (or loaded from the cache) on first call; None when it cannot be built
or loaded here, after one warning saying why."""


def reads_tiles_of(tile_rows: int) -> bool:
    """Whether the kernel is built here and reads tiles of ``tile_rows`` (64 only where it
    was compiled with AVX-512: torch may be told to dispatch to a capability the compiler
    did not target, ``ATEN_CPU_CAPABILITY``)."""
    kernel = build()
    return kernel is not None and tile_rows in kernel.tile_rows


def dots_tiles_of(tile_rows: int) -> bool:
    """Whether the integer-dot variant is built here and reads tiles of ``tile_rows``: it
    needs AVX-512 VNNI and VBMI (a byte permute across the register), and reads 64-row
    tiles only."""
    kernel = build()
    return kernel is not None and tile_rows in kernel.dot_tile_rows


def int4_tiles_mm(x: torch.Tensor, planes: list[torch.Tensor], tile_rows: int) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` by the weight whose planes (``int4_planes.py``: one, or the
    high and the low, read in one pass) are given as ``[packed, scales_zeros, ...]``, packed
    in tiles of ``tile_rows``: ``[M, padded rows]``. Call only where
    ``reads_tiles_of(tile_rows)``."""
    kernel = build()
    assert kernel is not None, "int4_tiles_mm called where the kernel is not built"
    return kernel.int4_tiles_mm(x, planes, tile_rows)


def int4_tiles_dot(x: torch.Tensor, planes: list[torch.Tensor], tile_rows: int) -> torch.Tensor:
    """As ``int4_tiles_mm``, with ``x`` rounded to 16 bits per group of 32 inputs first (module
    doc: the bound). Call only where ``dots_tiles_of(tile_rows)``."""
    kernel = build()
    assert kernel is not None, "int4_tiles_dot called where the kernel is not built"
    return kernel.int4_tiles_dot(x, planes, tile_rows)


if __name__ == "__main__":  # build it now, not at the first matmul
    _kernel.build_now()
