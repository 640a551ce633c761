"""Weights of up to 8 bits in groups of 32 with a scale and an offset, held as 4-bit planes
in the layout of torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), one repack at load.

Every GGUF type this runs (``gguf_blocks.py``) is affine in groups of 32 along the input:
``w = scale_g * code + offset_g``, with codes of 4, 5 or 8 bits. The kernel multiplies
4-bit planes ``(nibble - 8) * S + Z`` (S, Z bfloat16 per group and row), so a code of up to
4 bits is one plane and a wider one two, whose sum is the weight::

    4 bits  plane:  S = s,       Z = offset + 8 s                  (nibble = code)
    5-8     high:   S = 16 s,    Z = 128 s                         (nibble = code >> 4)
            low:    S = s,       Z = offset + 8 s                  (nibble = code & 15)

``s`` is rounded to bfloat16 first, so ``16 s`` and ``128 s`` are exact: only ``s`` and the
low plane's ``Z`` round (``Q4_0``, ``Q5_0``, ``Q8_0``: ``Z = 0`` or ``-8 s``, exact too), and
``dequantize`` returns the weights with the scales the kernel uses: within ``2^-8 (|code s|
+ |Z|)`` of the file's. Bytes: 4 bits a weight a plane, plus 4 bytes (S, Z) per 32 weights a
plane: Q4_* and Q4_K 5 bits a weight, Q5_*, Q5_K and Q8_0 10 bits.

Three paths, chosen by the number of rows of ``x`` and its dtype (measured on this CPU, a
Sapphire Rapids with AMX, one thread, the weights of 30 layers streamed from memory as in a
decode step: ``bench/bench_quantized_matmul.py``, whose docstring has the table):

- **few float32 rows** (``< DEQUANTIZE_ROWS``): our C++ kernel (``int4_tiles_kernel.py``)
  over the very same bytes, weights widened to float32 in registers: exact to float32
  (within 1e-4 relative of ``x @ dequantize().T``; ~1e-7 measured) and, for Q4_1 at 576 ->
  3072, 6.2x float32's ``mm`` at 1 row, 2.8x at 16 (1536 -> 576: 4.6x, 1.5x).
- **few bfloat16 rows**, or float32 ones where the kernel cannot be built: torch's int4
  kernel (4.6x and 1.9x at 576 -> 3072). It takes bfloat16 activations, scales and zeros only:
  float32 activations take a scalar path 11x *slower* than float32's ``mm``.
- **many rows** (a prefill chunk): both kernels are about 2x slower than float32's ``mm`` at
  512 rows, while dequantizing the whole matrix once (float32, a few passes in torch) and
  multiplying in bfloat16 (oneDNN on AMX tiles: 7x float32's ``mm``) is 1.5-1.9x faster than
  float32 for 4-bit types, 1.1x for two planes (the dequantization dominates).

The bfloat16 paths round the activations (unit roundoff ``u = 2^-8``) and accumulate in
float32; the many-rows path rounds the weights to bfloat16 too, torch's kernel its output.
So ``|y - x @ dequantize().T| <= 2^-6 * sum_k |x_k| |w_k|`` (2u for the product's two
operands, u for the output, with room), which ``tests/model/test_quantized_weight.py``
checks. llama.cpp itself rounds activations to 8 bits a block: coarser.

The kernel's layout (read back by ``embedding_rows``): rows in tiles of 64, each tile
``[in, 32]`` bytes whose low nibble is row ``j`` and high nibble row ``32 + j``::

    tile t:  byte [k, j] = row 64t + j  (bits 0-3)  |  row 64t + 32 + j  (bits 4-7), input k
"""

from __future__ import annotations

import torch

from pdserve.model.quantization import int4_tiles_kernel
from pdserve.model.quantization.quantized_weight import QuantizedWeight

GROUP = 32  # inputs per scale and offset
ROW_TILE = 64  # rows per tile of the kernel's layout
# From this many rows of x, dequantize and multiply in bfloat16 (module doc; the crossover
# measured between 16 and 32 rows).
DEQUANTIZE_ROWS = 24


class Int4PlanesWeight(QuantizedWeight):
    """One or two packed 4-bit planes whose products sum to ``x @ W.T`` (module doc)."""

    def __init__(
        self,
        scheme: str,
        out_features: int,
        in_features: int,
        planes: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """``planes``: (packed uint8 ``[padded rows, in / 2]``, scales and zeros bfloat16
        ``[in / 32, padded rows, 2]``) each, as the kernel takes them."""
        self.scheme = scheme
        self.out_features = out_features
        self.in_features = in_features
        self.planes = planes

    @classmethod
    def from_affine(
        cls,
        scheme: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        offset: torch.Tensor | int,
        bits: int,
    ) -> Int4PlanesWeight:
        """``w = scale * codes + offset`` per group of 32: codes uint8 ``[out, in]`` of
        ``bits`` bits, scale and offset float32 ``[out, in / 32]``; an int offset ``c``
        means ``-c * scale`` (the symmetric types), placed where its zero stays exact."""
        rows, columns = codes.shape
        if columns % GROUP or bits > 8:
            raise ValueError(f"{scheme}: {columns} inputs in groups of {GROUP}, {bits} bits")
        scale = scale.to(torch.bfloat16).float()  # so that 16 s and 128 s are exact
        high_zero, low_zero = 128 * scale, 8 * scale
        if isinstance(offset, int) and offset >= 128:  # Q8_0: -128 s cancels the high zero
            high_zero = (128 - offset) * scale
        else:
            low_zero = low_zero - offset * scale if isinstance(offset, int) else low_zero + offset
        if bits <= 4:
            planes = [_pack(codes, scale, low_zero)]
        else:
            planes = [
                _pack(codes >> 4, 16 * scale, high_zero),
                _pack(codes & 15, scale, low_zero),
            ]
        return cls(scheme, rows, columns, planes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= DEQUANTIZE_ROWS:
            weight = self.dequantize().to(torch.bfloat16)
            return torch.mm(x.to(torch.bfloat16), weight.t()).to(x.dtype)
        if x.dtype == torch.float32 and int4_tiles_kernel.build() is not None:
            exact = int4_tiles_kernel.int4_tiles_mm(x.contiguous(), self.planes)
            return exact[:, : self.out_features]
        activations = x.to(torch.bfloat16).contiguous()
        out: torch.Tensor | None = None
        for packed, scales_zeros in self.planes:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                activations, packed, GROUP, scales_zeros
            ).float()
            out = part if out is None else out.add_(part)
        assert out is not None
        return out[:, : self.out_features].to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        weight = torch.zeros(self.out_features, self.in_features)
        for packed, scales_zeros in self.planes:
            groups = _all_nibbles(packed, self.in_features)[: self.out_features]
            groups = groups.view(self.out_features, -1, GROUP).float().sub_(8)
            scale = scales_zeros[:, : self.out_features, 0].t().float().unsqueeze(2)
            zero = scales_zeros[:, : self.out_features, 1].t().float().unsqueeze(2)
            weight += groups.mul_(scale).add_(zero).view(self.out_features, self.in_features)
        return weight

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(len(ids), self.in_features)
        for packed, scales_zeros in self.planes:
            nibbles = _nibbles(packed, ids, self.in_features).float()
            scale = scales_zeros[:, ids, 0].float().t().repeat_interleave(GROUP, dim=1)
            zero = scales_zeros[:, ids, 1].float().t().repeat_interleave(GROUP, dim=1)
            rows += (nibbles - 8) * scale + zero
        return rows

    def take_rows(self, index: torch.Tensor) -> Int4PlanesWeight:
        return Int4PlanesWeight(
            self.scheme,
            len(index),
            self.in_features,
            [
                _repack(_nibbles(packed, index, self.in_features), scales_zeros[:, index])
                for packed, scales_zeros in self.planes
            ],
        )

    @classmethod
    def concat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        parts = [weight for weight in weights if isinstance(weight, Int4PlanesWeight)]
        if len(parts) != len(weights) or len({len(p.planes) for p in parts}) != 1:
            return None
        planes = []
        for plane in range(len(parts[0].planes)):
            nibbles, scales_zeros = [], []
            for part in parts:
                packed, part_scales = part.planes[plane]
                nibbles.append(_nibbles(packed, torch.arange(part.out_features), part.in_features))
                scales_zeros.append(part_scales[:, : part.out_features])
            planes.append(_repack(torch.cat(nibbles), torch.cat(scales_zeros, dim=1)))
        scheme = "+".join(sorted({part.scheme for part in parts}))
        return Int4PlanesWeight(
            scheme, sum(p.out_features for p in parts), parts[0].in_features, planes
        )

    @property
    def nbytes(self) -> int:
        return sum(packed.nbytes + scales.nbytes for packed, scales in self.planes)


def _pack(
    nibbles: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
    return _repack(nibbles, scales_zeros)


def _repack(nibbles: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's operands for ``nibbles`` ``[rows, in]`` and their scales and zeros
    ``[in / 32, rows, 2]``, rows padded to a whole tile (with zero weights)."""
    rows = nibbles.shape[0]
    padding = -rows % ROW_TILE
    if padding:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(padding, nibbles.shape[1])])
        scales_zeros = torch.cat(
            [scales_zeros, scales_zeros.new_zeros(scales_zeros.shape[0], padding, 2)], dim=1
        )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    return packed, scales_zeros.contiguous()


def _nibbles(packed: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``rows`` of a packed plane as uint8 nibbles ``[len(rows), in]`` (module doc)."""
    tiles = packed.view(-1, in_features, ROW_TILE // 2)
    within = rows % ROW_TILE
    picked = tiles[rows // ROW_TILE, :, within % (ROW_TILE // 2)]  # [len(rows), in]
    high = (within >= ROW_TILE // 2).unsqueeze(1)
    return torch.where(high, picked >> 4, picked & 15)


def _all_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Every row of a packed plane as uint8 nibbles ``[padded rows, in]`` (module doc)."""
    tiles = packed.view(-1, in_features, ROW_TILE // 2)
    halves = torch.stack([tiles & 15, tiles >> 4], dim=1)  # [tiles, 2, in, 32]
    return halves.transpose(2, 3).reshape(-1, in_features)
