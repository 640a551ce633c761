"""The tier's LRU and budget, as invariants (hypothesis), and the router's view of tiers."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cache import BlockRemoved, BlockStored, HeldBlocks
from pdserve.gateway.router import Router
from pdserve.kvconnector.tier.tier_lru import TierLRU, capacity_for_budget
from pdserve.messages.kv_event_batch import KVEventBatch

KEYS = st.binary(min_size=1, max_size=1)
OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "pop"]), KEYS), max_size=60)


@given(capacity=st.integers(1, 6), ops=OPS)
def test_a_tier_never_exceeds_its_budget_and_drops_the_least_recently_used(capacity, ops):
    lru: TierLRU[int] = TierLRU(capacity)
    model: OrderedDict[bytes, int] = OrderedDict()
    for step, (op, key) in enumerate(ops):
        if op == "put" and key not in model:
            if len(model) >= capacity:
                assert lru.pop_lru() == model.popitem(last=False)
            lru.put(key, step)
            model[key] = step
        elif op == "get":
            assert lru.get(key) == model.get(key)
            if key in model:
                model.move_to_end(key)
        elif op == "pop":
            assert lru.pop(key) == model.pop(key, None)
        assert len(lru) == len(model) <= capacity
        assert list(lru) == list(model)


def test_a_full_tier_refuses_a_put_without_room():
    lru: TierLRU[int] = TierLRU(1)
    lru.put(b"a", 1)
    with pytest.raises(OverflowError):
        lru.put(b"b", 2)
    assert capacity_for_budget("cpu", 10 * 4096 + 5, 4096) == 10


def stored(hashes: list[bytes], medium: str | None = None) -> BlockStored:
    return BlockStored(hashes, None, [], 16, None, group_idx=0, medium=medium)


def test_held_blocks_track_tier_media_apart_from_the_pool():
    held = HeldBlocks()
    held.apply(stored([b"h0", b"h1"]))
    held.apply(stored([b"h2", b"h3"], "cpu"))
    held.apply(stored([b"h4"], "disk"))
    hashes = [b"h0", b"h1", b"h2", b"h3", b"h4", b"h5"]
    assert held.prefix_match(hashes) == 2
    assert held.num_tier_blocks_after(hashes, 2) == 3
    held.apply(BlockRemoved([b"h3"], 0, medium="cpu"))
    assert held.num_tier_blocks_after(hashes, 2) == 1
    assert held.copy().tiers == held.tiers and held.copy().tiers is not held.tiers


def test_the_router_ranks_a_pool_hit_above_an_equally_long_tier_hit():
    router = Router(["pool", "tier"], [])
    hashes = [b"h0", b"h1", b"h2"]
    router.apply(KVEventBatch("pool", "i1", 0, 1, [stored(hashes)]))
    router.apply(KVEventBatch("tier", "i2", 0, 2, [stored(hashes[:1]), stored(hashes[1:], "cpu")]))
    for _ in range(2):  # whoever's turn it is
        choice = router.pick_prefill(hashes)
        assert (choice.worker_id, choice.num_matched_blocks) == ("pool", 3)
    # A tier hit still beats a shorter pool hit: loading is cheaper than computing.
    router.apply(KVEventBatch("pool", "i1", 1, 2, [BlockRemoved(hashes[1:], 0)]))
    assert router.pick_prefill(hashes).worker_id == "tier"
    assert router.pick_prefill(hashes).num_matched_blocks == 3
