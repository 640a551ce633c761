"""Rotary position embedding (RoPE), with the ``linear``, ``llama3`` and ``yarn`` scalings.

The frequencies are computed exactly as transformers does (float32, same formula), so
logits match the reference to float tolerance. cos/sin come from a table built once;
each step looks its positions up once and all layers share the rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.model.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled per ``config.rope_scaling``;
    ``local``: the windowed layers' own unscaled base (``config.local_rope_theta``)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    if theta is None:
        raise ValueError(f"{config.architecture} has no local RoPE base")
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_scaled(inv_freq, theta, dim, scaling, config.max_position_embeddings)
    return _llama3_scaled(inv_freq, scaling, config.max_position_embeddings)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(config: ModelConfig) -> float:
    """How much YaRN scales cos and sin (1 for every other RoPE): ``attention_factor`` when
    the config gives it, else the ratio of ``mscale`` to ``mscale_all_dim`` corrections
    (DeepSeek), else the plain correction of ``factor``."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, config.max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_factor(scaling: dict, max_position_embeddings: int) -> float:
    """How many times YaRN stretches the original context."""
    factor = scaling.get("factor")
    if factor is None:
        return max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_scaled(
    inv_freq: torch.Tensor, theta: float, dim: int, scaling: dict, max_position_embeddings: int
) -> torch.Tensor:
    """YaRN: frequencies that turn many times over the original context are kept, those that
    turn less than once are divided by ``factor``, with a linear ramp between (over the
    dimensions where ``beta_fast`` and ``beta_slow`` rotations fall)."""
    factor = yarn_factor(scaling, max_position_embeddings)
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_of(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    kept = 1 - ramp
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def _llama3_scaled(
    inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int
) -> torch.Tensor:
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
    """Looks up ``(cos, sin)`` for positions; :func:`apply_rotary` rotates q and k with them.

    A float32 table ``[positions, 2, head_dim]`` (cos, then sin with its first half
    negated, see :func:`apply_rotary`) is computed once, as transformers computes it, and
    grown by doubling when a step reaches past it: a step costs one row lookup, not a
    cos and a sin. ``inv_freq`` is created on the CPU even under a ``meta`` device
    context (the loader builds the model on ``meta``), and is not saved: checkpoints do
    not carry it; neither is the table.
    """

    # A registered buffer: declared so that it reads as a Tensor (nn.Module's __getattr__,
    # which finds buffers, is typed ``Tensor | Module``).
    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config, local), persistent=False)
        self.attention_factor = 1.0 if local else attention_factor(config)
        self._table = torch.empty(0)
        self.frozen = False
        """Set once CUDA graphs read the table where it lies (``engine/decode_graphs.py``):
        it may not be rebuilt elsewhere then."""

    def forward(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``signed sin`` ``[num_tokens, 1, head_dim]``; ``max_position`` bounds ``positions``."""
        self.reserve(max_position)
        rows = self._table.index_select(0, positions).to(dtype)
        return rows[:, 0:1], rows[:, 1:2]

    def reserve(self, num_positions: int) -> None:
        """Holds rows for at least ``num_positions`` (positions ``0 .. num_positions - 1``)."""
        if self._table.shape[0] < num_positions or self._table.device != self.inv_freq.device:
            if self.frozen:
                raise RuntimeError(
                    f"position {num_positions - 1} is past the {self._table.shape[0]} RoPE "
                    "positions the decode graphs were captured with (max_model_len bounds them)"
                )
            self._table = self._build_table(max(num_positions, 2 * self._table.shape[0], 256))

    def _build_table(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)  # [positions, head_dim]
        sin = angles.sin() * self.attention_factor
        half = sin.shape[-1] // 2
        sin[:, :half] = -sin[:, :half]
        return torch.stack((angles.cos() * self.attention_factor, sin), dim=1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` (HF's rotate-half layout) into ``out``.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` equals
    ``x * cos + roll(x, half) * signed_sin`` where ``signed_sin = cat(-sin1, sin2)``:
    three kernels instead of seven. ``out`` may be ``x`` itself (rotation in place).
    """
    rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, rolled, signed_sin, out=out)


def apply_rotary_interleaved(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, dim]`` in DeepSeek's layout: channel pairs
    ``(x0, x1), (x2, x3), …`` each turn by one frequency.

    The result is laid out de-interleaved (every pair's first member, then every second),
    as transformers' DeepSeek-V3 writes it. Queries and keys get the same layout, so their
    dot products are the paired form's; the cached key is only ever read by such products.
    """
    half = x.shape[-1] // 2
    cos_half, sin_half = cos[..., :half], -signed_sin[..., :half]
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat(
        (first * cos_half - second * sin_half, second * cos_half + first * sin_half), dim=-1
    )
