"""Model architectures, looked up by the HF ``architectures`` name in ``config.json``.

Every architecture takes a :class:`ModelConfig`, has HF parameter names, and exposes
``forward(input_ids, positions, kv_cache, metadata) -> hidden`` and
``compute_logits(hidden) -> logits``.

Each is a Llama variant (a subclass of ``LlamaForCausalLM``), so ``CausalLM`` names that
class as the type the loaders return and the engine runs.
"""

from __future__ import annotations

from pdserve.model.architectures.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pdserve.model.architectures.gemma3 import Gemma3ForCausalLM
from pdserve.model.architectures.llama import LlamaForCausalLM
from pdserve.model.architectures.mistral import MistralForCausalLM
from pdserve.model.architectures.moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM
from pdserve.model.architectures.qwen2 import Qwen2ForCausalLM
from pdserve.model.architectures.qwen3 import Qwen3ForCausalLM
from pdserve.model.model_config import ModelConfig

CausalLM = LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class for an HF architecture name; a clear error for any other."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None


def build_model(config: ModelConfig) -> CausalLM:
    """An uninitialised model of ``config``'s architecture (create it under a device context)."""
    return get_model_class(config.architecture)(config)


__all__ = [
    "MODEL_REGISTRY",
    "CausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "build_model",
    "get_model_class",
]
