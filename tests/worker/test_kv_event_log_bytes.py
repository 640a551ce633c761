"""The worker's KV event log holds a bounded number of bytes, whatever its events carry.

Before the fix it was bounded by count (65,536 events) and kept every ``BlockStored``'s token
ids, which no reader uses: a worker of long prompts held gigabytes. Measured with
tracemalloc: what the log retains after many large events, with the test's own references
to them dropped.
"""

from __future__ import annotations

import os
import tracemalloc

from pdserve.cache import BlockRemoved, BlockStored
from pdserve.worker.kv_event_log import KVEventLog

BOUND_BYTES = 1 << 20
BLOCKS_PER_EVENT = 64  # a 1,024-token prompt of 16-token blocks


def a_prompts_worth_of_stored_blocks() -> BlockStored:
    hashes = [os.urandom(16) for _ in range(BLOCKS_PER_EVENT)]
    return BlockStored(hashes, None, list(range(1000, 1000 + 16 * BLOCKS_PER_EVENT)), 16, None)


def test_the_log_retains_its_byte_bound_not_its_events_token_ids() -> None:
    log = KVEventLog("prefill-0", "instance", max_bytes=BOUND_BYTES)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        previous: list[bytes] = []
        for _ in range(2_000):  # ≈ 65 MB of events as made (token ids as Python ints)
            stored = a_prompts_worth_of_stored_blocks()
            # A pool holds a bounded number of blocks: the last prompt's are evicted.
            log.extend([stored, BlockRemoved(previous)])
            previous = stored.block_hashes
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert log.num_bytes <= BOUND_BYTES
    # The hashes' Python objects cost ~3x their bytes; anything near the unbounded 65 MB fails.
    assert retained < 4 * BOUND_BYTES, f"the log retains {retained / 2**20:.1f} MiB"
    batch = log.since(0)  # the oldest events are gone: a snapshot of the held hashes instead
    assert batch.snapshot is not None
    assert batch.snapshot.groups[0].hashes == set(previous)
    stored_last = log.since(batch.next_seq - 2).events[0]
    assert stored_last.token_ids == [] and stored_last.block_hashes == previous
