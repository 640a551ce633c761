"""A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) read for a
model's fused projections, and named by its weights.

PEFT stores, per adapted linear ``p`` of layer ``i``, ``A [r, in]`` and ``B [out, r]``; the
linear computes ``x W^T + scaling (x A^T) B^T``, ``scaling = alpha / r`` (``alpha /
sqrt(r)`` with ``use_rslora``), ``r`` and ``alpha`` per module where ``rank_pattern`` /
``alpha_pattern`` name it. pdserve fuses q/k/v and gate/up into one matmul each
(``layers.py``), so an adapter is held per fused projection (a *site*) of each layer::

    site      fused output columns                  parts (those the adapter targets)
    qkv       | q (heads x d) | k (kv x d) | v |     q_proj, k_proj, v_proj
    o         | o |                                 o_proj
    gate_up   | gate (I) | up (I) |                 gate_proj, up_proj
    down      | down |                              down_proj

    a part: its columns of the fused output, A [r, in], and B times its scaling [out, r]

``digest``: a SHA-256 of the config and every tensor (name, dtype, shape, bytes), the
adapter's identity in block hashes (``cache/hashing.py``): a reload of new weights under an
old name never meets the old blocks, and two workers that loaded the same file agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from pdserve.model.tensor_parallel import shard_of

TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
"""The linears an adapter may target: their site and place among its parts."""
_SITE_PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_REFUSED_OPTIONS = {  # PEFT options whose adapters compute something else
    "use_dora": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
}


@dataclass(frozen=True, slots=True)
class LoRAPart:
    """One adapted linear inside its fused projection."""

    target: str
    """``q_proj``, ``gate_proj``, ...: its place among the site's parts."""
    columns: tuple[int, int]
    """The fused output's columns it adds to."""
    a: torch.Tensor
    """``A``, ``[r, in]``."""
    b: torch.Tensor
    """``B`` times the part's scaling, ``[out, r]``."""


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter as the model runs it (module doc)."""

    name: str
    digest: str
    sites: dict[tuple[int, str], tuple[LoRAPart, ...]]
    """Its parts by (layer index, site), in the site's order; under tensor parallelism,
    this rank's slice of each (``model/tensor_parallel.py``)."""
    path: str = ""
    """The folder it was read from (a tensor-parallel peer reads its own slice there)."""

    @classmethod
    def load(cls, name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
        """The adapter in folder ``path`` for ``model`` (a built ``CausalLM``), refused with
        a message naming the adapter where it does not fit: a rank above ``max_rank``, a
        target the model lacks or pdserve does not adapt, a corrupt or missing file."""
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except (OSError, ValueError, SafetensorError) as error:
            raise ValueError(f"LoRA adapter {name!r} at {folder} cannot be read: {error}") from None
        _check_options(name, config)
        pairs = _pairs(name, tensors)
        layers = _adapted_layers(model)
        shapes = {
            (index, target): _linear(layer, target)
            for index, layer in enumerate(layers)
            for target in TARGETS
        }
        parts: dict[tuple[int, str], list[tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
        for (index, target), (a, b) in sorted(pairs.items()):
            linear = shapes.get((index, target))
            if linear is None:
                raise ValueError(
                    f"LoRA adapter {name!r} targets {target} of layer {index}, which the model "
                    f"does not have or pdserve does not adapt (it adapts "
                    f"{', '.join(TARGETS)} of dense attention and MLP layers)"
                )
            rank = a.shape[0]
            shard = shard_of(linear)
            whole_out, whole_in = (
                (shard.whole_out, shard.whole_in)
                if shard is not None
                else (linear.out_features, linear.in_features)
            )
            if rank > max_rank:
                raise ValueError(
                    f"LoRA adapter {name!r} has rank {rank} at {target} of layer {index}, "
                    f"above max_lora_rank {max_rank}"
                )
            if a.shape != (rank, whole_in) or b.shape != (whole_out, rank):
                raise ValueError(
                    f"LoRA adapter {name!r}: {target} of layer {index} is "
                    f"{whole_out}x{whole_in}, its A {list(a.shape)} and B "
                    f"{list(b.shape)} do not fit it"
                )
            if shard is not None and shard.rows is not None:  # this rank's outputs
                b = b[shard.rows[0] : shard.rows[1]]
            if shard is not None and shard.columns is not None:  # this rank's inputs
                a = a[:, shard.columns[0] : shard.columns[1]]
            scaling = _scaling(config, f"model.layers.{index}.{target}", rank)
            site = TARGETS[target][0]
            weight = linear.weight  # empty where packed, but of the model's dtype and device
            a, b = (t.to(device=weight.device, dtype=weight.dtype) for t in (a, b))
            parts.setdefault((index, site), []).append((target, a, b, scaling))
        sites = {key: _site(layers[key[0]], key[1], found) for key, found in parts.items()}
        return cls(name=name, digest=_digest(config, tensors), sites=sites, path=str(folder))


def _check_options(name: str, config: dict[str, Any]) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a {config.get('peft_type')} adapter, not LoRA")
    for option, plain in _REFUSED_OPTIONS.items():
        if config.get(option, plain) not in (plain, [], {}):
            raise ValueError(f"LoRA adapter {name!r} sets {option}, which pdserve does not run")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={config['bias']!r})")


def _pairs(
    name: str, tensors: dict[str, torch.Tensor]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, target) -> (A, B)`` in float32, every tensor accounted for."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r} holds {tensor_name!r}, which is no lora_A / lora_B "
                "of a decoder layer's linear"
            )
        layer, target, half = match.groups()
        halves.setdefault((int(layer), target), {})[half] = tensor.float()
    pairs = {}
    for key, found in halves.items():
        if set(found) != {"A", "B"}:
            raise ValueError(
                f"LoRA adapter {name!r}: {key[1]} of layer {key[0]} lacks lora_A or lora_B"
            )
        pairs[key] = (found["A"], found["B"])
    return pairs


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """``alpha / r`` (``/ sqrt(r)`` with rsLoRA), alpha from the first ``alpha_pattern``
    key naming the module (PEFT matches a key as the module path's tail)."""
    alpha = float(config.get("lora_alpha", 8))
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = float(value)
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _adapted_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)  # type: ignore[union-attr, arg-type]


def _linear(layer: nn.Module, target: str) -> nn.Linear | None:
    """The layer's linear ``target`` where pdserve adapts it (dense attention and MLP)."""
    holder = getattr(layer, "self_attn" if TARGETS[target][0] in ("qkv", "o") else "mlp", None)
    if getattr(holder, "lora_layer", -1) < 0:  # latent attention, experts
        return None
    linear = getattr(holder, target, None)
    return linear if isinstance(linear, nn.Linear) else None


def _site(
    layer: nn.Module, site: str, found: list[tuple[str, torch.Tensor, torch.Tensor, float]]
) -> tuple[LoRAPart, ...]:
    """The site's parts in its order, each at its columns of the fused output."""
    starts: dict[str, int] = {}
    column = 0
    for target in _SITE_PARTS[site]:
        starts[target] = column
        linear = _linear(layer, target)
        assert linear is not None
        column += linear.out_features
    ordered = sorted(found, key=lambda part: TARGETS[part[0]][1])
    return tuple(
        LoRAPart(target, (starts[target], starts[target] + b.shape[0]), a.contiguous(), b * scaling)
        for target, a, b, scaling in ordered
    )


def _digest(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for tensor_name in sorted(tensors):
        tensor = tensors[tensor_name].contiguous()
        digest.update(f"{tensor_name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
