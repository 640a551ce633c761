"""Gemma 3 (text): local sliding-window layers interleaved with global ones, Gemma's norms.

Differences from Llama, each under transformers' names so checkpoints load unrenamed:

* every 6th layer (``layer_types``) attends globally, the others within ``sliding_window``;
  the two kinds are separate KV groups (``ModelConfig.kv_layer_groups``: each has its own
  block tables, and a windowed group's blocks go back to the pool once they leave the
  window), with their own RoPE: the global one (``rope_theta``, maybe scaled) and the local
  one (``local_rope_theta``, unscaled);
* RMSNorm scales by ``1 + weight`` in float32; four norms per layer (before and after
  attention and the MLP, the outputs normed before the residual add); q and k per head;
* the embedding is multiplied by ``sqrt(hidden_size)``; the MLP's gate is a tanh GELU;
* the softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import functools

import torch

from pdserve.model.architectures.layers import GatedMLP, RMSNorm
from pdserve.model.architectures.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    mark_lora_layer,
)
from pdserve.model.architectures.rotary import RotaryEmbedding
from pdserve.model.attention import AttentionMetadata
from pdserve.model.model_config import ModelConfig
from pdserve.model.tensor_parallel import TensorParallel


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Attention and GeGLU, each between a pre-norm and a post-norm."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super(LlamaDecoderLayer, self).__init__()
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.self_attn = LlamaAttention(config)
        self.feed_forward_name = "mlp"
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.tensor_parallel: TensorParallel | None = None
        mark_lora_layer(self, index)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn.forward(
            self.input_layernorm.forward(hidden), rotary, kv_cache, layer, metadata
        )
        if self.tensor_parallel is not None:  # the norms need the whole sum
            self.tensor_parallel.all_reduce(attended)
        hidden = hidden + self.post_attention_layernorm.forward(attended)
        fed = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(fed)
        return hidden + self.post_feedforward_layernorm.forward(fed)


class Gemma3Model(LlamaModel):
    """Scaled embedding; each layer rotated by its kind's RoPE (local or global)."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.rotary_emb_local = RotaryEmbedding(config, local=True)
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * _rounded_to(self.embed_scale, hidden.dtype)

    def layer_rotaries(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        by_kind = {
            windowed: rotary.forward(positions, max_position, dtype)
            for windowed, rotary in ((False, self.rotary_emb), (True, self.rotary_emb_local))
        }
        return [by_kind[self.config.is_windowed(i)] for i in range(len(self.layers))]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; the LM head is tied to the embedding."""

    model_class = Gemma3Model


@functools.cache
def _rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as transformers scales Gemma's embedding (by a tensor
    of the embedding's dtype); a Python number, so a step makes no tensor of it."""
    return torch.tensor(value, dtype=dtype).item()
