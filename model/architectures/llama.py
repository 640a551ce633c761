"""The Llama architecture over paged KV: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Module and parameter names follow transformers (``model.layers.0.self_attn.q_proj.weight``
...), so a checkpoint's safetensors load with no renaming. Unlike transformers, the
forward takes the whole step flattened (``[num_tokens]`` ids and positions of many
requests' chunks) plus :class:`AttentionMetadata`, and reads/writes K/V in the paged
KV tensor instead of a per-request cache.

Before the first forward, :meth:`LlamaForCausalLM.fuse_weights` packs each layer's
projections into transposed, fused matrices (``[hidden, q + k + v]``, ``[hidden, gate + up]``,
...) and points the HF-named parameters at views of them: ``state_dict()`` keeps its
names and values and no weight is stored twice, while a step does one ``mm`` per fused
projection (``mm`` on a ``[in, out]`` matrix runs 1.5-2x faster than ``linear`` on
``[out, in]`` at these sizes on the CPU).

Inside the model, submodules are called through ``.forward``, not ``module(...)``:
``nn.Module.__call__`` spends a few microseconds per call on hook bookkeeping, and at
batch 1 the ~25 calls of a step are a tenth of its time. Inference registers no hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, cast

import torch
from torch import nn

from pdserve.model.architectures.layers import (
    GatedMLP,
    ProjectionWeight,
    RMSNorm,
    embedding_rows,
    fuse_linears,
    project,
)
from pdserve.model.architectures.mla import MLAttention
from pdserve.model.architectures.moe import SparseMoE
from pdserve.model.architectures.rotary import RotaryEmbedding, apply_rotary
from pdserve.model.attention import AttentionMetadata, StepAttention, paged_attention
from pdserve.model.lora.lora_step import add_lora
from pdserve.model.model_config import ModelConfig
from pdserve.model.quantization.quantized_weight import attach_packed_weight, packed_weight
from pdserve.model.tensor_parallel import TensorParallel, keep_input_columns, keep_output_rows


class LlamaAttention(nn.Module):
    """Grouped-query attention: ``num_heads`` queries share ``num_kv_heads`` K/V heads."""

    lora_layer = -1
    """Its decoder layer's index, where LoRA adapters may adapt it (``model/lora/``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        offset = config.norm_weight_offset
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        )
        self.scale = config.attention_scale

    def shard(self, tensor_parallel: TensorParallel) -> None:
        """Keep this rank's query heads and the KV heads they read (before ``fuse_weights``)."""
        size = self.head_dim
        q_start, q_end = tensor_parallel.split(self.num_heads, "attention heads")
        kv_start, kv_end = tensor_parallel.kv_head_range(self.num_kv_heads)
        keep_output_rows(self.q_proj, q_start * size, q_end * size)
        keep_output_rows(self.k_proj, kv_start * size, kv_end * size)
        keep_output_rows(self.v_proj, kv_start * size, kv_end * size)
        keep_input_columns(self.o_proj, q_start * size, q_end * size, tensor_parallel.rank == 0)
        self.num_heads, self.num_kv_heads = q_end - q_start, kv_end - kv_start

    def fuse_weights(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.o_weight, self.o_bias = fuse_linears([self.o_proj])

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``qkv`` ``[tokens, heads + 2 * kv_heads, head_dim]``: q and k are rotated in place,
        then k and v (adjacent) go to the cache as one ``[tokens, 2, kv_heads, head_dim]``."""
        num_tokens = hidden.shape[0]
        qkv = add_lora(
            project(hidden, self.qkv_weight, self.qkv_bias), hidden, self.lora_layer, "qkv"
        )
        qkv = qkv.view(num_tokens, -1, self.head_dim)
        query_key = qkv[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3, Gemma 3: before RoPE
            query, key = query_key[:, : self.num_heads], query_key[:, self.num_heads :]
            query.copy_(self.q_norm.forward(query))
            key.copy_(self.k_norm.forward(key))
        apply_rotary(query_key, *rotary, out=query_key)
        key_value = qkv[:, self.num_heads :].view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        attended = paged_attention(
            qkv[:, : self.num_heads], key_value, kv_cache, layer, metadata, self.scale
        )
        attended = attended.reshape(num_tokens, -1)
        return add_lora(
            project(attended, self.o_weight, self.o_bias), attended, self.lora_layer, "o"
        )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention (grouped-query, or latent for DeepSeek), then the
    feed-forward: a dense MLP (``mlp``), or a mixture of experts on a model's sparse layers
    (under its checkpoint's name)."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config) if config.mla is None else MLAttention(config)
        moe = config.moe
        if moe is not None and index in moe.sparse_layers:
            self.feed_forward_name = moe.module_name
            setattr(self, moe.module_name, SparseMoE(config, moe))
        else:
            self.feed_forward_name = "mlp"
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tensor_parallel: TensorParallel | None = None
        mark_lora_layer(self, index)

    def shard(self, tensor_parallel: TensorParallel) -> None:
        """This rank's slice of attention and MLP; their outputs are summed over the ranks."""
        feed_forward = self.feed_forward
        if not isinstance(self.self_attn, LlamaAttention) or not isinstance(feed_forward, GatedMLP):
            raise ValueError(
                "tensor parallelism covers grouped-query attention and dense MLPs; "
                "latent attention and mixtures of experts run at tensor parallel size 1"
            )
        self.self_attn.shard(tensor_parallel)
        feed_forward.shard(tensor_parallel)
        self.tensor_parallel = tensor_parallel

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
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(attended)
        hidden = hidden + attended
        mixed = self.feed_forward.forward(self.post_attention_layernorm.forward(hidden))
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(mixed)
        return hidden + mixed

    @property
    def feed_forward(self) -> GatedMLP | SparseMoE:
        return cast("GatedMLP | SparseMoE", getattr(self, self.feed_forward_name))


def mark_lora_layer(layer: nn.Module, index: int) -> None:
    """Tells a decoder layer's dense attention and MLP their layer's index: the modules LoRA
    adapters may adapt (``model/lora/peft_adapter.py``); latent attention and experts keep
    -1."""
    for module in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
        if isinstance(module, LlamaAttention | GatedMLP):
            module.lora_layer = index


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.`` prefix)."""

    layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Uninitialised: every weight comes from a checkpoint (or tiny's seeded generator).
        # On ``meta``, Embedding's own normal_ init alone imports torch._dynamo: ≈ 2 s of
        # every worker's start.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.config = config
        self.layers = nn.ModuleList(
            self.layer_class(config, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.rotary_emb = RotaryEmbedding(config)
        self.tensor_parallel: TensorParallel | None = None

    def shard(self, tensor_parallel: TensorParallel) -> None:
        """Every layer's slice, and this rank's rows of the embedding."""
        for layer in cast("Iterable[LlamaDecoderLayer]", self.layers):
            layer.shard(tensor_parallel)
        start, end = tensor_parallel.vocab_range(self.config.vocab_size)
        packed = packed_weight(self.embed_tokens)
        if packed is not None:
            attach_packed_weight(self.embed_tokens, packed.take_rows(torch.arange(start, end)))
        else:
            self.embed_tokens.weight = nn.Parameter(
                self.embed_tokens.weight.detach()[start:end].clone(), False
            )
        self.tensor_parallel = tensor_parallel

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: StepAttention,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rotaries = self.layer_rotaries(positions, metadata.max_position, hidden.dtype)
        for index, (layer, rotary) in enumerate(zip(self.layers, rotaries)):
            group_metadata, slot = metadata.for_layer(index)
            hidden = layer.forward(hidden, rotary, kv_cache, slot, group_metadata)
        return self.norm.forward(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids' embeddings; sharded, each rank looks up the ids in its vocabulary rows
        (zeros for the others) and the ranks' rows are summed."""
        tensor_parallel = self.tensor_parallel
        if tensor_parallel is None:
            return embedding_rows(self.embed_tokens, input_ids)
        start, end = tensor_parallel.vocab_range(self.config.vocab_size)
        local = (input_ids >= start) & (input_ids < end)
        hidden = embedding_rows(self.embed_tokens, (input_ids - start) * local)
        hidden *= local[:, None].to(hidden.dtype)
        tensor_parallel.all_reduce(hidden)
        return hidden

    def layer_rotaries(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE ``(cos, signed sin)`` for the step: one for all of Llama's."""
        rotary = self.rotary_emb.forward(positions, max_position, dtype)
        return [rotary] * len(self.layers)


class LlamaForCausalLM(nn.Module):
    """Llama with its LM head; also serves Mistral (same structure, see ``mistral.py``).

    ``forward`` returns hidden states ``[num_tokens, hidden_size]``; call
    :meth:`compute_logits` on the rows that are sampled only, which skips the LM
    head for every other token of a prefill.
    """

    model_class: ClassVar[type[LlamaModel]] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.lm_head_weight: ProjectionWeight | None = None
        self.fused = False
        self.tensor_parallel: TensorParallel | None = None

    def shard(self, tensor_parallel: TensorParallel) -> None:
        """Keep rank ``tensor_parallel.rank``'s slice of every weight (module doc of
        ``model/tensor_parallel.py``); call before ``fuse_weights``."""
        self.model.shard(tensor_parallel)
        if self.config.tie_word_embeddings:
            self.tie_weights()
        else:
            start, end = tensor_parallel.vocab_range(self.config.vocab_size)
            keep_output_rows(self.lm_head, start, end)
        self.tensor_parallel = tensor_parallel

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            packed = packed_weight(self.model.embed_tokens)
            if packed is not None:
                attach_packed_weight(self.lm_head, packed)

    def packable_weights(self) -> set[str]:
        """Names of the weights the loader may give packed (``layers.py``): the embedding,
        the LM head, and the linears of grouped-query attention and dense MLPs, which run
        through ``project``. Latent attention's and experts' linears load as floats."""
        names = {"model.embed_tokens.weight", "lm_head.weight"}
        for name, module in self.named_modules():
            if isinstance(module, LlamaAttention | GatedMLP):
                names.update(
                    f"{name}.{child}.weight"
                    for child, linear in module.named_children()
                    if isinstance(linear, nn.Linear)
                )
        return names

    def fuse_weights(self) -> None:
        """Pack the projections for inference (module doc); call once the model is on its device.

        A tied LM head stays the embedding (``[vocab, hidden]``, used by ``linear``; a
        packed one by its own matmul). Once only: a second runner over the same model (a
        test's, a draft's) finds it fused, and packed parts are given up as they fuse."""
        if self.fused:
            return
        self.fused = True
        # nn.ModuleList yields plain Modules; these are the LlamaDecoderLayers LlamaModel built.
        for layer in cast("Iterable[LlamaDecoderLayer]", self.model.layers):
            layer.self_attn.fuse_weights()
            layer.feed_forward.fuse_weights()
        if not self.config.tie_word_embeddings:
            self.lm_head_weight, _ = fuse_linears([self.lm_head])
        else:
            self.lm_head_weight = packed_weight(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: StepAttention,
    ) -> torch.Tensor:
        return self.model.forward(input_ids, positions, kv_cache, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_weight is None:
            logits = self.lm_head.forward(hidden)
        else:
            logits = project(hidden, self.lm_head_weight, None)
        if self.tensor_parallel is None:
            return logits
        return self.tensor_parallel.gather_vocab(logits, self.config.vocab_size)
