"""Small random Hugging Face models saved to a folder: the references the engine's numerics
are checked against."""

from __future__ import annotations

import pytest
import tokenizers
import torch
import transformers

# Enough experts to route: a step's tokens spread over all of them, 2 picked per token.
QWEN3_MOE = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MIXTRAL = {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32}
# Latent attention (a 32-wide latent plus an 8-wide RoPE key per token) and DeepSeek's experts:
# a dense first layer, then 8 routed experts in 4 groups (2 groups allowed) plus a shared one.
DEEPSEEK = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
}
DEEPSEEK_V2 = {**DEEPSEEK, "q_lora_rank": None}
DEEPSEEK_V3 = {**DEEPSEEK, "q_lora_rank": 48}
# Gemma 3 with a window under the prompts and two kinds of layer: global at 2 and 5, local
# at 0 1 3 4 (three KV groups of two layers).
GEMMA3 = {
    "num_hidden_layers": 6,
    "head_dim": 16,
    "sliding_window": 12,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "query_pre_attn_scalar": 24,
    "initializer_range": 0.02,  # at 0.2 the scaled embedding drowns the rest: one token repeated
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
# One model of each way a decode step differs: plain GQA, QK norms, Gemma 3's windows and KV
# groups, experts, latent attention with experts (the static decode step's families).
DECODE_FAMILIES = [
    pytest.param(transformers.LlamaConfig, {}, id="llama"),
    pytest.param(transformers.Qwen3Config, {"head_dim": 32}, id="qwen3"),
    pytest.param(transformers.Gemma3TextConfig, GEMMA3, id="gemma3-windows"),
    pytest.param(transformers.MixtralConfig, MIXTRAL, id="mixtral-moe"),
    pytest.param(transformers.DeepseekV3Config, DEEPSEEK_V3, id="deepseek-v3-mla-moe"),
]
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=1,
    bos_token_id=0,
)


def save_hf_model(
    directory, config_class, seed: int = 0, random_biases: bool = False, **overrides
) -> transformers.PreTrainedModel:
    """A random HF model saved (with a tokenizer.json) in ``directory``, its weights drawn
    from ``seed``; returns the reference. transformers starts every bias at zero, where a
    bias the engine dropped changes nothing: ``random_biases`` draws them too."""
    config = config_class(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if random_biases:
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0.0, 0.5)
    reference.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w2"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return reference


def hf_greedy(
    reference: transformers.PreTrainedModel, prompt: list[int], num_tokens: int
) -> list[int]:
    """transformers' greedy tokens with its own cache, EOS ignored as ``ignore_eos`` does
    (``min_new_tokens`` would instead forbid EOS, which the engine may pick)."""
    config = reference.generation_config
    eos, config.eos_token_id = config.eos_token_id, None
    try:
        with torch.no_grad():
            output = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=num_tokens,
                do_sample=False,
            )
    finally:
        config.eos_token_id = eos
    return output[0, len(prompt) :].tolist()
