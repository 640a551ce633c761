"""Weight-only int8 with one scale per output row: ``--quantization int8`` for float
checkpoints, and GGUF's ``Q6_K`` (whose scales per 16 inputs the int4 kernel's groups of 32
cannot hold). Float32 rows multiply by integer dot products where the CPU has AVX-512 VNNI
(``int8_rows_kernel.py``: x rounded to 16 bits per row), else by torch's packed int8 CPU
kernel (``_weight_int8pack_mm``, bfloat16 activations).

Codes are ``round(w / s)`` with ``s = max |w_row| / 127`` rounded to bfloat16 (the kernel
takes bfloat16 scales and activations: float32 ones take a path 10x slower), so each weight
is within ``s / 2`` of the original, and ``dequantize`` returns exactly what is multiplied.
A ``Q6_K`` tensor is requantized from its dequantized values: within half an int8 step of
its row's largest weight (plus a bfloat16 scale's rounding), about a quarter of Q6_K's own
step. Bytes: 8 bits a weight and 10 a row (the bfloat16 scale torch's kernel takes, and the
float32 scale and int32 sum of codes the dot kernel takes; Q6_K's own: 6.56 bits a weight).

The kernel reads past the end of a row whose length is not a multiple of 16 (a segmentation
fault in torch 2.13), so rows are stored zero-padded to a multiple of ``COLUMN_MULTIPLE``
and such an ``x`` is padded alike (no model's hidden size needs it).
"""

from __future__ import annotations

import torch

from pdserve.model.quantization import int8_rows_kernel
from pdserve.model.quantization.int4_planes import dequantize_plan
from pdserve.model.quantization.quantized_weight import QuantizedWeight

COLUMN_MULTIPLE = 32
# Bytes a row holds besides its codes: its scale in bfloat16 (torch's kernel) and float32 (the
# dot kernel), and its codes' int32 sum.
INT8_ROW_BYTES = 10


class Int8ChannelWeight(QuantizedWeight):
    def __init__(
        self, scheme: str, codes: torch.Tensor, scales: torch.Tensor, in_features: int
    ) -> None:
        """``codes`` int8 ``[out, in]`` (padded, module doc), ``scales`` bfloat16 ``[out]``."""
        self.scheme = scheme
        padding = -codes.shape[1] % COLUMN_MULTIPLE
        self.codes = torch.nn.functional.pad(codes, (0, padding)).contiguous()
        self.scales = scales
        self.float_scales = scales.float()
        self.code_sums = self.codes.sum(dim=1, dtype=torch.int32)
        self.out_features, self.in_features = codes.shape[0], in_features

    @classmethod
    def from_float(cls, weight: torch.Tensor, scheme: str = "int8") -> Int8ChannelWeight:
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        codes = torch.round(weight / scales.float().unsqueeze(1)).clamp(-127, 127)
        return cls(scheme, codes.to(torch.int8), scales, weight.shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows, dtype = dequantize_plan()  # the kernel is 2x slower than float32's mm at 512
        if x.shape[0] >= rows:
            weight = self.codes[:, : self.in_features].to(dtype) * self.scales[:, None]
            return torch.mm(x.to(dtype), weight.t()).to(x.dtype)
        if x.dtype == torch.float32 and int8_rows_kernel.build() is not None:
            return int8_rows_kernel.int8_rows_dot(
                x.contiguous(), self.codes, self.code_sums, self.float_scales
            )
        activations = x.to(torch.bfloat16)
        padding = self.codes.shape[1] - self.in_features
        activations = torch.nn.functional.pad(activations, (0, padding)).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(activations, self.codes, self.scales)
        return out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.embedding_rows(torch.arange(self.out_features))

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids, : self.in_features]
        return codes.float() * self.scales[ids].float().unsqueeze(1)

    def take_rows(self, index: torch.Tensor) -> Int8ChannelWeight:
        return Int8ChannelWeight(
            self.scheme, self.codes[index], self.scales[index], self.in_features
        )

    def take_columns(self, start: int, end: int) -> Int8ChannelWeight:
        """Each row keeps its scale: a slice of its codes is still within half a step."""
        return Int8ChannelWeight(self.scheme, self.codes[:, start:end], self.scales, end - start)

    @classmethod
    def concat(cls, weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        parts = [weight for weight in weights if isinstance(weight, Int8ChannelWeight)]
        if len(parts) != len(weights):
            return None
        return Int8ChannelWeight(
            "+".join(sorted({part.scheme for part in parts})),
            torch.cat([part.codes for part in parts]),
            torch.cat([part.scales for part in parts]),
            parts[0].in_features,
        )

    @property
    def nbytes(self) -> int:
        return (
            self.codes.nbytes
            + self.scales.nbytes
            + self.float_scales.nbytes
            + self.code_sums.nbytes
        )


def int8_weight(weight: torch.Tensor) -> Int8ChannelWeight:
    """``--quantization int8`` of a float ``[out, in]`` weight."""
    return Int8ChannelWeight.from_float(weight)
