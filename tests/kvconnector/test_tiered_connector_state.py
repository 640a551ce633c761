"""A P/D connector with a tier keeps no per-request state for requests that load nothing.

Before the fix ``TieredConnector`` noted each request's tier/pull split when the scheduler
asked how many tokens it could load, and forgot it only when a load was then allocated; a
tier miss with nothing to pull (every prompt a decode worker prefills itself, every tier miss
on a prefill worker) left one entry behind for good: 50 requests, 50 entries.
"""

from __future__ import annotations

import random

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.pd_with_tier import TieredConnector, with_tier
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_tier_config import KVTierConfig

PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32


def test_tier_misses_with_nothing_to_pull_leave_no_state_in_the_connector() -> None:
    pd = PDConnector(
        KVConnectorConfig(role="consumer"),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    connector = with_tier(pd, TierConnector(KVTierConfig(cpu_bytes=8 * PAGE_BYTES), "decode-0"))
    assert isinstance(connector, TieredConnector)
    engine = LLMEngine.from_pretrained(
        "tiny", connector=connector, num_kv_blocks=64, block_size=16, engine_id="decode-0"
    )
    rng = random.Random(5)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(20):  # distinct prompts, no params: each is a tier miss prefilled locally
        engine.generate([[rng.randrange(1, 500) for _ in range(40)]], params)
    assert connector._split == {}
    assert connector._loads == {}
    engine.shutdown()
