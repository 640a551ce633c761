"""Qwen2: the Llama structure with a bias on q/k/v (none on o_proj).

:class:`ModelConfig` carries the difference (``attention_bias=True``, ``o_proj_bias=False``
for this architecture), so the module tree and weight names are Llama's.
"""

from __future__ import annotations

from pdserve.model.architectures.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama layers built from a Qwen2 config (q/k/v bias set by the config parser)."""
