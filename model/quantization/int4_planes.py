"""Weights of up to 8 bits in groups of 32 with a scale and an offset, held as 4-bit planes
in the layout of torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``), one repack at load.

Every GGUF type this runs (``gguf_blocks.py``) is affine in groups of 32 along the input:
``w = scale_g * code + offset_g``, with codes of 4, 5 or 8 bits. Each 4-bit plane holds
``nibble * S + Z`` (S, Z float16 per group and row), so a code of up to 4 bits is one plane
and a wider one two, whose sum is the weight::

    4 bits  plane:  S = s,       Z = offset                        (nibble = code)
    5-8     high:   S = 16 s,    Z = offset                        (nibble = code >> 4)
            low:    S = s,       Z = 0                             (nibble = code & 15)

float16, not bfloat16 (torch's kernel's dtype), because the file's own scales and offsets
are float16 fields: ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1`` and ``Q8_0`` are held exactly
(``16 s`` and the symmetric offsets ``-8 s``, ``-16 s``, ``-128 s`` are exact too), and
``dequantize`` returns the file's values. K-types' ``s = d * sc`` and ``offset = -dmin * m``
(float16 times a 6-bit factor) round to float16: ``2^-11`` relative. Rounding the scales to
bfloat16 instead (``2^-8``) moved enough logits to change smollm2's greedy answers (its
capital of France stopped being Paris). Bytes: 4 bits a weight a plane, plus 4 bytes (S, Z)
per 32 weights a plane: Q4_* and Q4_K 5 bits a weight, Q5_*, Q5_K and Q8_0 10 bits. Torch's
kernel reads ``(nibble - 8) S + Z`` in bfloat16: the bfloat16 path converts once, on first
use.

Three paths, chosen by the number of rows of ``x`` and its dtype (measured on this CPU, a
Sapphire Rapids with AMX, one thread, the weights of 30 layers streamed from memory as in a
decode step: ``bench/bench_quantized_matmul.py``, whose docstring has the table):

- **few float32 rows** (below ``dequantize_plan()``'s count): our C++ kernel (``int4_tiles_kernel.py``)
  over the very same bytes. Where the CPU has AVX-512 VNNI and VBMI, its integer-dot
  variant: x rounded to 16 bits per group of 32, held as two int8 digits (the bound is in
  that module's docstring; far inside bfloat16's). Elsewhere, weights widened to float32 in registers: exact to float32
  (within 1e-4 relative of ``x @ dequantize().T``; ~1e-7 measured) and, for Q4_1 at 576 ->
  3072, 6.2x float32's ``mm`` at 1 row, 2.8x at 16 (1536 -> 576: 4.6x, 1.5x).
- **few bfloat16 rows**, or float32 ones where the kernel cannot be built: torch's int4
  kernel (4.6x and 1.9x at 576 -> 3072). It takes bfloat16 activations, scales and zeros only:
  float32 activations take a scalar path 11x *slower* than float32's ``mm``.
- **many rows** (a prefill chunk), where the integer-dot variant is not built (it serves
  every row count: at 512 rows it is 6x float32's ``mm`` on a Zen 5, where dequantizing
  first is 0.9x): both other kernels are about 2x slower than float32's ``mm`` at
  512 rows, while dequantizing the whole matrix once (float32, a few passes in torch) and
  multiplying in bfloat16 (oneDNN on AMX tiles: 7x float32's ``mm``) is 1.5-1.9x faster than
  float32 for 4-bit types, 1.1x for two planes (the dequantization dominates).

Without AMX (an AVX2 AMD EPYC: no AMX, no AVX-512) bfloat16 multiplies no faster than
float32, our AVX2 kernel is 1.2-1.4x float32's ``mm`` at one row and even at 16, and it still
beats dequantizing (a few ms a matrix in torch) at 128 rows (10 against 19 ms at 576 ->
3072), not at 512 (45 against 36): there the many-rows path starts at 256 rows and stays in
float32 (``dequantize_plan``).

The bfloat16 paths round the activations (unit roundoff ``u = 2^-8``) and accumulate in
float32; the many-rows path rounds the weights to bfloat16 too, torch's kernel its scales,
zeros and output.
So ``|y - x @ dequantize().T| <= 2^-6 * sum_k |x_k| |w_k|`` (2u for the product's two
operands, u for the output, with room), which ``tests/model/test_quantized_weight.py``
checks. llama.cpp itself rounds activations to 8 bits a block: coarser.

torch's packing (read back by ``embedding_rows``, ``take_rows``): rows in tiles of T, each
tile ``[in, T / 2]`` bytes, byte ``[k, j]`` holding two rows of the tile at input k. Which
two depends on the CPU capability ATen dispatches to::

    AVX-512  T = 64:  row 64t + j        (bits 0-3)  |  row 64t + 32 + j   (bits 4-7)
    AVX2     T = 32:  row 32t + j                    |  row 32t + 16 + j
    default  T = 32:  row 32t + 16(j // 8) + 2(j % 8) |  that row + 1

The layout is ATen's, not an API, so it is probed once (``torch_int4_layout``), not
assumed: a layout read as another's multiplies right (torch's kernel reads its own) but
fuses, looks up and dequantizes wrong rows. Our C++ kernel reads the AVX-512 and the AVX2
ones (``halves_tile``).
"""

from __future__ import annotations

import functools

import torch

from pdserve.model.quantization import int4_tiles_kernel
from pdserve.model.quantization.quantized_weight import QuantizedWeight

GROUP = 32  # inputs per scale and offset


@functools.cache
def dequantize_plan() -> tuple[int, torch.dtype]:
    """From how many rows of x a packed weight is dequantized whole and multiplied, and in
    which dtype (module doc: measured crossovers): with AMX from 24 rows in bfloat16,
    without it from 256 in float32."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            amx = "amx_bf16" in cpuinfo.read().split()
    except OSError:
        amx = False
    return (24, torch.bfloat16) if amx else (256, torch.float32)


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
        # As the kernel takes them, flattened once: every decode step multiplies each weight.
        self.kernel_planes = [tensor for plane in planes for tensor in plane]
        self.padded_rows = planes[0][0].shape[0]
        self._bfloat16_planes: list[tuple[torch.Tensor, torch.Tensor]] | None = None

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
        zero = -offset * scale if isinstance(offset, int) else offset
        if bits <= 4:
            planes = [_pack(codes, scale, zero)]
        else:
            planes = [  # the whole zero in the low plane: the dot kernel reads its pairs only
                _pack(codes >> 4, 16 * scale, torch.zeros_like(scale)),
                _pack(codes & 15, scale, zero),
            ]
        return cls(scheme, rows, columns, planes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        tile = halves_tile()
        if x.dtype == torch.float32 and tile and int4_tiles_kernel.dots_tiles_of(tile):
            dotted = int4_tiles_kernel.int4_tiles_dot(x.contiguous(), self.kernel_planes, tile)
            return (
                dotted if self.padded_rows == self.out_features else dotted[:, : self.out_features]
            )
        rows, dtype = dequantize_plan()
        if x.shape[0] >= rows:
            return torch.mm(x.to(dtype), self.dequantize().to(dtype).t()).to(x.dtype)
        if x.dtype == torch.float32 and tile and int4_tiles_kernel.reads_tiles_of(tile):
            exact = int4_tiles_kernel.int4_tiles_mm(x.contiguous(), self.kernel_planes, tile)
            return exact[:, : self.out_features]
        activations = x.to(torch.bfloat16).contiguous()
        out: torch.Tensor | None = None
        for packed, scales_zeros in self._torch_planes():
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                activations, packed, GROUP, scales_zeros
            ).float()
            out = part if out is None else out.add_(part)
        assert out is not None
        return out[:, : self.out_features].to(x.dtype)

    def _torch_planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The planes as torch's kernel reads them, ``(nibble - 8) S + (Z + 8 S)`` in
        bfloat16, converted once on first use (only a model run with bfloat16 activations,
        or without the C++ kernel, asks)."""
        if self._bfloat16_planes is None:
            self._bfloat16_planes = list(
                zip(
                    (packed for packed, _ in self.planes),
                    _torch_scales_zeros([scales_zeros for _, scales_zeros in self.planes]),
                    strict=True,
                )
            )
        return self._bfloat16_planes

    def dequantize(self) -> torch.Tensor:
        weight = torch.zeros(self.out_features, self.in_features)
        for packed, scales_zeros in self.planes:
            groups = _all_nibbles(packed, self.in_features)[: self.out_features]
            groups = groups.view(self.out_features, -1, GROUP).float()
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
            rows += nibbles * scale + zero
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

    def take_columns(self, start: int, end: int) -> Int4PlanesWeight:
        """Whole groups only: ``start`` and ``end`` multiples of 32 (a rank's heads or
        intermediate features always are, in the models served)."""
        if start % GROUP or end % GROUP:
            raise ValueError(
                f"{self.scheme} splits its inputs only at multiples of {GROUP}, not "
                f"[{start}, {end}): use --quantization none for this tensor parallel size"
            )
        planes = [
            _repack(
                _all_nibbles(packed, self.in_features)[:, start:end],
                scales_zeros[start // GROUP : end // GROUP],
            )
            for packed, scales_zeros in self.planes
        ]
        return Int4PlanesWeight(self.scheme, self.out_features, end - start, planes)

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
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.float16)
    if not torch.isfinite(scales_zeros).all():
        raise ValueError("a scale or zero past float16's range (65504)")
    return _repack(nibbles, scales_zeros)


def _torch_scales_zeros(planes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each plane's float16 ``(S, Z)`` as torch's kernel takes them: bfloat16 ``(S', Z')`` of
    ``(nibble - 8) S' + Z'``. The group's ``s`` (the low plane's S) rounds to ``s_b`` and its
    offset (the planes' Z summed) scales by ``s_b / s`` with it, so every weight of a group
    moves by the one factor ``s_b / s`` (``2^-9``) and only the offset rounds besides. With two
    planes the offset joins the plane whose zero it rounds least on (per group): a symmetric
    type's stays exact, ``Q8_0``'s on the high one (``128 s_b - 128 s_b = 0``), ``Q5_0``'s on
    the low one (``8 s_b - 16 s_b``)."""
    scale = planes[-1][..., 0].float()
    offset = sum(plane[..., 1].float() for plane in planes)
    rounded = scale.to(torch.bfloat16).float()
    factor = torch.where(scale == 0, 1.0, rounded / torch.where(scale == 0, 1.0, scale))
    offset = offset * factor
    if len(planes) == 1:
        return [_bfloat16_pair(rounded, 8 * rounded + offset)]
    high_zero, low_zero = 128 * rounded + offset, 8 * rounded + offset
    on_high = _bfloat16_error(high_zero) <= _bfloat16_error(low_zero)
    return [
        _bfloat16_pair(16 * rounded, torch.where(on_high, high_zero, 128 * rounded)),
        _bfloat16_pair(rounded, torch.where(on_high, 8 * rounded, low_zero)),
    ]


def _bfloat16_error(values: torch.Tensor) -> torch.Tensor:
    return (values.to(torch.bfloat16).float() - values).abs()


def _bfloat16_pair(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()


def _repack(nibbles: torch.Tensor, scales_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's operands for ``nibbles`` ``[rows, in]`` and their scales and zeros
    ``[in / 32, rows, 2]``, rows padded to a whole tile (with zero weights)."""
    rows = nibbles.shape[0]
    padding = -rows % torch_int4_layout().shape[0]
    if padding:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(padding, nibbles.shape[1])])
        scales_zeros = torch.cat(
            [scales_zeros, scales_zeros.new_zeros(scales_zeros.shape[0], padding, 2)], dim=1
        )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    return packed, scales_zeros.contiguous()


@functools.cache
def torch_int4_layout() -> torch.Tensor:
    """Where torch's int4 CPU packing puts each row of a tile: ``place`` ``[T]``, row ``r``
    of a tile at place ``place[r]`` of each input's ``T / 2`` bytes (place ``2 j`` is byte
    j's low nibble, ``2 j + 1`` its high one). Probed by packing rows whose nibbles spell
    their own index (module doc)."""
    rows, inputs = 128, 32
    index = torch.arange(rows).unsqueeze(1).expand(rows, inputs)
    row_at = _nibble_stream(index // 16) * 16 + _nibble_stream(index % 16)
    for tile in (64, 32):
        places = row_at.view(rows // tile, inputs, tile)  # [tile t, input k, place]
        layout = places[0, 0]
        tile_starts = tile * torch.arange(rows // tile).view(-1, 1, 1)
        if sorted(layout.tolist()) == list(range(tile)) and torch.equal(
            places, (layout + tile_starts).expand_as(places)
        ):
            return torch.argsort(layout)
    capability = torch.backends.cpu.get_cpu_capability()
    raise RuntimeError(
        f"torch's int4 CPU packing on {capability} has a layout pdserve does not read: "
        "use --quantization none"
    )


@functools.cache
def halves_tile() -> int | None:
    """T where torch's layout is one our C++ kernel reads (byte j: rows j and T/2 + j; the
    AVX-512 and AVX2 ones, module doc), else None."""
    place = torch_int4_layout()
    tile = place.shape[0]
    rows = torch.arange(tile)
    halves = torch.where(rows < tile // 2, 2 * rows, 2 * (rows - tile // 2) + 1)
    return tile if torch.equal(place, halves) else None


def _nibble_stream(nibbles: torch.Tensor) -> torch.Tensor:
    """torch's packing of ``nibbles`` as the sequence of its nibbles, low before high."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten().long()


def _nibbles(packed: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows ``rows`` of a packed plane as uint8 nibbles ``[len(rows), in]`` (module doc)."""
    place = torch_int4_layout()
    tile = place.shape[0]
    tiles = packed.view(-1, in_features, tile // 2)
    within = place[rows % tile]
    picked = tiles[rows // tile, :, within // 2]  # [len(rows), in]
    high = (within % 2 == 1).unsqueeze(1)
    return torch.where(high, picked >> 4, picked & 15)


def _all_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Every row of a packed plane as uint8 nibbles ``[padded rows, in]`` (module doc)."""
    place = torch_int4_layout()
    tile = place.shape[0]
    tiles = packed.view(-1, in_features, tile // 2)
    if halves_tile():  # rows j and T/2 + j in byte j: the nibble planes in row order, no gather
        halves = torch.stack([tiles & 15, tiles >> 4], dim=1)  # [tiles, 2, in, T / 2]
        return halves.transpose(2, 3).reshape(-1, in_features)
    places = torch.stack([tiles & 15, tiles >> 4], dim=-1).view(-1, in_features, tile)
    return places[:, :, place].transpose(1, 2).reshape(-1, in_features)
