"""A KV tier below a colocated engine's pool: real tiny-model engines, real files in tmp_path.

The pool (15 usable blocks of 16 tokens) holds one 7-block system prompt's request at a
time; four system prompts take turns, so without a tier every prompt is computed in full.
With a tier the evicted prefixes come back, and the tokens must not change.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from pdserve.engine import LLMEngine
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig
from tests.kvconnector.tier_workload import (
    BLOCK_SIZE,
    NUM_SYSTEMS,
    PAGE_BYTES,
    PARAMS,
    SYSTEM_TOKENS,
    workload,
)

ENGINE_KWARGS = dict(num_kv_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=1)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [engine.generate([prompt], PARAMS)[0].output_token_ids for prompt in prompts]


def tier_engine(config: KVTierConfig) -> LLMEngine:
    return LLMEngine.from_pretrained(
        "tiny", connector=TierConnector(config, "worker-0"), **ENGINE_KWARGS
    )


@pytest.fixture(scope="module")
def baseline() -> tuple[list[list[int]], int]:
    engine = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    outputs = run(engine, workload())
    return outputs, engine.stats().num_scheduled_tokens


def wait_for_writes(connector: TierConnector) -> None:
    disk = connector.store.levels[-1]
    while disk.num_queued():
        threading.Event().wait(0.01)


def tier_configs(tmp_path: Path) -> dict[str, KVTierConfig]:
    return {
        "cpu": KVTierConfig(cpu_bytes=64 * PAGE_BYTES),
        "disk": KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES),
        "cpu_over_disk_write_through": KVTierConfig(
            cpu_bytes=8 * PAGE_BYTES,
            disk_path=str(tmp_path),
            disk_bytes=64 * PAGE_BYTES,
            write_through=True,
        ),
    }


@pytest.mark.parametrize("kind", ["cpu", "disk", "cpu_over_disk_write_through"])
def test_evicted_prefixes_load_back_from_the_tier_with_the_same_tokens(baseline, tmp_path, kind):
    outputs, baseline_computed = baseline
    engine = tier_engine(tier_configs(tmp_path)[kind])
    assert run(engine, workload()) == outputs
    stats = engine.stats()
    tiers = {tier.medium: tier for tier in stats.tiers}
    loaded = sum(tier.blocks_loaded for tier in tiers.values())
    # The first round (4 requests) computes its system prompts; the next 8 load all six full
    # blocks of theirs (the 7th block holds the question) from the tier.
    assert loaded == 8 * (SYSTEM_TOKENS // BLOCK_SIZE)
    assert sum(t.hit_tokens for t in tiers.values()) == loaded * BLOCK_SIZE
    assert stats.num_scheduled_tokens == baseline_computed - loaded * BLOCK_SIZE
    assert all(t.load_failures == 0 and t.store_failures == 0 for t in tiers.values())
    assert stats.prefix_cache_hits == 0  # the pool alone never keeps a prefix that long
    engine.shutdown()


def test_a_tier_smaller_than_a_steps_offloads_keeps_the_pages_it_promised(baseline):
    """10 pages: an admission's allocation evicts pool blocks into the tier, and those
    offloads used to push out pages the same admission had just been promised (the load then
    found them gone and recomputed them: 18 hits counted, 14 blocks loaded). The promised
    pages are pinned from the lookup to the load's end; an offload takes another page."""
    outputs, _ = baseline
    engine = tier_engine(KVTierConfig(cpu_bytes=10 * PAGE_BYTES))
    try:
        assert run(engine, workload()) == outputs
        (tier,) = engine.stats().tiers
        assert tier.blocks_loaded * BLOCK_SIZE == tier.hit_tokens == 20 * BLOCK_SIZE
        assert tier.load_failures == 0
        assert not engine.connector.store.pins  # every load ended, every pin with it
    finally:
        engine.shutdown()


def test_a_corrupted_or_truncated_disk_page_is_recomputed_not_used(baseline, tmp_path):
    outputs, _ = baseline
    engine = tier_engine(tier_configs(tmp_path)["disk"])
    prompts = workload()
    assert run(engine, prompts[:NUM_SYSTEMS]) == outputs[:NUM_SYSTEMS]
    wait_for_writes(engine.connector)
    disk = engine.connector.store.levels[0]
    pages = sorted(disk.directory.glob("*.kv"))
    assert pages  # the evicted system prompts (the pool still holds the last one)
    for index, page in enumerate(pages):  # every page: corrupted (one bit) or truncated
        data = bytearray(page.read_bytes())
        if index % 2:
            data[123] ^= 0x01
            page.write_bytes(bytes(data))
        else:
            page.write_bytes(bytes(data[: PAGE_BYTES // 2]))
    assert run(engine, prompts[NUM_SYSTEMS:]) == outputs[NUM_SYSTEMS:]
    stats = engine.stats()
    (tier,) = stats.tiers
    # Each damaged prefix fails at its first page, is recomputed, and is not tried again.
    assert tier.load_failures == stats.num_recompute_fallbacks > 0
    assert len(list(disk.directory.glob("*.kv"))) <= len(pages) - tier.load_failures + (
        tier.blocks_stored - len(pages)
    )  # each page that failed was deleted
    engine.shutdown()


def test_after_drain_no_block_is_held_and_the_disk_holds_exactly_the_indexed_pages(tmp_path):
    engine = tier_engine(
        KVTierConfig(cpu_bytes=4 * PAGE_BYTES, disk_path=str(tmp_path), disk_bytes=10 * PAGE_BYTES)
    )
    run(engine, workload())
    wait_for_writes(engine.connector)
    assert engine.kv_cache_manager.get_num_free_blocks() == ENGINE_KWARGS["num_kv_blocks"] - 1
    assert not engine.has_unfinished_requests()
    assert not engine.connector.has_pending_loads()
    cpu, disk = engine.connector.store.levels
    assert cpu.num_pages() == 4 and disk.num_pages() == 10  # full, within budget
    on_disk = {path.stem for path in disk.directory.glob("*")}
    assert on_disk == {block_hash.hex() for block_hash in disk._index}
    engine.shutdown()
    assert not disk._writer.is_alive()


def test_a_restarted_disk_tier_starts_empty_and_deletes_the_old_pages(tmp_path):
    """A worker that died without closing its tier (killed) left its pages: the restarted
    one, on the same directory, deletes them (their checksums died with the old process)."""
    config = KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES)
    died = tier_engine(config)
    run(died, workload()[:NUM_SYSTEMS])
    wait_for_writes(died.connector)
    directory = died.connector.store.levels[0].directory
    assert list(directory.glob("*.kv"))
    restarted = tier_engine(config)  # the first never closed: its files are still there
    assert not directory.exists()  # its run, pages and all, is gone
    assert not list(restarted.connector.store.levels[0].directory.glob("*.kv"))
    assert restarted.stats().tiers[0].bytes_used == 0
    restarted.shutdown()
    died.shutdown()


def test_an_unusable_disk_path_is_a_clear_error_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="disk KV tier cannot use"):
        tier_engine(KVTierConfig(disk_path=str(blocker), disk_bytes=64 * PAGE_BYTES))
    missing = tmp_path / "missing" / "nested"
    engine = tier_engine(KVTierConfig(disk_path=str(missing), disk_bytes=64 * PAGE_BYTES))
    assert (missing / "worker-0").is_dir()  # a missing directory is created
    engine.shutdown()


def test_a_budget_below_one_page_is_a_clear_error_at_start():
    with pytest.raises(ValueError, match="holds no page"):
        tier_engine(KVTierConfig(cpu_bytes=PAGE_BYTES - 1))


def test_failed_writes_are_counted_store_failures_and_tokens_stay_right(baseline, tmp_path):
    """A disk that stops taking writes (here its directory is removed: the same OSError path
    as a full disk, which a test cannot make on a shared machine) never crashes the engine."""
    outputs, _ = baseline
    engine = tier_engine(tier_configs(tmp_path)["disk"])
    directory = engine.connector.store.levels[0].directory
    directory.rmdir()
    assert run(engine, workload()) == outputs
    wait_for_writes(engine.connector)
    (tier,) = engine.stats().tiers
    assert tier.store_failures > 0 and tier.blocks_stored == 0 and tier.blocks_loaded == 0
    engine.shutdown()


def test_windowed_and_mixed_kv_groups_are_served():
    """A tier keeps every group's pages under the pool's keys (hash and group): a windowed
    model and a mixed one attach (Gemma 3's loads: tests/engine/test_model_families.py)."""
    from pdserve.cache import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheManager,
        SlidingWindowSpec,
    )

    def manager(*specs) -> KVCacheManager:
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
        return KVCacheManager(KVCacheConfig(16, groups), max_model_len=256)

    sliding = SlidingWindowSpec(BLOCK_SIZE, 4, 64, "float32", sliding_window=32)
    full = FullAttentionSpec(BLOCK_SIZE, 4, 64, "float32")
    for accepted in (manager(full), manager(sliding), manager(full, sliding)):
        TierConnector(KVTierConfig(cpu_bytes=PAGE_BYTES), "w").attach_kv_cache_manager(accepted)
        assert accepted.block_pool.listener is not None


def test_two_tier_loads_landed_together_both_run_in_a_pool_that_holds_one():
    """Two prompts' prefixes load from the tier in one step (a load schedules no tokens, so
    ``max_num_seqs`` does not stop the second). Each landed load used to wait again holding
    only its loaded blocks, the pool then had room for neither's rest, and with nothing
    running to preempt the engine stalled for good. A load's admission now takes room for
    its whole prompt: the second waits for it, and both finish with the tokens of an engine
    without a tier."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(2, 500) for _ in range(n)]

    prefixes = [tokens(64) for _ in range(3)]
    evicting = [prefix + tokens(40) for prefix in prefixes]  # the first two go to the tier
    prompts = [prefixes[0] + tokens(40), prefixes[1] + tokens(40)]
    kwargs = dict(num_kv_blocks=10, block_size=BLOCK_SIZE, max_num_seqs=1)
    plain = LLMEngine.from_pretrained("tiny", **kwargs)
    expected = [plain.generate([p], PARAMS)[0].output_token_ids for p in prompts]
    engine = LLMEngine.from_pretrained(
        "tiny", connector=TierConnector(KVTierConfig(cpu_bytes=32 * PAGE_BYTES), "w"), **kwargs
    )
    try:
        engine.generate(evicting, PARAMS)
        for index, prompt in enumerate(prompts):
            engine.add_request(f"r{index}", prompt, PARAMS)
        outputs = {}
        for _ in range(100):  # a stalled engine steps forever: bounded here
            outputs |= {o.request_id: o.output_token_ids for o in engine.step() if o.finished}
            if not engine.has_unfinished_requests():
                break
        assert [outputs.get("r0"), outputs.get("r1")] == expected
        (tier,) = engine.stats().tiers
        assert tier.blocks_loaded == 2 * 4  # each prefix's four blocks came back
        assert engine.kv_cache_manager.get_num_free_blocks() == 10 - 1
    finally:
        engine.shutdown()
