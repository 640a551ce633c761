"""A C++ kernel that multiplies float32 activations by int8 weights with one scale per row
(``int8_channels.py``) in integer dot products, on CPUs with AVX-512 VNNI.

Why: torch's ``_weight_int8pack_mm`` widens every weight to float and takes bfloat16
activations (float32 ones take a path 10x slower), so an int8 model was compute-bound at a
quarter of float32's bytes: smollm2 with ``--quantization int8`` decoded 2.2x faster than
float32 at batch 1, where the bytes allow 4x. Here ``vpdpbusd`` multiplies 64 codes by 64
activation bytes an instruction, without widening the codes.

Each row of x is rounded to 16 bits (``x_k ~ e A_k``, ``e = max |x_m| / (127 * 254)``,
nearest), held as two int8 digits ``A = 254 A_1 + A_0`` as the int4 dot kernel does
(``int4_tiles_kernel.py`` says why two digits and not llama.cpp's one), and the integer dot
``sum_k A_k c_k`` is exact. So, per output: ``|y - x @ dequantize().T| <= (max |x_m| /
64516) * sum_k |s c_k|`` plus float32's rounding of the final product; one step per row, not
per group of 32 as the int4 kernel, because a row has one scale: the bound is still 254x
finer than bfloat16 activations' (``tests/model/test_quantized_weight.py`` checks it).

Serves float32 rows on CPUs with AVX-512 VNNI and BW where it is built (``-march=native``,
``model/native_build.py``); elsewhere torch's kernel serves, after one warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native"]
_NEEDED = ("avx512_vnni", "avx512bw")


def _unsupported() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set(cpuinfo.read().split())
    except OSError:
        return "cannot read this CPU's flags (/proc/cpuinfo)"
    missing = [flag for flag in _NEEDED if flag not in flags]
    return f"needs {' and '.join(missing)}, which this CPU lacks" if missing else None


_kernel = native_build.LazyExtension(
    "the int8 rows kernel",
    "pdserve_int8_rows",
    _SOURCE,
    _FLAGS,
    "int8 weights multiply with torch's kernel, bfloat16 activations",
    logger,
    _unsupported,
)


build = _kernel.get
"""The kernel, built (or loaded from the cache) on first call; None when it cannot be built
or loaded here, after one warning saying why."""


def int8_rows_dot(
    x: torch.Tensor, codes: torch.Tensor, sums: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` by int8 ``codes`` ``[N, P]`` (zero past ``K``), their rows'
    ``sums`` (int32) and ``scales`` (float32): ``[M, N]``. Call only where ``build()``."""
    kernel = build()
    assert kernel is not None, "int8_rows_dot called where the kernel is not built"
    return kernel.int8_rows_dot(x, codes, sums, scales)


if __name__ == "__main__":  # build it now, not at the first matmul
    _kernel.build_now()
