"""The built-in model ``tiny``: a small Llama whose weights come from a fixed seed.

It needs no download and is bit-identical in every process on every machine (with
the same torch build): weights are drawn on the CPU from one ``torch.Generator``
seeded with :data:`TINY_SEED`, parameter by parameter in the model's fixed
``named_parameters`` order. Tests and the disaggregated/colocated comparisons rely on
that: a prefill worker and a decode worker built separately hold the same model.
"""

from __future__ import annotations

import torch

from pdserve.model.architectures import CausalLM, build_model
from pdserve.model.model_config import ModelConfig
from pdserve.tokenizer.tokenizer import ByteTokenizer

TINY_SEED = 20240611
# Projections drawn wide enough that attention and MLP shape the residual stream
# (at std 0.02 the embedding dominates and greedy output falls into a short cycle),
# embedding and LM head so that logits are peaked but sampling still varies.
_INIT_STD = 0.08
_EMBEDDING_STD = 0.3


def tiny_model_config() -> ModelConfig:
    """4 layers, hidden 256, 4 query heads over 2 KV heads (GQA), 512 ids (bytes + specials)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32_768,  # rotary: long-context tests and benches need no weights
        eos_token_ids=[ByteTokenizer.NUM_BYTES],
    )


def build_tiny_model(
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """The ``tiny`` model, weights generated in float32 on the CPU, then cast and moved."""
    config = tiny_model_config()
    with torch.device("cpu"):
        model = build_model(config)
    generator = torch.Generator(device="cpu").manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
                continue
            std = (
                _EMBEDDING_STD
                if name in ("model.embed_tokens.weight", "lm_head.weight")
                else _INIT_STD
            )
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model.to(device=device, dtype=dtype).eval()
