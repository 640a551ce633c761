"""A prompt the KV tier holds (evicted from the pool) served again: what its reply says.

- Prompt logprobs cover every position: such a request takes no cached KV from any source.
  Before the fix the scheduler skipped the pool's lookup for it but still asked the
  connector; the tier loaded the prefix into ext_comp, those positions were never computed,
  and their logprobs came back empty (0 of 100 with a cpu tier, 100 without).
- Otherwise it is a tier hit: not a pull (nothing moved between workers), counted in
  ``cached_tokens``, and every account adds up to the prompt. Before the fix tier-loaded
  tokens landed in ``num_pulled_tokens`` (vLLM's ``external_kv_transfer``) and
  ``cached_tokens`` was 0.

Real tiny-model engines with a real cpu tier.
"""

from __future__ import annotations

import random

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig

BLOCK_SIZE = 16
PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def engine_whose_tier_holds_a_prompt() -> tuple[LLMEngine, list[int]]:
    """A 15-block pool with a cpu tier, after a 100-token prompt and three others that push
    its six full blocks out of the pool into the tier."""
    connector = TierConnector(KVTierConfig(cpu_bytes=64 * PAGE_BYTES), "worker-0")
    engine = LLMEngine.from_pretrained(
        "tiny", connector=connector, num_kv_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=1
    )
    rng = random.Random(3)
    prompt = [rng.randrange(1, 500) for _ in range(100)]
    engine.generate([prompt], GREEDY)
    for _ in range(3):
        engine.generate([[rng.randrange(1, 500) for _ in range(100)]], GREEDY)
    assert any(tier.blocks_stored for tier in engine.stats().tiers), "nothing reached the tier"
    return engine, prompt


def test_prompt_logprobs_cover_every_position_of_a_prompt_the_tier_holds() -> None:
    engine, prompt = engine_whose_tier_holds_a_prompt()
    with_logprobs = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1
    )
    output = engine.generate([prompt], with_logprobs)[0]

    # Position 0 has nothing before it (None, as in vLLM); every other one has its logprob.
    assert len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    missing = [i for i, lp in enumerate(output.prompt_logprobs[1:], 1) if lp is None]
    assert missing == []
    assert all(tier.blocks_loaded == 0 for tier in engine.stats().tiers)
    engine.shutdown()


def test_a_prompt_loaded_from_the_tier_is_a_tier_hit_in_its_provenance_and_cached_tokens():
    engine, prompt = engine_whose_tier_holds_a_prompt()
    output = engine.generate([prompt], GREEDY)[0]

    provenance = output.kv_provenance
    assert provenance.num_tier_tokens == 6 * BLOCK_SIZE
    assert provenance.num_pulled_tokens == 0 and provenance.num_blocks_pulled == 0
    assert (
        provenance.num_cache_hit_tokens
        + provenance.num_tier_tokens
        + provenance.num_pulled_tokens
        + provenance.num_recomputed_tokens
        + provenance.num_computed_tokens
        == len(prompt)
    )
    assert output.num_cached_tokens == provenance.num_cache_hit_tokens + provenance.num_tier_tokens
    engine.shutdown()
