"""The quantized format of a Hugging Face folder's linears (``config.json``'s
``quantization_config``), and each linear's stored tensors turned into the weight it runs.

    quant_method         stored per linear ``p``                      runs as (CPU / CUDA)
    awq  (gemm, 4 bits)  p.qweight p.qzeros p.scales                  int4 planes / int4 groups
    gptq (4 or 8 bits)   p.qweight p.qzeros p.scales p.g_idx          int4 planes / int4 groups
                                                                      (4 bits; 8: dequantized)
    fp8                  p.weight p.weight_scale_inv (or weight_scale) dequantized / fp8 weight
    compressed-tensors   p.weight p.weight_scale (fp8 "float" weights) dequantized / fp8 weight

``int4_checkpoints.py`` and ``fp8_checkpoints.py`` hold the layouts; ``int4_planes.py``,
``grouped_int4_weight.py`` and ``fp8_weight.py`` the weights that run them. A linear a checkpoint
left in float (AWQ's ``modules_to_not_convert``, an fp8 model's ``lm_head``) has no such
tensors and loads as any float weight. Static activation and KV scales (``input_scale``,
``k_scale``, ``v_scale``) are read past: activations and KV are computed in float.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.model.quantization.fp8_checkpoints import fp8_dequantized
from pdserve.model.quantization.fp8_weight import Fp8Weight
from pdserve.model.quantization.grouped_int4_weight import GroupedInt4Weight
from pdserve.model.quantization.int4_checkpoints import AffineGroups, awq_groups, gptq_groups
from pdserve.model.quantization.packed_matmul_triton import builds_gpu_formats
from pdserve.model.quantization.quantized_weight import QuantizedWeight

SUPPORTED = "awq (gemm, 4 bits), gptq (4 or 8 bits), fp8, compressed-tensors with fp8 weights"
# Methods whose saved weights are floats: transformers dequantizes a GGUF at load and keeps
# {"quant_method": "gguf"} in the config it saves.
FLOAT_METHODS = ("gguf",)
_INT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
_FP8_SCALES = ("weight_scale_inv", "weight_scale")
_READ_PAST = ("input_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a checkpoint's quantized linears are stored (module doc)."""

    scheme: str
    """"AWQ", "GPTQ" or "fp8": also the name ``config.quantization`` gives it packed."""
    bits: int = 8
    zeros_minus_one: bool = False
    """GPTQ's "gptq" (v1) checkpoint format stores each zero minus one."""
    block: tuple[int, int] | None = None
    """fp8's ``weight_block_size``: the ``[out, in]`` a block scale covers."""

    def runs_packed_on(self, device_type: str) -> bool:
        """Whether a kernel multiplies the format as it is stored on ``device_type``: AWQ and
        GPTQ as int4 planes on CPU, 4-bit ones as int4 groups on CUDA; fp8 on CUDA only
        (``fp8_checkpoints.py`` says why not on CPU)."""
        if builds_gpu_formats(device_type):
            return self.scheme == "fp8" or self.bits == 4
        return self.scheme != "fp8"

    def bits_held_on(self, device_type: str) -> float:
        """Bits a weight takes packed. CPU: the int4 planes' 4 a plane plus 32 bits of scale
        and offset per 32 inputs, one plane up to 4 bits, two past. CUDA: fp8's byte plus a
        float32 scale per row and block of 128; int4 groups' 4 bits plus a float32 scale and
        offset per group of 128 (``grouped_int4_weight.py``)."""
        if builds_gpu_formats(device_type):
            return 8.25 if self.scheme == "fp8" else 4.5
        return 5.0 if self.bits <= 4 else 10.0

    def refusal(self, device_type: str) -> str:
        """Why ``--quantization auto`` cannot run this format on ``device_type``, and what
        would."""
        fp8 = self.scheme == "fp8"
        where = "it runs packed on CUDA" if fp8 else "the GPU kernel reads 4-bit codes"
        name = self.scheme if fp8 else f"{self.bits}-bit {self.scheme}"
        return (
            f"{name} weights have no kernel in pdserve on "
            f"{device_type} ({where}): use --quantization none (dequantized to the dtype) or "
            "--quantization int8 (one byte a weight, CPU)"
        )

    def linears(self, names: Iterable[str]) -> list[str]:
        """The module paths ``p`` of the quantized linears among tensor ``names``."""
        markers = _FP8_SCALES if self.scheme == "fp8" else ("qweight",)
        return sorted(
            name.rsplit(".", 1)[0] for name in names if name.rsplit(".", 1)[-1] in markers
        )

    def read_past(self, name: str) -> bool:
        """Whether tensor ``name`` is a static activation or KV scale (module doc)."""
        return self.scheme == "fp8" and name.rsplit(".", 1)[-1] in _READ_PAST

    def take_linear(
        self, state: dict[str, torch.Tensor], module: str, pack: bool, device: torch.device
    ) -> QuantizedWeight | torch.Tensor:
        """Linear ``module``'s stored tensors taken out of ``state``, as the packed weight it
        runs on ``device`` (``pack``) or its float32 ``[out, in]`` weight."""
        if self.scheme == "fp8":
            scale_name = next(f"{module}.{s}" for s in _FP8_SCALES if f"{module}.{s}" in state)
            weight, scale = state.pop(f"{module}.weight"), state.pop(scale_name)
            if pack:
                return Fp8Weight.from_checkpoint(weight, scale, self.block, device)
            return fp8_dequantized(weight, scale, self.block)
        groups = self._groups(state, module)
        if not pack:
            return groups.dequantize()
        if builds_gpu_formats(device.type):
            return GroupedInt4Weight.from_groups(groups, device)
        return groups.packed()

    def logical_shape(self, shapes: dict[str, list[int]], module: str) -> list[int]:
        """``[out, in]`` of linear ``module`` from its stored tensors' shapes."""
        if self.scheme == "fp8":
            return shapes[f"{module}.weight"]
        stored = shapes[f"{module}.qweight"]
        per_int = 32 // self.bits
        if self.scheme == "AWQ":
            return [stored[1] * per_int, stored[0]]
        return [stored[1], stored[0] * per_int]

    def _groups(self, state: dict[str, torch.Tensor], module: str) -> AffineGroups:
        qweight, qzeros, scales = (state.pop(f"{module}.{part}") for part in _INT_TENSORS[:3])
        if self.scheme == "AWQ":
            return awq_groups(qweight, qzeros, scales)
        g_idx = state.pop(f"{module}.g_idx", None)
        return gptq_groups(qweight, qzeros, scales, g_idx, self.bits, self.zeros_minus_one)


def checkpoint_quantization(directory: str | Path) -> CheckpointQuantization | None:
    """The format ``directory``'s ``config.json`` declares (None: float weights), refused
    where it is one pdserve does not read, naming those it does."""
    config = json.loads((Path(directory) / "config.json").read_text())
    declared = config.get("quantization_config")
    if not declared or str(declared.get("quant_method", "")).lower() in FLOAT_METHODS:
        return None
    return parse_quantization_config(declared)


def parse_quantization_config(declared: dict[str, Any]) -> CheckpointQuantization:
    method = str(declared.get("quant_method", "")).lower()
    bits = int(declared.get("bits", declared.get("w_bit", 4)))
    if method == "awq":
        version = str(declared.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4 or not declared.get("zero_point", True):
            raise ValueError(
                f"AWQ {version}, {bits} bits, zero_point={declared.get('zero_point')} is not "
                f"supported; supported: {SUPPORTED}"
            )
        return CheckpointQuantization("AWQ", bits=4)
    if method == "gptq":
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported; supported: {SUPPORTED}")
        v1 = str(declared.get("checkpoint_format", "gptq")).lower() == "gptq"
        return CheckpointQuantization("GPTQ", bits=bits, zeros_minus_one=v1)
    if method == "fp8":
        block = declared.get("weight_block_size")
        return CheckpointQuantization("fp8", block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(declared)
    raise ValueError(
        f"quantization {method or declared!r} is not supported; supported: {SUPPORTED}"
    )


def _compressed_tensors(declared: dict[str, Any]) -> CheckpointQuantization:
    """compressed-tensors' fp8 weights: every config group's weights 8-bit floats, one
    block structure among them where a group is per block."""
    groups = declared.get("config_groups") or {}
    weights = [group.get("weights") or {} for group in groups.values()]
    if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        kinds = sorted({f"{w.get('type')}{w.get('num_bits')}" for w in weights})
        raise ValueError(
            f"compressed-tensors weights {kinds or 'without config_groups'} are not "
            f"supported; supported: {SUPPORTED}"
        )
    blocks = {tuple(w["block_structure"]) for w in weights if w.get("block_structure")}
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different blocks {sorted(blocks)}")
    return CheckpointQuantization("fp8", block=next(iter(blocks), None))
