"""Rotary position embedding (RoPE), with the ``linear`` and ``llama3`` frequency scalings.

The frequencies are computed exactly as transformers does (float32, same formula), so
logits match the reference to float tolerance. cos/sin are built once per step for the
step's positions and shared by all layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled per ``config.rope_scaling``."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scaled(inv_freq, scaling, config.max_position_embeddings)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Makes ``(cos, sin)`` for positions; :func:`apply_rotary` rotates q and k with them.

    ``inv_freq`` is created on the CPU even under a ``meta`` device context (the loader
    builds the model on ``meta``), and is not saved: checkpoints do not carry it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` (HF's rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
