"""Every supported architecture, end to end in the engine: greedy tokens equal transformers'.

A small random model of each family, saved by transformers to a temp directory, runs through
``LLMEngine.from_pretrained(dir)`` with a chunk budget smaller than its prompts (chunked
prefill) and then again on the same prompts (prefix-cache hits): 32 greedy tokens each time
equal transformers' ``generate`` with its own cache. README's architecture table points here.
"""

from __future__ import annotations

import random

import pytest
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig
from tests.engine.hf_models import (
    DEEPSEEK_V2,
    DEEPSEEK_V3,
    GEMMA3,
    MIXTRAL,
    QWEN3_MOE,
    hf_greedy,
    save_hf_model,
)

# DeepSeek's long-context RoPE, stretched 4x from a 64-token original context (the prompts
# reach past it); its mscale_all_dim also scales the softmax.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
FAMILIES = [
    pytest.param(transformers.LlamaConfig, {}, id="llama"),
    pytest.param(transformers.Qwen2Config, {}, id="qwen2"),
    pytest.param(transformers.Qwen3Config, {"head_dim": 32}, id="qwen3"),
    pytest.param(transformers.MistralConfig, {"sliding_window": 24}, id="mistral-window-24"),
    pytest.param(
        transformers.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
        id="qwen2-full-then-windowed",
    ),
    pytest.param(transformers.Gemma3TextConfig, GEMMA3, id="gemma3-local-global"),
    pytest.param(transformers.Qwen3MoeConfig, QWEN3_MOE, id="qwen3-moe"),
    pytest.param(
        transformers.Qwen3MoeConfig,
        {**QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [0]},
        id="qwen3-moe-renormalised-dense-first",
    ),
    pytest.param(transformers.MixtralConfig, MIXTRAL, id="mixtral"),
    pytest.param(transformers.DeepseekV2Config, DEEPSEEK_V2, id="deepseek-v2-lite"),
    pytest.param(
        transformers.DeepseekV2Config,
        {**DEEPSEEK_V2, "topk_method": "group_limited_greedy"},
        id="deepseek-v2-group-limited",
    ),
    pytest.param(transformers.DeepseekV3Config, DEEPSEEK_V3, id="deepseek-v3"),
    pytest.param(
        transformers.DeepseekV3Config,
        {**DEEPSEEK_V3, "rope_interleave": False},
        id="deepseek-v3-rope-halves",
    ),
    pytest.param(
        transformers.DeepseekV2Config,
        {**DEEPSEEK_V2, "rope_parameters": YARN},
        id="deepseek-v2-yarn-mscale",
    ),
    pytest.param(
        transformers.Qwen2Config,
        {"rope_parameters": {k: v for k, v in YARN.items() if not k.startswith("mscale")}},
        id="qwen2-yarn-attention-factor",
    ),
]
NEW_TOKENS = 32


@pytest.mark.parametrize("config_class, overrides", FAMILIES)
def test_chunked_and_prefix_hit_greedy_tokens_equal_transformers(
    tmp_path, config_class, overrides
) -> None:
    reference = save_hf_model(tmp_path, config_class, **overrides)
    engine = LLMEngine.from_pretrained(
        str(tmp_path), block_size=8, num_kv_blocks=128, max_num_batched_tokens=24
    )
    rng = random.Random(3)
    shared = [rng.randrange(2, 96) for _ in range(30)]
    prompts = [shared + [rng.randrange(2, 96) for _ in range(n)] for n in (5, 19, 41)]
    expected = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cold = engine.generate(prompts, params)
    warm = engine.generate(prompts, params)
    assert [o.output_token_ids for o in cold] == expected
    assert [o.output_token_ids for o in warm] == expected
    assert all(o.num_cached_tokens >= len(shared) // 8 * 8 for o in warm)


def test_a_kv_tier_under_a_model_of_several_kv_groups_is_refused_by_name(tmp_path) -> None:
    """The tier stores one group's blocks; Gemma 3's windowed groups would load as garbage."""
    save_hf_model(tmp_path, transformers.Gemma3TextConfig, **GEMMA3)
    tier = TierConnector(KVTierConfig(cpu_bytes=1 << 20), "worker-0")
    with pytest.raises(ValueError, match="a KV tier keeps one full-attention KV cache group"):
        LLMEngine.from_pretrained(str(tmp_path), connector=tier, block_size=8, num_kv_blocks=64)
