"""DeepSeek-V2 and V3: Llama's residual structure with latent attention and routed experts.

Every layer's attention is MLA (``mla.py``: the latent is what the KV cache holds); the
layers from ``first_k_dense_replace`` on replace the MLP with routed experts plus shared
ones (``moe.py``, routed as ``DeepSeekRouting`` says: V2 softmax, V3 sigmoid with a
correction bias and group-limited choice). The config parser sets both.
"""

from __future__ import annotations

from pdserve.model.architectures.llama import LlamaForCausalLM


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """Layers of MLA attention and (after the first dense ones) DeepSeek-V2's experts."""


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Layers of MLA attention (queries through a low-rank bottleneck) and V3's experts."""
