"""A prompt served from a KV tier is accounted as a tier hit: not a pull (nothing moved
between workers), counted in ``cached_tokens``, and every account adds up to the prompt.

Before the fix tier-loaded tokens landed in ``num_pulled_tokens`` (reported as vLLM's
``external_kv_transfer``), ``cached_tokens`` was 0 for a prompt served from the tier, and a
prefill worker's hit + computed no longer added up to its prompt.
"""

from __future__ import annotations

import random

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig

BLOCK_SIZE = 16
PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_a_prompt_loaded_from_the_tier_is_a_tier_hit_in_its_provenance_and_cached_tokens():
    connector = TierConnector(KVTierConfig(cpu_bytes=64 * PAGE_BYTES), "worker-0")
    engine = LLMEngine.from_pretrained(
        "tiny", connector=connector, num_kv_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=1
    )
    rng = random.Random(4)
    prompt_a = [rng.randrange(1, 500) for _ in range(100)]
    engine.generate([prompt_a], GREEDY)
    for _ in range(3):  # three other prompts push A's six full blocks out to the tier
        engine.generate([[rng.randrange(1, 500) for _ in range(100)]], GREEDY)

    output = engine.generate([prompt_a], GREEDY)[0]

    provenance = output.kv_provenance
    assert provenance.num_tier_tokens == 6 * BLOCK_SIZE
    assert provenance.num_pulled_tokens == 0 and provenance.num_blocks_pulled == 0
    assert (
        provenance.num_cache_hit_tokens
        + provenance.num_tier_tokens
        + provenance.num_pulled_tokens
        + provenance.num_recomputed_tokens
        + provenance.num_computed_tokens
        == len(prompt_a)
    )
    assert output.num_cached_tokens == provenance.num_cache_hit_tokens + provenance.num_tier_tokens
    engine.shutdown()
