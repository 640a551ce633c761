"""Prompt logprobs on a worker with a KV tier: every prompt position is computed, so each has
its logprob, even when the tier holds the prompt's evicted prefix.

Before the fix the scheduler skipped the pool's lookup for such a request but still asked
the connector; the tier loaded the prefix into ext_comp, those positions were never computed,
and their logprobs came back empty (0 of 100 with a cpu tier, 100 without).
"""

from __future__ import annotations

import random

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig

BLOCK_SIZE = 16
PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def test_prompt_logprobs_cover_every_position_of_a_prompt_the_tier_holds() -> None:
    connector = TierConnector(KVTierConfig(cpu_bytes=64 * PAGE_BYTES), "worker-0")
    engine = LLMEngine.from_pretrained(
        "tiny", connector=connector, num_kv_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=1
    )
    rng = random.Random(3)
    prompt_a = [rng.randrange(1, 500) for _ in range(100)]
    engine.generate([prompt_a], GREEDY)
    for _ in range(3):  # three other prompts push A's blocks out of the 15-block pool
        engine.generate([[rng.randrange(1, 500) for _ in range(100)]], GREEDY)
    assert any(tier.blocks_stored for tier in engine.stats().tiers), "A never reached the tier"

    with_logprobs = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1
    )
    output = engine.generate([prompt_a], with_logprobs)[0]

    # Position 0 has nothing before it (None, as in vLLM); every other one has its logprob.
    assert len(output.prompt_logprobs) == len(prompt_a)
    assert output.prompt_logprobs[0] is None
    missing = [i for i, lp in enumerate(output.prompt_logprobs[1:], 1) if lp is None]
    assert missing == []
    assert all(tier.blocks_loaded == 0 for tier in engine.stats().tiers)
