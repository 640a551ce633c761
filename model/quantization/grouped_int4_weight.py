"""AWQ and GPTQ int4 weights on the GPU, kept as the checkpoint packs them: eight 4-bit codes
to an int32 along the inputs (GPTQ's own order), a float32 scale and offset per group of
``group_size`` inputs (128 in nearly every checkpoint), multiplied by a Triton kernel that
dequantizes a tile in registers (``packed_matmul_triton.py``)::

    codes    int32 [ceil(in / 8), out]   nibble n of [r, o]: the code of input 8r + n, output o
    scales   float32 [groups, out]        w[o, i] = scales[g, o] * code + offsets[g, o],
    offsets  float32 [groups, out]                  g = i // group_size

4.5 bits a weight at groups of 128 (the checkpoint's own: 4.25, its float16 scales and packed
zeros; an offset ``-scale * zero`` is kept in float32 so that it is exact). On the CPU the
same checkpoints run as int4 planes instead (``int4_planes.py``, torch's CPU layout). 4-bit
codes only: an 8-bit GPTQ is dequantized on a GPU (``--quantization none``).
"""

from __future__ import annotations

import functools

import torch

from pdserve.model.quantization import packed_matmul_triton
from pdserve.model.quantization.int4_checkpoints import AffineGroups
from pdserve.model.quantization.quantized_weight import QuantizedWeight

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@functools.cache
def _shifts_on(device: torch.device) -> torch.Tensor:
    """The nibbles' shifts on ``device``, copied there once: a copy from the host each call
    would stall every step and cannot run inside a CUDA graph's capture."""
    return _SHIFTS.to(device).view(1, 8, 1)


class GroupedInt4Weight(QuantizedWeight):
    """An int4 linear in groups of inputs, for the GPU (module doc)."""

    def __init__(
        self,
        scheme: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        group_size: int,
        in_features: int,
    ) -> None:
        self.scheme = scheme
        self.codes, self.scales, self.offsets = codes, scales, offsets
        self.group_size = group_size
        self.out_features, self.in_features = codes.shape[1], in_features

    @classmethod
    def from_groups(cls, groups: AffineGroups, device: torch.device) -> GroupedInt4Weight:
        """The checkpoint's codes, scales and zeros repacked on ``device``; refused where the
        groups are not runs of inputs (act-order) or the codes are wider than 4 bits."""
        size = groups.group_size()
        if size is None or groups.bits != 4:
            reason = "its act-order groups are not runs of inputs" if size is None else (
                f"its codes have {groups.bits} bits; the GPU kernel reads 4"
            )  # fmt: skip
            raise ValueError(
                f"this {groups.scheme} checkpoint cannot run packed on a GPU: {reason}; "
                "use --quantization none (dequantized)"
            )
        outs, inputs = groups.codes.shape
        padded = torch.nn.functional.pad(groups.codes, (0, -inputs % 8)).to(torch.int32)
        nibbles = padded.t().reshape(-1, 8, outs) << _SHIFTS.view(1, 8, 1)
        codes = nibbles.sum(dim=1, dtype=torch.int32)  # disjoint bits: the sum is their or
        scales = groups.scales.t().contiguous()
        offsets = -(groups.zeros.float().t() * scales)
        return cls(
            groups.scheme,
            codes.contiguous().to(device),
            scales.to(device),
            offsets.contiguous().to(device),
            size,
            inputs,
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if packed_matmul_triton.serves(x):
            return packed_matmul_triton.int4_groups_matmul(
                x, self.codes, self.scales, self.offsets, self.group_size
            )
        return (x.float() @ self.dequantize().t()).to(x.dtype)

    def _codes_of(self, columns: torch.Tensor) -> torch.Tensor:
        """The ``[len(columns), in]`` codes of outputs ``columns``."""
        packed = self.codes[:, columns]  # [in / 8, rows]
        nibbles = (packed.unsqueeze(1) >> _shifts_on(packed.device)) & 15
        return nibbles.reshape(-1, len(columns))[: self.in_features].t()

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        groups = torch.arange(self.in_features, device=self.codes.device) // self.group_size
        scales = self.scales[:, ids][groups].t()
        offsets = self.offsets[:, ids][groups].t()
        return self._codes_of(ids).float() * scales + offsets

    def dequantize(self) -> torch.Tensor:
        return self.embedding_rows(torch.arange(self.out_features, device=self.codes.device))

    def take_rows(self, index: torch.Tensor) -> GroupedInt4Weight:
        index = index.to(self.codes.device)
        return GroupedInt4Weight(
            self.scheme,
            self.codes[:, index].contiguous(),
            self.scales[:, index].contiguous(),
            self.offsets[:, index].contiguous(),
            self.group_size,
            self.in_features,
        )

    def take_columns(self, start: int, end: int) -> GroupedInt4Weight:
        """Whole groups only (a row-parallel rank's share of o_proj / down_proj)."""
        if start % self.group_size or (end % self.group_size and end != self.in_features):
            raise ValueError(
                f"inputs [{start}, {end}) of a {self.scheme} weight split its groups of "
                f"{self.group_size}"
            )
        first, last = start // self.group_size, -(-end // self.group_size)
        return GroupedInt4Weight(
            self.scheme,
            self.codes[start // 8 : -(-end // 8)].contiguous(),
            self.scales[first:last].contiguous(),
            self.offsets[first:last].contiguous(),
            self.group_size,
            end - start,
        )

    @classmethod
    def concat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        parts = [weight for weight in weights if isinstance(weight, GroupedInt4Weight)]
        if len(parts) != len(weights) or len({part.group_size for part in parts}) != 1:
            return None
        return GroupedInt4Weight(
            "+".join(sorted({part.scheme for part in parts})),
            torch.cat([part.codes for part in parts], dim=1),
            torch.cat([part.scales for part in parts], dim=1),
            torch.cat([part.offsets for part in parts], dim=1),
            parts[0].group_size,
            parts[0].in_features,
        )

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes
