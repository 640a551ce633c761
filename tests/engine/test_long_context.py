"""Long prompts (2k and 8k tokens) through chunked prefill and split-KV decode equal
transformers token for token.

The prompts run as one batch of unequal lengths, so the decode reads its pages in several
chunks (the CPU budget of model/split_kv.py over these heads is 12,288 keys for the
whole batch: 256 blocks per row at batch 3), with padded rows and rows that see nothing of
the last chunks. A windowed model checks that the window still holds 8k tokens on.
"""

from __future__ import annotations

import random

import pytest
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from tests.engine.hf_models import hf_greedy, save_hf_model

NEW_TOKENS = 6
LONG_CONFIGS = [
    pytest.param(transformers.LlamaConfig, {}, id="llama"),
    pytest.param(transformers.MistralConfig, {"sliding_window": 1000}, id="mistral-window-1000"),
]


@pytest.mark.parametrize("config_class, overrides", LONG_CONFIGS)
def test_2k_and_8k_prompts_in_one_batch_equal_transformers(tmp_path, config_class, overrides):
    reference = save_hf_model(tmp_path, config_class, max_position_embeddings=8448, **overrides)
    engine = LLMEngine.from_pretrained(
        str(tmp_path), block_size=16, num_kv_blocks=1024, max_num_batched_tokens=1024
    )
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (8180, 2048, 700)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        assert output.output_token_ids == hf_greedy(reference, prompt, NEW_TOKENS)
    assert engine.kv_cache_manager.usage == 0.0
