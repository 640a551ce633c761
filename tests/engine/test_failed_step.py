"""A step that fails leaves nothing wrong behind: no hash of a block it never wrote, in the
pool, in the router's events or in a KV tier.

The failure is injected (``ModelRunner.execute`` raises once, as a CUDA error or an engine
bug would); everything else is real: the tiny model, the ledger, a write-through cpu tier.
Before the fix ``allocate_slots`` had cached the prompt's six full blocks before the forward,
``abort_all`` freed them with their hashes, and the same prompt afterwards hit them (96
cached tokens of garbage) and returned other tokens.
"""

from __future__ import annotations

import random

import pytest

from pdserve.cache import BlockHasher, BlockStored
from pdserve.cache.kv_cache_block import make_block_hash_with_group_id
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig

BLOCK_SIZE = 16
PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
ENGINE_KWARGS = dict(num_kv_blocks=64, block_size=BLOCK_SIZE, publish_kv_events=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(100)]


def fail_next_forward(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_execute = engine.runner.execute

    def execute_once_failing(chunks):
        monkeypatch.setattr(engine.runner, "execute", real_execute)
        raise RuntimeError("injected: the forward failed")

    monkeypatch.setattr(engine.runner, "execute", execute_once_failing)


def stored_hashes(events) -> set[bytes]:
    return {h for event in events if isinstance(event, BlockStored) for h in event.block_hashes}


@pytest.mark.parametrize("tier", [None, "cpu_write_through"])
def test_after_a_failed_step_the_same_prompt_equals_a_fresh_engine_and_no_one_saw_its_hashes(
    tier: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    connector = (
        TierConnector(KVTierConfig(cpu_bytes=64 * PAGE_BYTES, write_through=True), "worker-0")
        if tier
        else None
    )
    engine = LLMEngine.from_pretrained("tiny", connector=connector, **ENGINE_KWARGS)
    failed_prompt = prompt(1)
    hashes = set(BlockHasher("xxh3_128", 0).hash_request_blocks(failed_prompt, BLOCK_SIZE))
    assert len(hashes) == 6

    fail_next_forward(engine, monkeypatch)
    engine.add_request("failing", failed_prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.abort_all() == ["failing"]
    # Another prompt runs whole (its steps save write-through pages and publish events).
    engine.generate([prompt(2)], GREEDY)

    events = engine.take_kv_events()
    assert not stored_hashes(events) & hashes, "the router would have heard of garbage blocks"
    other = BlockHasher("xxh3_128", 0).hash_request_blocks(prompt(2), BLOCK_SIZE)
    assert set(other) <= stored_hashes(events), "events of the steps that worked still flow"
    if connector is not None:
        keys = {make_block_hash_with_group_id(h, 0) for h in hashes}
        assert all(connector.store.level_holding(key) is None for key in keys)
        assert not stored_hashes(connector.take_events()) & hashes

    again = engine.generate([failed_prompt], GREEDY)[0]
    fresh = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS).generate([failed_prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0
    assert again.output_token_ids == fresh.output_token_ids
    engine.shutdown()
