"""Model architectures, looked up by the HF ``architectures`` name in ``config.json``.

Every architecture takes a :class:`ModelConfig`, has HF parameter names, and exposes
``forward(input_ids, positions, kv_cache, metadata) -> hidden`` and
``compute_logits(hidden) -> logits``.
"""

from __future__ import annotations

from torch import nn

from pdserve.model.architectures.llama import LlamaForCausalLM
from pdserve.model.architectures.mistral import MistralForCausalLM
from pdserve.model.architectures.qwen2 import Qwen2ForCausalLM
from pdserve.model.model_config import ModelConfig

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an HF architecture name; a clear error for any other."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def build_model(config: ModelConfig) -> nn.Module:
    """An uninitialised model of ``config``'s architecture (create it under a device context)."""
    return get_model_class(config.architecture)(config)


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "build_model",
    "get_model_class",
]
