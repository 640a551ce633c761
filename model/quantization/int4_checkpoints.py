"""AWQ and GPTQ linears (Hugging Face folders quantized by AutoAWQ, GPTQModel, llm-compressor
or optimum) read into the int4 planes that ``int4_planes.py`` multiplies, or dequantized.

Both formats are affine per group of ``group_size`` inputs (128 in nearly every checkpoint;
-1 means one group per row): ``w[o, i] = scale[g, o] * (code[i, o] - zero[g, o])`` with
``g = i // group_size`` (GPTQ with act-order: ``g = g_idx[i]``). Codes and zeros are packed
eight 4-bit values (or four 8-bit ones) to an int32, differently per format::

    AWQ   qweight [in, out / 8]      along out, nibble n holds column 8c + AWQ_ORDER[n]
          qzeros  [groups, out / 8]  the same
          scales  [groups, out]      float16
    GPTQ  qweight [in / 8, out]      along in, nibble n holds row 8r + n
          qzeros  [groups, out / 8]  along out, nibble n holds column 8c + n; "gptq" (v1)
                                     stores zero - 1, "gptq_v2" the zero itself
          scales  [groups, out]      float16
          g_idx   [in]               each input's group

A group of 128 is four of the planes' groups of 32 with the same scale and offset
``-scale * zero``, so these checkpoints run on the very kernel GGUF's Q4 types run on, at 5
bits a weight (the checkpoint's own: 4.25). The offset rounds to float16 there: within
``2^-11 * 15 * scale`` of the checkpoint's value. An act-order GPTQ whose ``g_idx`` is not
``i // group_size`` has groups that are not runs of inputs: it is not packed (refused with
``--quantization auto``; ``none`` and ``int8`` dequantize it).
"""

from __future__ import annotations

import torch

from pdserve.model.quantization.int4_planes import GROUP, Int4PlanesWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which column of its eight each nibble of an AWQ int32 holds (AutoAWQ's packer)."""
_AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(column) for column in range(8))


class AffineGroups:
    """A linear as integer codes ``[out, in]`` with a scale and a zero per group of inputs."""

    def __init__(
        self,
        scheme: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_of_input: torch.Tensor,
        bits: int,
    ) -> None:
        """``codes`` uint8 ``[out, in]``; ``scales`` float32 and ``zeros`` ``[out, groups]``;
        ``group_of_input`` int ``[in]``."""
        self.scheme = scheme
        self.codes = codes
        self.scales = scales
        self.zeros = zeros
        self.group_of_input = group_of_input
        self.bits = bits

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the checkpoint describes."""
        scale = self.scales[:, self.group_of_input]
        zero = self.zeros[:, self.group_of_input].float()
        return (self.codes.float() - zero) * scale

    def group_size(self) -> int | None:
        """Inputs per group when groups are runs of inputs (``g = i // size``), else None."""
        inputs, groups = self.codes.shape[1], self.scales.shape[1]
        size = -(-inputs // groups)
        runs = torch.arange(inputs) // size
        return size if torch.equal(self.group_of_input.long(), runs) else None

    def packed(self) -> Int4PlanesWeight:
        """The planes ``int4_planes.py`` multiplies (module doc); refused where the groups
        are not runs of a multiple of 32 inputs."""
        size = self.group_size()
        if size is None or size % GROUP:
            reason = (
                "its act-order groups are not runs of inputs"
                if size is None
                else f"its groups of {size} inputs are not a multiple of {GROUP}"
            )
            raise ValueError(
                f"this {self.scheme} checkpoint cannot run packed: {reason}; "
                "use --quantization none (dequantized) or int8"
            )
        repeat = size // GROUP
        scale = self.scales.repeat_interleave(repeat, dim=1)
        offset = -(self.zeros.float() * self.scales).repeat_interleave(repeat, dim=1)
        columns = self.codes.shape[1] // GROUP
        return Int4PlanesWeight.from_affine(
            self.scheme, self.codes, scale[:, :columns], offset[:, :columns], self.bits
        )


def awq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> AffineGroups:
    """An AWQ (GEMM layout) linear's codes, zeros and scales (module doc)."""
    codes = _awq_columns(qweight).t().contiguous()
    zeros = _awq_columns(qzeros).t()
    return _groups("AWQ", codes, scales, zeros, None, bits=4)


def gptq_groups(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    zeros_minus_one: bool,
) -> AffineGroups:
    """A GPTQ linear's codes, zeros and scales (module doc); ``zeros_minus_one`` for the
    "gptq" (v1) checkpoint format."""
    per_int = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    rows = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [in / n, n, out]
    codes = rows.reshape(qweight.shape[0] * per_int, qweight.shape[1]).t().contiguous()
    zeros = ((qzeros.unsqueeze(-1) >> shifts) & mask).reshape(qzeros.shape[0], -1)
    zeros = zeros[:, : scales.shape[1]].t() + (1 if zeros_minus_one else 0)
    return _groups("GPTQ", codes, scales, zeros, g_idx, bits)


def _groups(
    scheme: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
) -> AffineGroups:
    inputs, groups = codes.shape[1], scales.shape[0]
    if g_idx is None:
        g_idx = torch.arange(inputs) // -(-inputs // groups)
    if g_idx.shape != (inputs,) or int(g_idx.max()) >= groups:
        raise ValueError(f"{scheme}: g_idx does not give each of {inputs} inputs a group")
    return AffineGroups(
        scheme, codes.to(torch.uint8), scales.float().t(), zeros.to(torch.int16), g_idx, bits
    )


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, columns / 8]`` int32 of AWQ to ``[rows, columns]`` 4-bit values."""
    shifts = torch.tensor([4 * nibble for nibble in _AWQ_COLUMN_NIBBLE], dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 15).reshape(packed.shape[0], -1)
