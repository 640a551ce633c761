"""The router: longest cached prefix for prefill; for decode, fewest blocks to pull for the
load; then load."""

from __future__ import annotations

import pytest

from pdserve.cache import AllBlocksCleared, BlockRemoved, BlockStored, HeldBlocks
from pdserve.gateway.router import NoWorkerAvailable, Router
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.lora_adapters import LoRAAdapterRef, LoRAAdapterReport

H = [bytes([i]) * 16 for i in range(8)]


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None
    )


def batch(
    worker: str,
    events: list,
    first_seq: int = 0,
    instance: str = "a",
    snapshot: HeldBlocks | None = None,
) -> KVEventBatch:
    return KVEventBatch(worker, instance, first_seq, first_seq + len(events), events, snapshot)


def test_prefill_goes_to_the_longest_contiguous_prefix_not_the_most_hashes():
    router = Router(["p0", "p1"], [])
    router.apply(batch("p0", [stored(H[0], H[1], H[3], H[4])]))  # gap at h2
    router.apply(batch("p1", [stored(H[0], H[1], H[2])]))
    choice = router.pick_prefill(H[:5])
    assert (choice.worker_id, choice.num_matched_blocks) == ("p1", 3)


def test_decode_goes_to_the_worker_holding_most_hashes():
    router = Router(["p0"], ["d0", "d1"])
    router.apply(batch("d0", [stored(H[0])]))
    router.apply(batch("d1", [stored(H[1], H[2], H[3])]))
    choice = router.pick_decode(H[:4])
    assert (choice.worker_id, choice.num_matched_blocks) == ("d1", 3)


def test_a_decode_worker_busier_by_a_request_loses_to_an_idle_one_holding_nothing():
    """One request in flight costs the routed request's own blocks: the holder of a shared
    prompt keeps it at equal load, and an idle newcomer takes it once the holder is busier
    (with ``decode_load_weight`` 0, the former rule: held hashes decide up to the cap)."""
    for weight, newcomer_when_busier in ((1.0, True), (0.0, False)):
        router = Router(["p0"], ["old", "new"], decode_load_weight=weight)
        router.apply(batch("old", [stored(*H[:6])]))
        prompt = H[:7]
        assert router.pick_decode(prompt).worker_id == "old"
        router.begin("old")
        picked = router.pick_decode(prompt)
        assert (picked.worker_id == "new") == newcomer_when_busier, weight
        router.begin("new")
        assert router.pick_decode(prompt).worker_id == "old"


def test_a_decode_worker_added_under_steady_load_serves_its_share_at_once():
    """Issue 51's scale-out: every prompt shares a 64-block system prompt the old worker
    holds, 4 requests in flight at all times. After decode 1 -> 2, the new worker serves at
    least 30 % of the requests (it served none before, until the old one hit the cap)."""
    system = [bytes([1, i]) * 8 for i in range(64)]
    router = Router(["p0"], ["old", "new"])
    router.apply(batch("old", [stored(*system)]))
    held_by = {"old": set(system), "new": set()}
    in_flight: list[str] = []
    served = {"old": 0, "new": 0}
    for request in range(200):
        prompt = system + [bytes([2]) + request.to_bytes(15, "little")]
        worker = router.pick_decode(prompt).worker_id
        router.begin(worker)
        new_blocks = [h for h in prompt if h not in held_by[worker]]
        router.apply(batch(worker, [stored(*new_blocks)], first_seq=router.next_seq(worker)))
        held_by[worker].update(new_blocks)
        served[worker] += 1
        in_flight.append(worker)
        if len(in_flight) == 4:  # steady load: the oldest finishes as a new one arrives
            router.end(in_flight.pop(0))
    assert served["new"] >= 0.3 * 200, served


def test_no_decode_workers_means_colocated():
    assert Router(["p0"], []).pick_decode(H[:2]) is None


def test_equal_prefix_ties_are_broken_by_load():
    router = Router(["p0", "p1"], [])
    for worker in ("p0", "p1"):
        router.apply(batch(worker, [stored(H[0])]))
    router.begin("p0")
    assert router.pick_prefill(H[:1]).worker_id == "p1"
    router.end("p0")
    router.begin("p1")
    assert router.pick_prefill(H[:1]).worker_id == "p0"


def test_a_hot_worker_over_the_imbalance_cap_is_skipped_despite_its_prefix():
    """With ``prefill_load_weight`` 0 the prefix decides up to the cap; a fully cached
    prompt (one token to recompute) too, at any weight."""
    for weight, prompt in ((0.0, H[:3]), (1.0, H[:2])):
        router = Router(["p0", "p1"], [], max_load_imbalance=2, prefill_load_weight=weight)
        router.apply(batch("p0", [stored(H[0], H[1])]))
        for _ in range(2):
            router.begin("p0")
        assert router.pick_prefill(prompt).worker_id == "p0"  # within the cap: prefix wins
        router.begin("p0")
        assert router.pick_prefill(prompt).worker_id == "p1"  # 3 > 0 + 2: load wins


def test_a_prefill_worker_busier_by_a_request_loses_to_an_idle_one_unless_it_saves_more():
    """A request in flight costs as much again as the routed one would compute there: the
    holder of 3 of 4 blocks keeps a prompt with 1 in flight (2 x 2 half-blocks against 8)
    and loses it with 4 (5 x 2 = 10); the holder of 1 of 4 loses it with 1 (2 x 6 = 12)."""
    for held, in_flight, holder_keeps in ((3, 1, True), (3, 4, False), (1, 1, False)):
        router = Router(["old", "new"], [], max_load_imbalance=8)
        router.apply(batch("old", [stored(*H[:held])]))
        for _ in range(in_flight):
            router.begin("old")
        picked = router.pick_prefill(H[:4])
        assert (picked.worker_id == "old") == holder_keeps, (held, in_flight)


def test_a_prefill_worker_added_under_load_serves_its_share_at_once():
    """The autoscaler's prefill scale-out: prompts of 262 blocks share one of 4 prefixes
    of 30 blocks, all held by the old worker, 4 requests in flight at all times. After
    prefill 1 -> 2 the new worker serves at least 30 % of them (ranked by prefix it served
    none: the old worker never reached the cap of 4 more in flight)."""
    prefixes = [[bytes([1, p, i]) * 5 + b"x" for i in range(30)] for p in range(4)]
    router = Router(["old", "new"], [])
    router.apply(batch("old", [stored(*sum(prefixes, []))]))
    in_flight: list[str] = []
    served = {"old": 0, "new": 0}
    for request in range(200):
        suffix = [bytes([2, i]) + request.to_bytes(14, "little") for i in range(232)]
        prompt = prefixes[request % 4] + suffix
        worker = router.pick_prefill(prompt).worker_id
        router.begin(worker)
        router.apply(batch(worker, [stored(*prompt)], first_seq=router.next_seq(worker)))
        served[worker] += 1
        in_flight.append(worker)
        if len(in_flight) == 4:
            router.end(in_flight.pop(0))
    assert served["new"] >= 0.3 * 200, served


def test_a_cold_cluster_spreads_requests_over_idle_workers():
    router = Router(["p0", "p1", "p2"], [])
    picked = {router.pick_prefill([H[7]]).worker_id for _ in range(3)}
    assert picked == {"p0", "p1", "p2"}


def test_removed_and_cleared_blocks_stop_matching():
    router = Router(["p0"], [])
    router.apply(batch("p0", [stored(H[0], H[1], H[2]), BlockRemoved([H[1]])]))
    assert router.pick_prefill(H[:3]).num_matched_blocks == 1
    router.apply(batch("p0", [AllBlocksCleared()], first_seq=2))
    assert router.pick_prefill(H[:3]).num_matched_blocks == 0


def test_overlapping_batches_apply_each_event_once():
    router = Router(["p0"], [])
    router.apply(batch("p0", [stored(H[0]), stored(H[1])]))
    # A second reader asked from seq 1 at the same time: its batch repeats event 1.
    router.apply(batch("p0", [stored(H[1]), BlockRemoved([H[0]])], first_seq=1))
    assert router.next_seq("p0") == 3
    assert router.pick_prefill(H[:2]).num_matched_blocks == 0


def test_a_restarted_worker_loses_its_old_entries():
    router = Router(["p0"], [])
    router.apply(batch("p0", [stored(H[0], H[1])], instance="old"))
    router.apply(batch("p0", [stored(H[5])], instance="new"))
    assert router.pick_prefill(H[:2]).num_matched_blocks == 0
    assert router.pick_prefill([H[5]]).num_matched_blocks == 1


def test_a_snapshot_replaces_the_index_when_the_log_was_truncated():
    router = Router(["p0"], [])
    router.apply(batch("p0", [stored(H[0])]))
    snapshot = HeldBlocks()
    snapshot.apply(stored(H[3]))
    router.apply(KVEventBatch("p0", "a", 100, 100, [], snapshot=snapshot))
    assert router.next_seq("p0") == 100
    assert router.pick_prefill([H[0]]).num_matched_blocks == 0
    assert router.pick_prefill([H[3]]).num_matched_blocks == 1


def test_a_removed_worker_is_never_picked_and_its_events_are_ignored():
    router = Router(["p0", "p1"], ["d0"])
    router.apply(batch("p0", [stored(H[0])]))
    router.remove_worker("p0")
    router.apply(batch("p0", [stored(H[1])]))
    assert {router.pick_prefill(H[:1]).worker_id for _ in range(4)} == {"p1"}


def test_a_router_without_prefill_workers_is_refused():
    with pytest.raises(ValueError, match="prefill"):
        Router([], ["d0"])


def test_an_unavailable_worker_is_skipped_and_none_left_raises_no_worker_available():
    router = Router(["p0", "p1"], ["d0"])
    router.apply(batch("p0", [stored(H[0], H[1])]))
    router.set_available("p0", False)
    assert {router.pick_prefill(H[:2]).worker_id for _ in range(4)} == {"p1"}
    router.set_available("d0", False)
    with pytest.raises(NoWorkerAvailable, match="decode"):
        router.pick_decode(H[:2])
    router.set_available("p0", True)
    assert router.pick_prefill(H[:2]).worker_id == "p0"  # its index survived the outage


def _group_stored(group_idx: int, *hashes, window: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        group_idx=group_idx,
        kv_cache_spec_kind="sliding_window" if window else "full_attention",
        kv_cache_spec_sliding_window=window,
    )


def test_a_sliding_window_groups_eviction_does_not_read_as_the_prefix_gone():
    """Hybrid model: group 0 full attention, group 1 a 32-token window (2 blocks of 16)."""
    router = Router(["p0", "p1"], [])
    router.apply(
        batch(
            "p0",
            [
                _group_stored(0, *H[:5]),
                _group_stored(1, *H[:5], window=32),
                BlockRemoved(block_hashes=H[:3], group_idx=1),
            ],
        )
    )
    # p1 lost the same blocks from the full-attention group: its prefix is gone.
    router.apply(
        batch(
            "p1",
            [
                _group_stored(0, *H[:5]),
                _group_stored(1, *H[:5], window=32),
                BlockRemoved(block_hashes=H[:3], group_idx=0),
            ],
        )
    )
    choice = router.pick_prefill(H[:5])
    assert (choice.worker_id, choice.num_matched_blocks) == ("p0", 5)


def test_a_sliding_window_prefix_needs_only_its_last_blocks_up_to_the_match():
    router = Router(["p0"], [])
    router.apply(batch("p0", [_group_stored(0, H[3], H[4], window=32)]))  # a pure-window model
    assert router.pick_prefill(H[:5]).num_matched_blocks == 5  # h3 h4 cover the window at 5
    assert router.pick_prefill(H[:4]).num_matched_blocks == 0  # at 4 the window needs h2 h3
    router.apply(batch("p0", [BlockRemoved(block_hashes=[H[3]], group_idx=0)], first_seq=1))
    assert router.pick_prefill(H[:5]).num_matched_blocks == 0


def lora_report(instance: str, generation: int, registered: list[str], resident: list[str]):
    refs = [LoRAAdapterRef(name, f"/adapters/{name}", f"digest-{name}") for name in registered]
    return LoRAAdapterReport(instance, refs, resident, generation)


def test_a_lora_request_goes_first_where_its_adapter_is_in_memory_then_registered():
    """Holding the adapter outranks the prefix (the prefix is the adapter's own, by its
    hashes); without an adapter, the prefix decides as before; the load cap still holds."""
    router = Router(["p0", "p1", "p2"], [])
    for worker, registered, resident in [
        ("p0", [], []),
        ("p1", ["qv"], []),
        ("p2", ["qv"], ["qv"]),
    ]:
        event_batch = batch(worker, [stored(*H[:3])] if worker == "p0" else [])
        event_batch.lora = lora_report("a", 1, registered, resident)
        router.apply(event_batch)
    assert router.pick_prefill(H[:3], "qv").worker_id == "p2"
    assert router.pick_prefill(H[:3]).worker_id == "p0"
    for _ in range(5):
        router.begin("p2")  # 5 > 0 + 4: p2 is over the cap
    assert router.pick_prefill(H[:3], "qv").worker_id == "p1"
    assert router.lora_adapters() == {"qv": LoRAAdapterRef("qv", "/adapters/qv", "digest-qv")}


def test_a_workers_adapters_follow_its_newest_report_of_its_current_instance():
    """An admin load's answer and a poll's cross on the way: the newer generation wins;
    a report of another instance (a restarted worker's old one) is ignored; a restart
    starts over from its own reports."""
    router = Router(["p0"], [])
    router.apply(batch("p0", []))
    router.note_lora("p0", lora_report("a", 2, ["qv", "mlp"], ["qv"]))
    late_poll = batch("p0", [], first_seq=0)
    late_poll.lora = lora_report("a", 1, ["qv"], ["qv"])
    router.apply(late_poll)
    assert sorted(router.lora_adapters()) == ["mlp", "qv"]
    router.note_lora("p0", lora_report("old", 9, [], []))
    assert sorted(router.lora_adapters()) == ["mlp", "qv"]
    restarted = batch("p0", [], instance="b")
    restarted.lora = lora_report("b", 0, ["qv"], [])
    router.apply(restarted)
    assert sorted(router.lora_adapters()) == ["qv"]


def test_a_worker_added_at_run_time_waits_for_its_first_answer_then_gets_work():
    router = Router(["p0"], ["d0"])
    router.add_worker("p1", "prefill")
    router.add_worker("d1", "decode")
    assert not router.is_available("p1") and router.has_worker("p1")
    assert {router.pick_prefill(H[:1]).worker_id for _ in range(4)} == {"p0"}
    router.set_available("p1", True)
    router.set_available("d1", True)
    router.begin("p0")
    router.begin("d0")
    assert router.pick_prefill(H[:1]).worker_id == "p1"
    assert router.pick_decode(H[:1]).worker_id == "d1"
    router.remove_worker("p1")
    assert not router.has_worker("p1")
