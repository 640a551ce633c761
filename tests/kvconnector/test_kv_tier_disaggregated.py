"""A decode engine with a KV tier: pool, then tier, then a pull from a real prefill process.

The decode pool is too small to keep the four system prompts; with a cpu tier the evicted
ones load back from host memory and only the rest is pulled. Every block is either pulled or
loaded, never both, so the two runs must add up exactly, and the tokens must not change.
"""

from __future__ import annotations

import threading

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.pd_with_tier import with_tier
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_tier_config import KVTierConfig
from tests.kvconnector.prefill_engine_process import PrefillProcess, PrefillSpec
from tests.kvconnector.tier_workload import BLOCK_SIZE, PAGE_BYTES, PARAMS, workload

DECODE_KWARGS = dict(num_kv_blocks=16, block_size=BLOCK_SIZE, max_num_batched_tokens=512)


def decode_engine(tier: KVTierConfig | None) -> LLMEngine:
    pd = PDConnector(
        KVConnectorConfig(role="consumer"),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    connector = with_tier(pd, TierConnector(tier, "decode-0") if tier else None)
    return LLMEngine.from_pretrained(
        "tiny", connector=connector, engine_id="decode-0", **DECODE_KWARGS
    )


def run_disaggregated(prefill: PrefillProcess, engine: LLMEngine, tag: str) -> list[list[int]]:
    outputs = []
    for index, prompt in enumerate(workload()):
        request_id = f"{tag}-{index}"
        first = prefill.prefill(
            request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        )
        engine.add_request(request_id, prompt, PARAMS, kv_transfer_params=first.kv_transfer_params)
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
            if done:
                outputs.append(done[0].output_token_ids)
    return outputs


def test_decode_loads_from_its_tier_first_and_pulls_only_the_rest():
    colocated = LLMEngine.from_pretrained("tiny", **DECODE_KWARGS)
    expected = [colocated.generate([p], PARAMS)[0].output_token_ids for p in workload()]
    prefill = PrefillProcess(PrefillSpec())
    try:
        without = decode_engine(None)
        assert run_disaggregated(prefill, without, "plain") == expected
        with_cpu = decode_engine(KVTierConfig(cpu_bytes=64 * PAGE_BYTES))
        assert run_disaggregated(prefill, with_cpu, "tier") == expected
        plain, tiered = without.stats(), with_cpu.stats()
        (tier,) = tiered.tiers
        assert tier.blocks_loaded > 0 and tier.load_failures == 0
        assert (
            tiered.transfer.num_blocks_received + tier.blocks_loaded
            == plain.transfer.num_blocks_received
        )
        assert tiered.num_scheduled_tokens == plain.num_scheduled_tokens  # nothing recomputed
        for engine in (without, with_cpu):
            assert (
                engine.kv_cache_manager.get_num_free_blocks() == DECODE_KWARGS["num_kv_blocks"] - 1
            )
            engine.shutdown()
        assert prefill.wait_until_idle().num_leases == 0  # every lease released
    finally:
        prefill.close()


def test_an_engine_that_fails_as_its_connector_registers_leaves_no_tier_behind(tmp_path):
    """The tier registers before the P/D part, which refuses (its hash seed is no integer):
    the disk tier's writer thread and run directory, started as it registered, used to outlive
    the failed engine, its directory never deleted."""
    pd = PDConnector(
        KVConnectorConfig(role="consumer"),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed="not-an-integer",
    )
    tier = TierConnector(KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES), "d-0")
    threads_before = set(threading.enumerate())
    with pytest.raises(ValueError, match="integer hash_seed"):
        LLMEngine.from_pretrained("tiny", connector=with_tier(pd, tier), **DECODE_KWARGS)
    assert tier.store is not None  # it had registered: a run directory and a writer
    assert not (tmp_path / "d-0").exists()
    assert not {t for t in set(threading.enumerate()) - threads_before if t.is_alive()}


def test_a_failed_engine_whose_connector_also_fails_to_stop_reports_why_it_failed(monkeypatch):
    """The stop's error is logged; the caller gets the error that failed the engine."""
    pd = PDConnector(
        KVConnectorConfig(role="consumer"),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed="not-an-integer",
    )

    def fail() -> None:  # stands in for a connector whose stop raises
        raise RuntimeError("the connector failed to stop")

    monkeypatch.setattr(pd, "shutdown", fail)
    with pytest.raises(ValueError, match="integer hash_seed"):
        LLMEngine.from_pretrained("tiny", connector=pd, **DECODE_KWARGS)
