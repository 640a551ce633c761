"""fp8 linears (DeepSeek-V3, Qwen3-FP8, compressed-tensors ``float-quantized``) dequantized.

An fp8 checkpoint stores each linear's weight as ``float8_e4m3fn`` ``[out, in]`` and a
float32 scale it is multiplied by, in one of three granularities, told apart by the scale's
shape::

    per tensor   scale []  or [1]                       (compressed-tensors "tensor")
    per channel  scale [out, 1]  or [out]               (compressed-tensors "channel")
    per block    scale [ceil(out / bo), ceil(in / bi)]  (DeepSeek-V3's weight_scale_inv,
                                                        bo = bi = 128; "block")

``w = fp8 * scale`` broadcast over the block it covers (a ``weight_scale_inv`` multiplies
too: the name says it is the inverse of the factor the quantizer divided by).

No CPU kernel here multiplies fp8 as it is stored: on this CPU, torch's ``_scaled_mm`` and
the conversion of fp8 to bfloat16 per call each take 30-45x float32's ``mm`` at one row
(576 -> 1536, one thread). So on CPU an fp8 checkpoint is refused with ``--quantization
auto``, and served dequantized (``none``: to the model's dtype) or repacked at one byte a
weight (``int8``: per output row, within half an int8 step of the dequantized weight). On a
GPU it runs as stored (``fp8_weight.py``).
"""

from __future__ import annotations

import torch


def fp8_dequantized(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The float32 ``[out, in]`` weight of an fp8 ``weight`` and its ``scale`` (module doc);
    ``block``: the ``[bo, bi]`` a block scale covers (the config's ``weight_block_size``)."""
    rows, columns = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        return weight.float() * scale.reshape(())
    if scale.dim() == 1 or (scale.shape[1] == 1 and block is None):
        if scale.shape[0] != rows:
            raise ValueError(
                f"fp8 scale {list(scale.shape)} does not fit a weight {rows}x{columns}"
            )
        return weight.float() * scale.reshape(rows, 1)
    if block is None:
        raise ValueError(f"an fp8 block scale {list(scale.shape)} needs the config's block size")
    block_rows, block_columns = block
    if scale.shape != (-(-rows // block_rows), -(-columns // block_columns)):
        raise ValueError(
            f"fp8 scale {list(scale.shape)} does not tile a weight {rows}x{columns} "
            f"in blocks of {block_rows}x{block_columns}"
        )
    expanded = scale.repeat_interleave(block_rows, dim=0).repeat_interleave(block_columns, dim=1)
    return weight.float() * expanded[:rows, :columns]
