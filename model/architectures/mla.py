"""Multi-head latent attention (DeepSeek-V2/V3) over paged KV that holds the latent only.

Per token and layer the cache holds one row (``MLAConfig``), not K and V per head::

    hidden ─▶ kv_a_proj_with_mqa ─▶ | latent c (kv_lora_rank) | k_rope (qk_rope_head_dim) |
                                      └ RMSNorm                  └ RoPE (one key for all heads)
                                    = the cached row (576 values for V3, where GQA of the
                                      same 128 heads would cache 2 × 128 × 128)

so a block is a small fraction of a GQA block and the P/D hand-off moves that fraction.
Queries: ``q_proj`` (V2-Lite) or ``q_a_proj → RMSNorm → q_b_proj``; each head's query is
``| q_nope | q_rope |``, ``q_rope`` rotated like ``k_rope``.

Two forms of the same attention, as DeepSeek serves it:

* **A chunk starting the prompt, expanded.** Its own latents go through ``kv_b_proj`` into
  each head's ``k_nope`` and ``v``; keys are ``| k_nope | k_rope |``; one SDPA per chunk.
  Many queries share each expansion, and nothing is read from the pages.
* **Every query over cached rows (decodes, and chunks continuing a prefix), absorbed.**
  ``kv_b_proj`` splits per head into ``W_UK [nope, latent]`` and ``W_UV [v, latent]``.
  Since ``q_nope · (W_UK c) = (W_UKᵀ q_nope) · c``, each head's query becomes
  ``| W_UKᵀ q_nope | q_rope |`` and attends the cached rows in place (``split_kv.py``), as
  one shared KV head (MQA); the output, a latent, leaves through ``W_UV``. Nothing is
  copied out of the pages or expanded per key. On CUDA the rows are read by their own Triton
  kernel (``model/latent_decode_triton.py``: blocks of query heads, the row in its latent and
  RoPE parts), so a decode step over latent pages is captured in a CUDA graph too.

The softmax scale is ``1/sqrt(qk_nope + qk_rope)`` in both forms, times YaRN's
``mscale_all_dim`` correction squared when the context is stretched (DeepSeek's checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import latent_decode_triton
from pdserve.model.architectures.layers import RMSNorm, fuse_linears, project
from pdserve.model.architectures.rotary import (
    apply_rotary,
    apply_rotary_interleaved,
    yarn_factor,
    yarn_mscale,
)
from pdserve.model.attention import AttentionMetadata, fresh_keys_values, store_kv
from pdserve.model.model_config import ModelConfig
from pdserve.model.split_kv import SplitKVPlan, split_kv_attention


class MLAttention(nn.Module):
    """DeepSeek's attention under its checkpoint names (``self_attn.kv_a_proj_with_mqa`` ...)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture} has no MLA config")
        self.mla = mla
        self.num_heads = config.num_heads
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.scale = mla.qk_head_dim**-0.5
        scaling = config.rope_scaling or {}
        if scaling.get("mscale_all_dim"):  # YaRN stretches DeepSeek's softmax too
            factor = yarn_factor(scaling, config.max_position_embeddings)
            self.scale *= yarn_mscale(factor, scaling["mscale_all_dim"]) ** 2

    def fuse_weights(self) -> None:
        """The input projections that read ``hidden`` as one matmul (``[hidden, q | latent]``,
        q being the query or its low-rank bottleneck), and ``kv_b_proj`` both ways: whole
        for the prefill's expansion, split per head for the decode's absorbed form."""
        mla = self.mla
        first = self.q_proj if mla.q_lora_rank is None else self.q_a_proj
        self.in_weight, self.in_bias = fuse_linears([first, self.kv_a_proj_with_mqa])
        if mla.q_lora_rank is not None:
            self.q_b_weight, _ = fuse_linears([self.q_b_proj])
        self.kv_b_weight, _ = fuse_linears([self.kv_b_proj])
        per_head = self.kv_b_proj.weight.detach().view(
            self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
        )
        self.w_uk = per_head[:, : mla.qk_nope_head_dim].contiguous()  # [heads, nope, latent]
        self.w_uv_t = per_head[:, mla.qk_nope_head_dim :].transpose(1, 2).contiguous()
        self.o_weight, self.o_bias = fuse_linears([self.o_proj])

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        fused = project(hidden, self.in_weight, self.in_bias)
        query, compressed = fused[:, : -mla.latent_size], fused[:, -mla.latent_size :]
        if mla.q_lora_rank is not None:
            query = project(self.q_a_layernorm.forward(query), self.q_b_weight, None)
        query = query.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = query[..., : mla.qk_nope_head_dim], query[..., mla.qk_nope_head_dim :]
        rotate = apply_rotary_interleaved if mla.rope_interleave else _rotate_half_layout
        q_rope = rotate(q_rope, *rotary)
        # The cached row, [tokens, 1 entry, 1 head, latent_size].
        latent = torch.cat(
            (
                self.kv_a_layernorm.forward(compressed[:, : mla.kv_lora_rank])[:, None],
                rotate(compressed[:, None, mla.kv_lora_rank :], *rotary),
            ),
            dim=-1,
        )[:, None]
        store_kv(latent, kv_cache, layer, metadata)
        layer_cache = kv_cache[:, layer]
        output = hidden.new_empty(num_tokens, self.num_heads, mla.v_head_dim)
        for chunk in metadata.prefills:
            span = slice(chunk.query_start, chunk.query_end)
            if chunk.paged is None:
                rows, _ = fresh_keys_values(chunk, latent, layer_cache.dtype)
                output[span] = self._expanded(
                    torch.cat((q_nope[span], q_rope[span]), dim=-1), rows[:, 0], chunk.attn_mask
                )
            else:
                output[span] = self._absorbed(q_nope[span], q_rope[span], layer_cache, chunk.paged)
        decode = metadata.decode
        if decode is not None:
            span = slice(decode.query_start, num_tokens)
            output[span] = self._absorbed(q_nope[span], q_rope[span], layer_cache, decode)
        return project(output.reshape(num_tokens, -1), self.o_weight, self.o_bias)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: SplitKVPlan,
    ) -> torch.Tensor:
        """Queries over latent rows read in place from the pages (a decode batch, or a chunk
        continuing a prefix): ``w_uk`` folded into the query, ``w_uv`` applied to the
        attended latent, so no cached row is expanded per head; ``[q, heads, v]``."""
        absorbed = torch.cat(
            (torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1), q_rope), dim=-1
        )
        ranges = plan.device_key_ranges
        if ranges is not None and latent_decode_triton.serves(absorbed, layer_cache):
            latent_out = latent_decode_triton.latent_decode(
                absorbed, layer_cache, *ranges, self.scale, self.mla.kv_lora_rank
            )
        else:
            attended = split_kv_attention(absorbed, layer_cache, plan, self.scale)
            latent_out = attended[..., : self.mla.kv_lora_rank]
        return torch.bmm(latent_out.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _expanded(
        self, query: torch.Tensor, rows: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """A chunk starting the prompt: its queries ``[q, heads, qk]`` over keys and values
        expanded from its own latent rows ``[q, latent_size]``; ``[q, heads, v]``."""
        mla = self.mla
        expanded = project(rows[:, : mla.kv_lora_rank], self.kv_b_weight, None).view(
            rows.shape[0], self.num_heads, -1
        )
        k_rope = rows[:, None, mla.kv_lora_rank :].expand(-1, self.num_heads, -1)
        keys = torch.cat((expanded[..., : mla.qk_nope_head_dim], k_rope), dim=-1)
        values = expanded[..., mla.qk_nope_head_dim :]
        attended = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            scale=self.scale,
        )
        return attended[0].transpose(0, 1)


def _rotate_half_layout(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """RoPE over the two halves (a V3 config with ``rope_interleave: false``), out of place."""
    return apply_rotary(x, cos, signed_sin, out=torch.empty_like(x))
