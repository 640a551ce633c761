"""A page that fell from the cpu tier to the disk tier comes back to the cpu tier on a hit,
so a prefix in use again is served from memory next time (before the fix it stayed on disk
for good). Real levels: a numpy slab, files in tmp_path, a CPU KV tensor's pages."""

from __future__ import annotations

import threading

import numpy as np
import torch

from pdserve.kvconnector.kv_pages import KVPages
from pdserve.kvconnector.tier.cpu_tier import CpuTier
from pdserve.kvconnector.tier.disk_tier import DiskTier
from pdserve.kvconnector.tier.tier_store import TierStore

PAGE_BYTES = 256


def test_a_disk_hit_is_promoted_to_the_cpu_tier(tmp_path):
    kv_cache = torch.zeros(8, PAGE_BYTES, dtype=torch.uint8)
    disk = DiskTier(tmp_path / "w", 16 * PAGE_BYTES, PAGE_BYTES, block_size=16)
    cpu = CpuTier(2 * PAGE_BYTES, PAGE_BYTES, block_size=16, below=disk)
    store = TierStore([cpu, disk], KVPages(kv_cache))
    hashes = [bytes([i]) * 16 for i in range(1, 5)]
    for block_id, block_hash in enumerate(hashes, start=1):
        kv_cache[block_id] = block_id
        store.offload(block_hash, block_id)  # the cpu tier holds 2: the oldest fall to disk
    while disk.num_queued():
        threading.Event().wait(0.01)
    first = hashes[0]
    assert store.level_holding(first) is disk

    assert store.load(first, 7)
    assert np.array_equal(kv_cache[7].numpy(), np.full(PAGE_BYTES, 1, dtype=np.uint8))
    assert store.level_holding(first) is cpu
    dst = np.empty(PAGE_BYTES, dtype=np.uint8)
    assert cpu.load(first, dst) and np.array_equal(dst, kv_cache[1].numpy())
    disk.close()
