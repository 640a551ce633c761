"""A 16-bit KV cache under a float32 model: half the bytes, the same tokens.

The model computes in float32; K and V are stored (and read back) in float16 or bfloat16.
float16's 10-bit mantissa keeps greedy tokens equal to transformers' float32 ones on these
models; bfloat16's 7 bits move logits by up to a few hundredths, so its check is on the
logits. Every read sees the cache's precision (model/attention.py: ``as_stored``), so a
prompt gives the same tokens in one chunk, in many, or from the prefix cache.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pdserve.engine import LLMEngine, SamplingParams
from tests.engine.hf_models import hf_greedy, save_hf_model

NEW_TOKENS = 24


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 96) for _ in range(rng.randrange(20, 120))] for _ in range(count)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    return directory, save_hf_model(directory, transformers.LlamaConfig)


def test_float16_kv_halves_the_pages_and_greedy_tokens_equal_transformers(llama) -> None:
    directory, reference = llama
    engine = LLMEngine.from_pretrained(str(directory), kv_cache_dtype="float16", block_size=16)
    wide = LLMEngine.from_pretrained(str(directory), block_size=16)
    assert engine.runner.kv_cache.dtype == torch.float16
    assert engine.runner.kv_cache[0].nbytes * 2 == wide.runner.kv_cache[0].nbytes
    [group] = engine.kv_cache_manager.coordinator.kv_cache_config.kv_cache_groups
    assert group.kv_cache_spec.dtype == "float16"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    batch = prompts(4)
    for prompt, output in zip(batch, engine.generate(batch, params)):
        assert output.output_token_ids == hf_greedy(reference, prompt, NEW_TOKENS)


def test_bfloat16_kv_logprobs_stay_near_the_float32_caches(llama) -> None:
    directory, _ = llama
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    batch = prompts(3, seed=6)
    narrow = LLMEngine.from_pretrained(str(directory), kv_cache_dtype="bfloat16")
    wide = LLMEngine.from_pretrained(str(directory))
    for ours, theirs in zip(narrow.generate(batch, params), wide.generate(batch, params)):
        first = ours.output_token_ids[0]
        assert first == theirs.output_token_ids[0]
        assert ours.output_logprobs[0].logprob == pytest.approx(
            theirs.output_logprobs[0].logprob, abs=0.05
        )


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_one_chunk_many_chunks_and_a_prefix_hit_give_the_same_tokens(llama, kv_cache_dtype):
    directory, _ = llama
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = prompts(1, seed=8)[0] + prompts(1, seed=9)[0]
    whole = LLMEngine.from_pretrained(str(directory), kv_cache_dtype=kv_cache_dtype)
    chunked = LLMEngine.from_pretrained(
        str(directory), kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16
    )
    [cold] = whole.generate([prompt], params)
    [hit] = whole.generate([prompt], params)
    [in_chunks] = chunked.generate([prompt], params)
    assert hit.num_cached_tokens > 0
    assert cold.output_token_ids == hit.output_token_ids == in_chunks.output_token_ids
    # Without every read rounded alike these differ by 1e-3 (float16) to 1e-2 (bfloat16).
    for other in (hit, in_chunks):
        for ours, theirs in zip(cold.output_logprobs, other.output_logprobs):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)


def test_an_unknown_kv_cache_dtype_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine.from_pretrained("tiny", kv_cache_dtype="float8")
