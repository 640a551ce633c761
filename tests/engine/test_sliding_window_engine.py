"""Models with a sliding window run through a sliding-window KV cache group.

Blocks wholly before the window leave the request (the null block takes their place)
and return to the pool, yet greedy generation far past the window equals transformers'.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdserve.cache import SlidingWindowSpec
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.model.model_config import ModelConfig
from tests.engine.hf_models import GEMMA3, save_hf_model

WINDOW = 8
BLOCK_SIZE = 4
WINDOWED_CONFIGS = [
    pytest.param(transformers.MistralConfig, {"sliding_window": WINDOW}, id="mistral"),
    pytest.param(
        transformers.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0},
        id="qwen2",
    ),
]


def reference_greedy(reference, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens, one full forward per token (its window mask, no EOS stop)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("config_class, overrides", WINDOWED_CONFIGS)
def test_greedy_generation_past_the_window_equals_transformers(tmp_path, config_class, overrides):
    reference = save_hf_model(tmp_path, config_class, **overrides)
    engine = LLMEngine.from_pretrained(
        str(tmp_path), block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_batched_tokens=64
    )
    [group] = engine.kv_cache_manager.coordinator.kv_cache_config.kv_cache_groups
    assert group.kv_cache_spec == SlidingWindowSpec(
        BLOCK_SIZE, 2, 16, "float32", sliding_window=WINDOW
    )
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 96) for _ in range(length)] for length in (5, 13)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("probe", prompts[1], params)
    for _ in range(6):
        engine.step()
    probe = engine.scheduler.requests["probe"]
    table = engine.kv_cache_manager.get_block_ids(probe)[0]
    assert table[0] == 0 and table[-1] != 0, "blocks before the window were not released"
    while engine.has_unfinished_requests():
        engine.step()
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert output.output_token_ids == reference_greedy(reference, prompt, 24)
    assert engine.kv_cache_manager.usage == 0.0


def test_qwen2_mixing_full_and_windowed_layers_makes_one_kv_group_of_each():
    """Layers below max_window_layers attend fully, the rest within the window: a full group
    and a windowed one of as many layers (greedy tokens: test_model_families.py)."""
    config = transformers.Qwen2Config(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
        architectures=["Qwen2ForCausalLM"],
    ).to_dict()
    parsed = ModelConfig.from_hf_config(config)
    assert (parsed.sliding_window, parsed.full_attention_layers) == (WINDOW, (0, 1))
    assert parsed.kv_layer_groups == ((0, 1), (2, 3))


def test_qwen2_without_use_sliding_window_is_full_attention():
    config = transformers.Qwen2Config(
        num_hidden_layers=2,
        use_sliding_window=False,
        sliding_window=WINDOW,
        architectures=["Qwen2ForCausalLM"],
    )
    assert ModelConfig.from_hf_config(config.to_dict()).sliding_window is None


def test_a_windowed_models_longest_prompt_fits_its_pool_and_a_longer_one_is_refused(tmp_path):
    """Gemma 3's global and windowed layers take blocks from one pool, each group its own:
    max_model_len counts them all (a window's as much as one chunk reads), so a prompt of
    max_model_len tokens runs to its end, and a longer one is refused at once. Counted by
    the single group's blocks alone, 250 tokens were accepted into a 20-block pool and
    preempted themselves for ever."""
    save_hf_model(tmp_path, transformers.Gemma3TextConfig, **GEMMA3)
    engine = LLMEngine.from_pretrained(
        str(tmp_path), block_size=16, num_kv_blocks=20, max_num_batched_tokens=64
    )
    assert len(engine.kv_cache_manager.coordinator.single_type_managers) == 3
    assert engine.max_model_len < 19 * 16
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.add_request("long", [2] * (engine.max_model_len + 1), params)
    prompt = [random.Random(7).randrange(2, 90) for _ in range(engine.max_model_len)]
    engine.add_request("fits", prompt, params)
    for _ in range(64):  # 112 tokens in 64-token chunks: a few steps, never a loop
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_preemptions == 0
    assert engine.kv_cache_manager.usage == 0.0
