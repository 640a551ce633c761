"""The mixture-of-experts families: Llama's structure with ``ModelConfig.moe`` set.

Qwen3-MoE is Qwen3 (q/k norms) with experts under ``mlp``; Mixtral is Mistral (a window on
every layer when set) with experts under ``block_sparse_moe``. The config parser fills
``MoEConfig`` (names, renormalisation, which layers are sparse); ``moe.py`` computes them.
"""

from __future__ import annotations

from pdserve.model.architectures.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 layers whose feed-forward is a mixture of experts."""


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral layers whose feed-forward is a mixture of experts."""
