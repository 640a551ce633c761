from pdserve.cache import BlockPool, SlidingWindowManager, SlidingWindowSpec
from tests.cache.cache_fakes import FakeRequest, make_hasher, make_manager

HASHER = make_hasher()


def sliding_manager_with_cached(cached: list[bool], sliding_window: int = 8):
    """A window of 8 at block_size 4: a hit needs the 2 blocks before its end cached."""
    pool = BlockPool(32, enable_caching=True)
    spec = SlidingWindowSpec(4, 1, 8, "float32", sliding_window=sliding_window)
    manager = SlidingWindowManager(spec, pool, kv_cache_group_id=0)
    req = FakeRequest("r", list(range(4 * len(cached) + 1)), HASHER)
    blocks = pool.get_new_blocks(len(cached))
    pool.cache_full_blocks(req, blocks, 0, len(cached), 4)
    pool.free_blocks(blocks)
    pool.evict_blocks([h for h, keep in zip(req.block_hashes, cached) if not keep])
    return manager, req, blocks


def test_sliding_window_hit_is_the_last_window_of_contiguous_cached_blocks():
    manager, req, blocks = sliding_manager_with_cached([False, False, True, True, False, True])
    hit = manager.find_longest_cache_hit(req.block_hashes, 24)
    null = manager.block_pool.null_block
    assert hit == [null, null, blocks[2], blocks[3]]


def test_sliding_window_hit_from_the_start_may_be_shorter_than_a_window():
    manager, req, blocks = sliding_manager_with_cached([True, False, True, False])
    assert manager.find_longest_cache_hit(req.block_hashes, 16) == [blocks[0]]


def test_blocks_outside_the_window_become_null_and_return_to_the_pool():
    manager = make_manager(num_blocks=16, sliding_window=8)
    r = FakeRequest("r", list(range(20)), HASHER)
    manager.allocate_slots(r, 20)
    r.num_computed_tokens = 20
    free_before = manager.get_num_free_blocks()
    r.append_token(99)
    manager.allocate_slots(r, 1)
    full_ids, window_ids = manager.get_block_ids(r)
    # The next token (position 20) reads positions 13..20: blocks 0..2 are no longer read.
    assert window_ids[:3] == [0, 0, 0] and 0 not in window_ids[3:]
    assert 0 not in full_ids
    assert manager.get_num_free_blocks() == free_before + 3 - 2  # 3 released, 1 new block per group
    manager.free(r)
    assert manager.get_num_free_blocks() == 15


def test_hybrid_hit_satisfies_both_full_attention_and_the_window():
    manager = make_manager(num_blocks=32, sliding_window=8)
    a = FakeRequest("a", list(range(16)), HASHER)
    manager.allocate_slots(a, 16)
    manager.free(a)
    probe = FakeRequest("b", list(range(16)) + [7, 7, 7, 7], HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(probe)
    full, window = hit.blocks
    assert num_hit_tokens == 16 and len(full) == len(window) == 4
    assert window[0].is_null and window[1].is_null  # outside the window: need not be kept
    # Evict the window group's copy of block 3: the window needs blocks 1, 2 -> 12 tokens,
    # and full attention shrinks to agree.
    window_pool = manager.block_pool
    window_pool.evict_blocks([probe.block_hashes[3]], kv_cache_group_ids=[1])
    hit, num_hit_tokens = manager.get_computed_blocks(probe)
    full, window = hit.blocks
    assert num_hit_tokens == 12 and len(full) == len(window) == 3
    # Evict the window's block 2 too: the run from the start (blocks 0, 1) is the hit.
    window_pool.evict_blocks([probe.block_hashes[2]], kv_cache_group_ids=[1])
    hit, num_hit_tokens = manager.get_computed_blocks(probe)
    assert num_hit_tokens == 8
    new = manager.allocate_slots(probe, probe.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    assert new is not None and [len(g) for g in manager.get_block_ids(probe)] == [5, 5]


def test_hybrid_events_name_their_group_and_the_window_groups_evictions_stay_its_own():
    manager = make_manager(num_blocks=32, sliding_window=8, enable_kv_cache_events=True)
    a = FakeRequest("a", list(range(16)), HASHER)
    manager.allocate_slots(a, 16)
    full, window = manager.take_events()
    assert (full.group_idx, full.kv_cache_spec_kind, full.kv_cache_spec_sliding_window) == (
        0,
        "full_attention",
        None,
    )
    assert (window.group_idx, window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window) == (
        1,
        "sliding_window",
        8,
    )
    assert full.block_hashes == window.block_hashes == a.block_hashes
    manager.free(a)
    assert manager.evict_blocks(a.block_hashes[:1]) == 2  # both groups' copies
    assert manager.block_pool.evict_blocks(a.block_hashes[1:2], kv_cache_group_ids=(1,)) == 1
    removed = manager.take_events()
    assert [(e.block_hashes, e.group_idx) for e in removed] == [
        ([a.block_hashes[0]], 0),
        ([a.block_hashes[0]], 1),
        ([a.block_hashes[1]], 1),
    ]
