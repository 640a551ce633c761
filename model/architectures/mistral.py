"""Mistral: structurally Llama; its sliding window lives in :class:`ModelConfig`.

The runner reads ``config.sliding_window`` and masks keys with
``query_pos - key_pos >= sliding_window``, as transformers does.
"""

from __future__ import annotations

from pdserve.model.architectures.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama layers built from a Mistral config."""
