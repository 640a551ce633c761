"""A C++ kernel that multiplies float32 activations by a 4-bit plane held in torch's int4 CPU
layout (``int4_planes.py``), widening the weights in registers: exact to float32 where
torch's own kernel takes only bfloat16 activations.

Why: torch's ``_weight_int4pack_mm_for_cpu`` is fast only with bfloat16 activations (2^-8
relative a product), and 11x slower than float32's ``mm`` with float32 ones. This kernel
reads the same bytes (so the weight is packed once, for both) and keeps every operation in
float32: per group of 32 inputs ``S sum x q + Z sum x``, which differs from
``x @ dequantize().T`` by float32's rounding of the sums (a few ulp of ``sum |x| (16 |S| +
|Z|)``). The speed it reaches is in ``int4_planes.py``'s docstring.

Built once per machine by ``model/native_build.py`` (``-march=native``): it reads both of
torch's tiled layouts, AVX-512's 64 rows a tile and AVX2's 32 (``int4_planes.py``); a CPU
with neither, or a machine without a compiler, serves with torch's kernel after one warning. ``python -m pdserve.model.quantization.int4_tiles_kernel`` builds it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

import torch

from pdserve.model import native_build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_suffix(".cpp")
_FLAGS = ["-O3", "-march=native"]
_lock = threading.Lock()
_built: ModuleType | None = None
_failed = False


def build() -> ModuleType | None:
    """The kernel, built (or loaded from the cache) on first call; None when it cannot be
    built or loaded here, after one warning saying why."""
    global _built, _failed
    if _built is not None or _failed:  # every matmul asks: no lock then
        return _built
    with _lock:
        if _built is None and not _failed:
            capability = torch.backends.cpu.get_cpu_capability()
            if not capability.startswith(("AVX512", "AVX2")):
                _failed = True
                logger.warning(
                    "the int4 tiles kernel needs AVX2 or AVX-512, torch dispatches to %s "
                    "here; torch's kernel serves",
                    capability,
                )
                return None
            try:
                _built = native_build.load_extension("pdserve_int4_tiles", _SOURCE, _FLAGS)
            except native_build.ExtensionUnavailable as error:
                _failed = True
                logger.warning(
                    "the int4 tiles kernel is not available (%s); packed weights multiply "
                    "with torch's kernel, bfloat16 activations",
                    error,
                )
        return _built


def reads_tiles_of(tile_rows: int) -> bool:
    """Whether the kernel is built here and reads tiles of ``tile_rows`` (64 only where it
    was compiled with AVX-512: torch may be told to dispatch to a capability the compiler
    did not target, ``ATEN_CPU_CAPABILITY``)."""
    kernel = build()
    return kernel is not None and tile_rows in kernel.tile_rows


def int4_tiles_mm(
    x: torch.Tensor, planes: list[tuple[torch.Tensor, torch.Tensor]], tile_rows: int
) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` by the weight whose planes (``int4_planes.py``: one, or the
    high and the low, read in one pass) are given, packed in tiles of ``tile_rows``: ``[M,
    padded rows]``. Call only where ``reads_tiles_of(tile_rows)``."""
    kernel = build()
    assert kernel is not None, "int4_tiles_mm called where the kernel is not built"
    return kernel.int4_tiles_mm(x, [tensor for plane in planes for tensor in plane], tile_rows)


if __name__ == "__main__":  # build it now, not at the first matmul
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if build() is not None:
        logger.info("int4 tiles kernel: built for this CPU")
