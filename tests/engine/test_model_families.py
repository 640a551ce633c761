"""Every supported architecture, end to end in the engine: greedy tokens equal transformers'.

A small random model of each family, saved by transformers to a temp directory, runs through
``LLMEngine.from_pretrained(dir)`` with a chunk budget smaller than its prompts (chunked
prefill) and then again on the same prompts (prefix-cache hits): 32 greedy tokens each time
equal transformers' ``generate`` with its own cache; the families whose checkpoints carry
biases, again with every bias drawn at random (transformers starts them at zero). README's
architecture table points here.
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


# Families whose checkpoints carry biases, each drawn at random.
BIASED = [
    pytest.param(transformers.Qwen2Config, {}, id="qwen2-qkv"),
    pytest.param(transformers.LlamaConfig, {"attention_bias": True}, id="llama-qkvo"),
    # V2-Lite's q_proj has no bias and is fused with kv_a_proj_with_mqa, which has one.
    pytest.param(
        transformers.DeepseekV2Config,
        {**DEEPSEEK_V2, "attention_bias": True},
        id="deepseek-v2-lite",
    ),
    pytest.param(
        transformers.DeepseekV3Config, {**DEEPSEEK_V3, "attention_bias": True}, id="deepseek-v3"
    ),
]


@pytest.mark.parametrize("config_class, overrides", FAMILIES)
def test_chunked_and_prefix_hit_greedy_tokens_equal_transformers(
    tmp_path, config_class, overrides
) -> None:
    assert_greedy_tokens_equal(tmp_path, save_hf_model(tmp_path, config_class, **overrides))


@pytest.mark.parametrize("config_class, overrides", BIASED)
def test_every_checkpoint_bias_reaches_the_engine(tmp_path, config_class, overrides) -> None:
    """A bias the engine dropped (V2-Lite's fused input projection lost its latent part's)
    changes the tokens only where the checkpoint's biases are not zero."""
    reference = save_hf_model(tmp_path, config_class, random_biases=True, **overrides)
    assert_greedy_tokens_equal(tmp_path, reference)


def assert_greedy_tokens_equal(tmp_path, reference) -> None:
    """Chunked prefills, then prefix hits: 32 greedy tokens each equal transformers'."""
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


def test_evicted_prefixes_of_every_kv_group_load_back_from_a_kv_tier(tmp_path) -> None:
    """Gemma 3 (a global group, two windowed ones) in a pool that holds one request at a
    time, four system prompts taking turns: the tier brings each group's evicted blocks back
    (the windowed groups only the window's), and the tokens are an engine's without a tier."""
    save_hf_model(tmp_path, transformers.Gemma3TextConfig, **GEMMA3)
    rng = random.Random(0)
    systems = [[rng.randrange(2, 96) for _ in range(96)] for _ in range(4)]
    prompts = [systems[i % 4] + [rng.randrange(2, 96) for _ in range(8)] for i in range(12)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine_kwargs = dict(block_size=16, num_kv_blocks=16, max_num_seqs=1, max_num_batched_tokens=32)
    plain = LLMEngine.from_pretrained(str(tmp_path), **engine_kwargs)
    expected = [plain.generate([prompt], params)[0].output_token_ids for prompt in prompts]
    tier = TierConnector(KVTierConfig(cpu_bytes=1 << 22), "worker-0")
    engine = LLMEngine.from_pretrained(str(tmp_path), connector=tier, **engine_kwargs)
    assert [engine.generate([p], params)[0].output_token_ids for p in prompts] == expected
    (stats,) = engine.stats().tiers
    groups = engine.model_config.kv_layer_groups
    windowed_groups = sum(engine.model_config.is_windowed(layers[0]) for layers in groups)
    full_groups = len(groups) - windowed_groups
    # The 8 later prompts load their 6 system blocks: every one in a full group, and in a
    # windowed group (window 12 < 16) only the last one, the block the next token reads.
    assert stats.blocks_loaded == 8 * (6 * full_groups + windowed_groups)
    assert stats.hit_tokens == 8 * 6 * 16 and stats.load_failures == 0
    assert engine.stats().num_scheduled_tokens == plain.stats().num_scheduled_tokens - 8 * 96
