"""fp8 weights on the GPU, kept at one byte a weight: the checkpoint's ``float8_e4m3fn``
matrix and its scales, multiplied by a Triton kernel that widens a tile in registers
(``packed_matmul_triton.py``: why not ``torch._scaled_mm``).

Every granularity a checkpoint ships (``fp8_checkpoints.py``) is held as one: a scale per row
and block of ``block_in`` inputs, ``scales [out, ceil(in / block_in)]``::

    per tensor   []  or [1]              -> every row the one scale, block_in = in
    per channel  [out, 1]  or [out]      -> block_in = in
    per block    [ceil(out / bo), ceil(in / bi)]  (DeepSeek-V3's 128 x 128)
                                         -> each block row repeated for its bo rows, block_in = bi

so that rows can be taken and fused (q/k/v, gate/up, tensor-parallel shares) without regard
to blocks of rows; the repeat costs 4 / bi bytes a weight (3 % at 128). On the CPU fp8 has no
kernel here and is refused with ``--quantization auto`` (``fp8_checkpoints.py``).
"""

from __future__ import annotations

import torch

from pdserve.model.quantization import packed_matmul_triton
from pdserve.model.quantization.quantized_weight import QuantizedWeight


class Fp8Weight(QuantizedWeight):
    """An fp8 linear with a scale per row and block of inputs (module doc)."""

    scheme = "fp8"

    def __init__(self, bits: torch.Tensor, scales: torch.Tensor, block_in: int) -> None:
        """``bits`` uint8 ``[out, in]`` (the fp8 bytes), ``scales`` float32 ``[out, blocks]``."""
        self.bits, self.scales, self.block_in = bits, scales, block_in
        self.out_features, self.in_features = bits.shape

    @classmethod
    def from_checkpoint(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int] | None,
        device: torch.device,
    ) -> Fp8Weight:
        """A checkpoint's fp8 ``weight`` and ``scale`` (``fp8_checkpoints.py``'s shapes)."""
        rows, columns = weight.shape
        scale = scale.float()
        if scale.numel() == 1:
            per_row, block_in = scale.reshape(1, 1).expand(rows, 1), columns
        elif scale.dim() == 1 or (scale.shape[1] == 1 and block is None):
            if scale.shape[0] != rows:
                raise ValueError(
                    f"fp8 scale {list(scale.shape)} does not fit a weight {rows}x{columns}"
                )
            per_row, block_in = scale.reshape(rows, 1), columns
        else:
            if block is None:
                raise ValueError(
                    f"an fp8 block scale {list(scale.shape)} needs the config's block size"
                )
            block_rows, block_in = block
            if scale.shape != (-(-rows // block_rows), -(-columns // block_in)):
                raise ValueError(
                    f"fp8 scale {list(scale.shape)} does not tile a weight {rows}x{columns} "
                    f"in blocks of {block_rows}x{block_in}"
                )
            per_row = scale.repeat_interleave(block_rows, dim=0)[:rows]
        bits = weight.contiguous().view(torch.uint8)
        return cls(bits.to(device), per_row.contiguous().to(device), block_in)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if packed_matmul_triton.serves(x):
            return packed_matmul_triton.fp8_rows_matmul(x, self.bits, self.scales, self.block_in)
        return (x.float() @ self.dequantize().t()).to(x.dtype)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        values = self.bits[ids].view(torch.float8_e4m3fn).float()
        return (
            values * self.scales[ids].repeat_interleave(self.block_in, dim=1)[:, : self.in_features]
        )

    def dequantize(self) -> torch.Tensor:
        return self.embedding_rows(torch.arange(self.out_features, device=self.bits.device))

    def take_rows(self, index: torch.Tensor) -> Fp8Weight:
        index = index.to(self.bits.device)
        return Fp8Weight(
            self.bits[index].contiguous(), self.scales[index].contiguous(), self.block_in
        )

    def take_columns(self, start: int, end: int) -> Fp8Weight:
        """Whole blocks of inputs only, or any slice where one scale covers the row."""
        whole_row = self.block_in >= self.in_features
        if not whole_row and (
            start % self.block_in or (end % self.block_in and end != self.in_features)
        ):
            raise ValueError(
                f"inputs [{start}, {end}) of an fp8 weight split its blocks of {self.block_in}"
            )
        bits = self.bits[:, start:end].contiguous()
        if whole_row:
            return Fp8Weight(bits, self.scales, end - start)
        scales = self.scales[:, start // self.block_in : -(-end // self.block_in)]
        return Fp8Weight(bits, scales.contiguous(), self.block_in)

    @classmethod
    def concat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        parts = [weight for weight in weights if isinstance(weight, Fp8Weight)]
        if len(parts) != len(weights) or len({part.block_in for part in parts}) != 1:
            return None
        return Fp8Weight(
            torch.cat([part.bits for part in parts]),
            torch.cat([part.scales for part in parts]),
            parts[0].block_in,
        )

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.scales.nbytes
