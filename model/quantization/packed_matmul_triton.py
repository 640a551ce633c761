"""``x @ W.T`` on the GPU for weights kept at their checkpoint's size: a Triton kernel that
dequantizes a tile of W in registers and multiplies it there (weight-only: activations stay
in the model's dtype), for two formats:

    int4 groups (AWQ, GPTQ)   codes   int32 [ceil(in / 8), out]   nibble n of [r, o]: input 8r + n
                              scales, offsets  float32 [groups, out]   w = scale * code + offset
    fp8 (DeepSeek-V3, Qwen3-FP8, compressed-tensors)
                              bytes   uint8 [out, in]   float8_e4m3fn bits
                              scales  float32 [out, ceil(in / bi)]   w = fp8 * scale
                                      a scale per row and block of bi inputs: every
                                      granularity a checkpoint ships (``fp8_weight.py``)

    grid (rows of x / BLOCK_M, out / BLOCK_N)      program: y[BLOCK_M, BLOCK_N] in float32,
      for each BLOCK_K inputs: x tile [BLOCK_M, BLOCK_K] . W tile dequantized [BLOCK_K, BLOCK_N]

The format is a compile-time switch of how a tile is dequantized; the rest is shared.

Why weight-only and not ``torch._scaled_mm`` for fp8: that multiplies fp8 activations too
(a rounding of x to 3 mantissa bits the model was not evaluated with), needs fp8 tensor
cores (sm89+), and takes per-tensor or per-row scales, not DeepSeek-V3's 128 x 128 blocks.
Here the tile is widened to the model's dtype, so a bfloat16 model multiplies on the tensor
cores and a float32 one in IEEE float32 (never TF32), and the result equals
``x @ dequantize().T`` but for the order of the sums. fp8 bits are decoded with integer
operations, not Triton's ``float8e4nv`` type, which older GPUs (sm < 89) do not compile.
Triton's interpreter (3.9) computes a 16-bit ``tl.dot`` wrong, so there a 16-bit tile is
widened after its rounding and multiplied in float32: the same products, exact in float32.

Checked here by Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors:
``tests/model/test_packed_matmul_triton.py``) and on a GPU by ``tests/gpu/``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

BLOCK_M = 16  # tl.dot's least: a decode step's few rows are padded to it
BLOCK_N = 64
BLOCK_K = 64


def interpreted() -> bool:
    """Whether Triton runs kernels on the CPU, in its interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def builds_gpu_formats(device_type: str) -> bool:
    """Whether the loader builds the GPU's packed formats (``grouped_int4_weight.py``,
    ``fp8_weight.py``) for a ``device_type`` worker: on CUDA, and on the CPU under the
    interpreter, where the GPU path runs end to end in tests."""
    return device_type == "cuda" or interpreted()


def serves(x: torch.Tensor) -> bool:
    """Whether these kernels take ``x``: a CUDA tensor where Triton imports, or any under the
    interpreter."""
    if not (x.is_cuda or interpreted()):
        return False
    try:
        _kernel()
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, defined on first use: Triton is imported only where it runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def packed_matmul(  # type: ignore[no-untyped-def]
        x, weight, scales, offsets, y, rows, outs, inputs, x_row, group_in, scale_row,
        FP8: tl.constexpr, IEEE: tl.constexpr, NARROW_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, inputs, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x_tile = tl.load(
                x + m[:, None] * x_row + k[None, :],
                mask=(m[:, None] < rows) & (k[None, :] < inputs),
                other=0.0,
            )
            inside = (k[:, None] < inputs) & (n[None, :] < outs)
            if FP8:  # weight: the bytes [out, in]; a scale per row and group_in inputs
                bits = tl.load(weight + n[None, :] * inputs + k[:, None], mask=inside, other=0)
                bits = bits.to(tl.int32)
                # float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
                # is subnormal (mantissa * 2^-9). A normal one's float32 bits: rebased.
                exponent = (bits >> 3) & 15
                mantissa = bits & 7
                sign = (bits >> 7) << 31
                normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(
                    tl.float32, bitcast=True
                )
                subnormal = tl.where(sign != 0, -1.0, 1.0) * mantissa.to(tl.float32) * 0.001953125
                scale = tl.load(
                    scales + n[None, :] * scale_row + k[:, None] // group_in,
                    mask=inside,
                    other=0.0,
                )
                tile = tl.where(exponent == 0, subnormal, normal) * scale
            else:  # weight: the int4 codes [ceil(in / 8), out]; a scale per group_in inputs
                packed = tl.load(
                    weight + (k[:, None] // 8) * outs + n[None, :], mask=inside, other=0
                )
                code = (packed >> ((k[:, None] % 8) * 4)) & 15
                group = (k // group_in)[:, None] * outs + n[None, :]
                scale = tl.load(scales + group, mask=inside, other=0.0)
                offset = tl.load(offsets + group, mask=inside, other=0.0)
                tile = code.to(tl.float32) * scale + offset
            if IEEE:  # a float32 model: float32 products, never TF32
                acc = tl.dot(x_tile, tile, acc, input_precision="ieee")
            elif NARROW_DOT:
                acc = tl.dot(x_tile, tile.to(x_tile.dtype), acc)
            else:  # the interpreter: the same products, widened after the rounding
                narrow = tile.to(x_tile.dtype).to(tl.float32)
                acc = tl.dot(x_tile.to(tl.float32), narrow, acc, input_precision="ieee")
        tl.store(
            y + m[:, None] * outs + n[None, :], acc, mask=(m[:, None] < rows) & (n[None, :] < outs)
        )

    return packed_matmul


def _launch(
    x: torch.Tensor,
    outs: int,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_in: int,
    scale_row: int,
    fp8: bool,
) -> torch.Tensor:
    """``x @ W.T`` for the format ``fp8`` names (module doc), in x's dtype."""
    x = x.contiguous()
    rows, inputs = x.shape
    y = torch.empty(rows, outs, dtype=torch.float32, device=x.device)
    grid = (-(-rows // BLOCK_M), -(-outs // BLOCK_N))
    _kernel()[grid](
        x, weight, scales, offsets, y, rows, outs, inputs, x.stride(0), group_in, scale_row,
        FP8=fp8, IEEE=x.dtype == torch.float32, NARROW_DOT=not interpreted(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y.to(x.dtype)


def int4_groups_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """``x`` ``[rows, in]`` by the int4 groups' weight (module doc): ``[rows, out]`` in x's
    dtype. Call only where ``serves(x)``."""
    outs = codes.shape[1]
    return _launch(x, outs, codes, scales, offsets, group_size, outs, fp8=False)


def fp8_rows_matmul(
    x: torch.Tensor, weight_bits: torch.Tensor, scales: torch.Tensor, block_in: int
) -> torch.Tensor:
    """``x`` ``[rows, in]`` by the fp8 weight (its bytes ``[out, in]`` as uint8) and its
    ``scales`` ``[out, ceil(in / block_in)]`` (module doc): ``[rows, out]`` in x's dtype.
    Call only where ``serves(x)``."""
    return _launch(
        x, weight_bits.shape[0], weight_bits, scales, scales, block_in, scales.stride(0), fp8=True
    )
