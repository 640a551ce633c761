"""Qwen3: the Llama structure with each query and key head RMS-normed before RoPE.

:class:`ModelConfig` carries the difference (``qk_norm=True``, weights
``self_attn.q_norm.weight`` / ``k_norm.weight`` of ``head_dim``; no q/k/v bias unless the
config sets ``attention_bias``, and then on ``o_proj`` too), so the rest is Llama's.
"""

from __future__ import annotations

from pdserve.model.architectures.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama layers built from a Qwen3 config (q/k norms set by the config parser)."""
