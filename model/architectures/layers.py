"""The building blocks every architecture shares: RMSNorm, fused projections, SwiGLU.

Projections are packed for inference into transposed, fused ``[in, out]`` matrices
(:func:`fuse_linears`), whose HF-named parameters become views of them: ``state_dict()``
keeps its names and values and no weight is stored twice (``llama.py`` says why ``mm`` on
``[in, out]``).

A linear or embedding the loader gave a packed weight (``model/quantization/``) carries it
as ``packed_weight`` and an empty ``weight``: fusing concatenates the packed weights'
rows, :func:`project` runs their own matmul and :func:`embedding_rows` dequantizes only the
rows looked up. So an architecture runs float and packed weights through the same code::

    linear.packed_weight ─ fuse_linears ─▶ QuantizedWeight  ─ project ─▶ weight.matmul(x)
    linear.weight        ─ fuse_linears ─▶ [in, out] tensor ─ project ─▶ x @ weight_t
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import rms_norm_kernel
from pdserve.model.lora.lora_step import add_lora
from pdserve.model.quantization import QuantizedWeight, concat_rows
from pdserve.model.quantization.quantized_weight import packed_weight
from pdserve.model.tensor_parallel import TensorParallel, keep_input_columns, keep_output_rows

# A fused projection's weight: a float ``[in, out]`` matrix, or a packed ``[out, in]`` one.
ProjectionWeight = torch.Tensor | QuantizedWeight


class RMSNorm(nn.Module):
    """Root-mean-square norm: float32 rows on CPU in one pass (``rms_norm_kernel.py``: torch's
    is six operations there), else ``F.rms_norm`` (float32 for float32 models)."""

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_offset = weight_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rms_norm_kernel.serves(x, self.weight):
            return rms_norm_kernel.rms_norm(x, self.weight, self.eps, self.weight_offset)
        if self.weight_offset:  # Gemma: scaled by (offset + w) in float32, then cast
            normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
            return (normed * (self.weight.float() + self.weight_offset)).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def fuse_linears(linears: list[nn.Linear]) -> tuple[ProjectionWeight, torch.Tensor | None]:
    """``[in, sum(out)]`` weight and ``[sum(out)]`` bias (``None`` when no linear has one) of
    linears sharing an input; a linear without a bias adds zeros where others have one
    (DeepSeek-V2-Lite's ``q_proj`` has none, the ``kv_a_proj_with_mqa`` fused beside it may).

    Each linear's parameters become views into the fused tensors, so the checkpoint
    names still reach the same numbers and memory is not doubled. Packed linears fuse into
    one packed weight (their rows concatenated); the linears give theirs up.
    """
    bias = _fused_bias(linears)
    packed = [packed_weight(linear) for linear in linears]
    if any(weight is not None for weight in packed):
        if not all(weight is not None for weight in packed):
            raise ValueError(
                "a fused projection mixes packed and float weights: "
                + ", ".join(f"{each.out_features}x{each.in_features}" for each in linears)
            )
        for linear in linears:
            del linear.packed_weight
        return concat_rows(cast("list[QuantizedWeight]", packed)), bias
    weight_t = torch.cat([linear.weight.detach() for linear in linears]).t().contiguous()
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight_t[:, start:end].t(), requires_grad=False)
        if linear.bias is not None and bias is not None:  # the one implies the other
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight_t, bias


def _fused_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    present = [linear.bias for linear in linears if linear.bias is not None]
    if not present:
        return None
    return torch.cat(
        [
            present[0].new_zeros(linear.out_features) if linear.bias is None else linear.bias
            for linear in linears
        ]
    ).detach()


def project(x: torch.Tensor, weight: ProjectionWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` for a fused ``[in, out]`` weight, or a packed weight's own
    matmul."""
    if isinstance(weight, QuantizedWeight):
        out = weight.matmul(x)
        return out if bias is None else out.add_(bias)
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def embedding_rows(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The ids' rows of an embedding; a packed one dequantizes only those rows."""
    packed = packed_weight(embedding)
    if packed is None:
        return embedding.forward(ids)
    return packed.embedding_rows(ids).to(embedding.weight.dtype)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up as one fused matmul: SwiGLU (Llama's MLP, a
    MoE model's dense layers, DeepSeek's shared experts) or GeGLU (Gemma's tanh GELU)."""

    lora_layer = -1
    """Its decoder layer's index, where LoRA adapters may adapt it (``model/lora/``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = _ACTIVATIONS[activation]
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def shard(self, tensor_parallel: TensorParallel) -> None:
        """Keep this rank's slice of the intermediate features (before ``fuse_weights``)."""
        start, end = tensor_parallel.split(self.intermediate_size, "intermediate features")
        keep_output_rows(self.gate_proj, start, end)
        keep_output_rows(self.up_proj, start, end)
        keep_input_columns(self.down_proj, start, end, keep_bias=True)  # down has no bias
        self.intermediate_size = end - start

    def fuse_weights(self) -> None:
        self.gate_up_weight, _ = fuse_linears([self.gate_proj, self.up_proj])
        self.down_weight, _ = fuse_linears([self.down_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = add_lora(project(x, self.gate_up_weight, None), x, self.lora_layer, "gate_up")
        activated = (
            self.activation(gate_up[:, : self.intermediate_size])
            * gate_up[:, self.intermediate_size :]
        )
        return add_lora(
            project(activated, self.down_weight, None), activated, self.lora_layer, "down"
        )
