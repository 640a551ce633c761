"""The tier levels' invariants under any sequence of operations (hypothesis), pins for
promised loads included, and the router's view of tiers.

The levels are real (a numpy slab; files in a temporary directory, written by the disk
level's own thread); a failed write is real too: the directory is removed under the level,
the same OSError path as a full disk.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cache import BlockRemoved, BlockStored, HeldBlocks
from pdserve.gateway.router import Router
from pdserve.kvconnector.tier.cpu_tier import CpuTier
from pdserve.kvconnector.tier.disk_tier import PAGE_SUFFIX, DiskTier
from pdserve.kvconnector.tier.tier_lru import PinnedPages, TierLRU, capacity_for_budget
from pdserve.messages.kv_event_batch import KVEventBatch

PAGE_BYTES = 64
KEYS = st.sampled_from([bytes([i]) * 16 for i in range(8)])  # 16-byte block hashes


def page_of(block_hash: bytes) -> np.ndarray:
    return np.full(PAGE_BYTES, block_hash[0], dtype=np.uint8)


def fill_with(block_hash: bytes):
    return lambda dst: np.copyto(dst, page_of(block_hash))


def flushed(disk: DiskTier) -> None:
    while disk.num_queued():
        threading.Event().wait(0.001)


class PinModel:
    """The pins a test applied (counted, as ``PinnedPages`` counts them) and the pages a
    level must therefore still hold: each pinned while the level held it."""

    def __init__(self, pins: PinnedPages) -> None:
        self.pins = pins
        self.counts: Counter[bytes] = Counter()
        self.must_hold: set[bytes] = set()

    OPS = ("pin", "unpin")

    def apply(self, op: str, key: bytes, held: bool) -> None:
        """Applies a pin op; ``held``: whether the level holds ``key`` now."""
        if op == "pin":
            self.pins.pin([key])
            self.counts[key] += 1
            if held:
                self.must_hold.add(key)
        elif op == "unpin" and self.counts[key]:
            self.pins.unpin([key])
            self.counts[key] -= 1
            if not self.counts[key]:
                self.must_hold.discard(key)

    def stored(self, key: bytes, held: bool) -> None:
        if held and self.counts[key]:
            self.must_hold.add(key)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 4),
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "load", "discard", "pin", "unpin"]), KEYS),
        max_size=40,
    ),
)
def test_a_cpu_tier_keeps_every_slot_once_and_gives_back_the_pages_it_holds(capacity, ops):
    tier = CpuTier(capacity * PAGE_BYTES, PAGE_BYTES, block_size=16)
    pins = PinModel(tier.pins)
    dst = np.empty(PAGE_BYTES, dtype=np.uint8)
    for op, key in ops:
        if op in PinModel.OPS:
            pins.apply(op, key, key in tier._index)
        elif op == "store":
            failures = tier.counters.store_failures
            tier.store(key, fill_with(key))
            # Kept, unless every page is pinned for a load (then counted as not kept).
            every_pinned = all(held in pins.pins for held in tier._index)
            assert key in tier or (every_pinned and tier.counters.store_failures == failures + 1)
            pins.stored(key, key in tier._index)
        elif op == "load":
            held = key in tier
            assert tier.load(key, dst) == held
            if held:
                assert np.array_equal(dst, page_of(key))
        else:
            tier.discard(key)
            pins.must_hold.discard(key)
            assert key not in tier
        assert pins.must_hold <= set(tier._index)  # no eviction took a pinned page
        used = [slot for slot, _ in tier._index._entries.values()]
        # Every slot is either free or holds exactly one page: none lost, none shared.
        assert sorted(used + tier._free_slots) == list(range(capacity))
        assert tier.num_pages() == len(used) <= capacity


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 4),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "discard", "break_disk", "mend_disk", "pin", "unpin"]), KEYS
        ),
        max_size=30,
    ),
)
def test_a_disk_tiers_index_and_files_agree_through_stores_evictions_and_failed_writes(
    capacity, ops
):
    root = Path(tempfile.mkdtemp())
    try:
        disk = DiskTier(root / "worker-0", capacity * PAGE_BYTES, PAGE_BYTES, block_size=16)
        pins = PinModel(disk.pins)
        over_budget = 0  # pinned pages kept though every page was pinned (at most)
        directory = disk.directory  # this run's pages
        for op, key in ops:
            if op in PinModel.OPS:
                pins.apply(op, key, key in disk._index)
            elif op == "store":
                over_budget += key in pins.pins and len(disk._index) >= capacity
                disk.store(key, fill_with(key))
                flushed(disk)
                pins.stored(key, key in disk._index)
            elif op == "discard":
                disk.discard(key)
                pins.must_hold.discard(key)
            elif op == "break_disk":
                flushed(disk)
                shutil.rmtree(directory, ignore_errors=True)  # every write now fails
            else:
                flushed(disk)
                directory.mkdir(exist_ok=True)
            flushed(disk)
            files = (
                {path.stem for path in directory.iterdir() if path.suffix == PAGE_SUFFIX}
                if directory.exists()
                else set()
            )
            indexed = {block_hash.hex() for block_hash in disk._index}
            # Every indexed page is a file (while the directory stands) and no file is a
            # page the index forgot; the budget holds.
            assert files <= indexed
            if directory.exists() and not any(o == "break_disk" for o, _ in ops):
                assert files == indexed
            assert disk.num_pages() <= capacity + over_budget
            assert pins.must_hold <= set(disk._index)  # no eviction took a pinned page
            dst = np.empty(PAGE_BYTES, dtype=np.uint8)
            for block_hash in list(disk._index):
                if (directory / f"{block_hash.hex()}{PAGE_SUFFIX}").exists():
                    assert disk.load(block_hash, dst) and np.array_equal(dst, page_of(block_hash))
        disk.close()
        assert not (root / "worker-0").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


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


def test_a_page_promised_while_queued_for_the_disk_is_kept_when_every_page_is_pinned(tmp_path):
    """A lookup finds page B still queued for the writer (held) and pins it, with A, the
    disk's one indexed page, pinned too. The writer used to drop B once written (no page to
    evict), so the promised load found nothing; a pinned page is now kept over the budget.
    The writer waits on an event here: a stand-in for a slow disk."""
    disk = DiskTier(tmp_path / "worker-0", PAGE_BYTES, PAGE_BYTES, block_size=16)
    a, b = b"A" * 16, b"B" * 16
    disk.store(a, fill_with(a))
    flushed(disk)
    slow_disk = threading.Event()
    write_file = disk._write_file
    disk._write_file = lambda block_hash, page: slow_disk.wait() and write_file(block_hash, page)
    disk.store(b, fill_with(b))
    assert a in disk and b in disk  # what an admission's lookup finds, then pins
    disk.pins.pin([a, b])
    slow_disk.set()
    flushed(disk)
    dst = np.empty(PAGE_BYTES, dtype=np.uint8)
    assert disk.load(b, dst) and np.array_equal(dst, page_of(b))
    assert disk.load(a, dst) and disk.counters.store_failures == 0
    disk.pins.unpin([a, b])
    disk.store(b"C" * 16, fill_with(b"C" * 16))  # unpinned: the next store trims the excess
    flushed(disk)
    assert disk.num_pages() == 1
    disk.close()
