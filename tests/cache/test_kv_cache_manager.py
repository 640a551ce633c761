import pytest

from pdserve.cache import BlockRemoved, BlockStored
from tests.cache.cache_fakes import FakeRequest, make_hasher, make_manager

HASHER = make_hasher()


def request(request_id, tokens, **kwargs):
    return FakeRequest(request_id, tokens, HASHER, **kwargs)


def admit(manager, req, **kwargs):
    """What a scheduler does on admission: look up, allocate the rest, count the lookup."""
    hit, num_hit_tokens = manager.get_computed_blocks(req)
    blocks = manager.allocate_slots(
        req, req.num_tokens - num_hit_tokens, num_hit_tokens, hit, **kwargs
    )
    if blocks is not None:
        req.num_computed_tokens = req.num_tokens
        manager.record_prefix_cache_stats(req, num_hit_tokens)
    return hit, num_hit_tokens, blocks


def test_shared_prefix_hits_the_first_requests_blocks():
    manager = make_manager()
    a = request("a", list(range(10)))
    assert admit(manager, a)[1] == 0
    b = request("b", list(range(8)) + [50, 51, 52])
    hit, num_hit_tokens, _ = admit(manager, b)
    assert num_hit_tokens == 8
    assert hit.get_block_ids() == (manager.get_block_ids(a)[0][:2],)
    assert manager.get_block_ids(b)[0][:2] == manager.get_block_ids(a)[0][:2]
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 21, 8)
    assert manager.make_prefix_cache_stats().requests == 0  # reset on read


def test_a_full_hit_still_recomputes_the_last_token():
    manager = make_manager()
    admit(manager, request("a", list(range(8))))
    hit, num_hit_tokens, new = admit(manager, request("b", list(range(8))))
    assert num_hit_tokens == 4  # 7 tokens may hit; whole blocks only
    assert len(hit.blocks[0]) == 1 and len(new.blocks[0]) == 1


def test_external_tokens_are_cached_only_after_the_load():
    manager = make_manager(enable_kv_cache_events=True)
    d = request("d", list(range(13)))
    hit, num_hit_tokens = manager.get_computed_blocks(d)
    new = manager.allocate_slots(
        d, 0, num_hit_tokens, hit, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    assert len(new.blocks[0]) == 3 and all(b.block_hash is None for b in new.blocks[0])
    assert manager.take_events() == []
    assert manager.get_computed_blocks(request("probe", list(range(13))))[1] == 0
    manager.cache_blocks(d, 12)  # the connector wrote the 3 blocks
    d.num_computed_tokens = 12
    [stored] = manager.take_events()
    assert stored.block_hashes == d.block_hashes[:3] and stored.token_ids == list(range(12))
    assert manager.get_computed_blocks(request("probe", list(range(13))))[1] == 12
    assert manager.allocate_slots(d, 1) is not None  # the last prompt token
    assert len(manager.get_block_ids(d)[0]) == 4


def test_lookahead_slots_are_allocated_but_never_cached():
    manager = make_manager()
    r = request("r", list(range(8)))
    new = manager.allocate_slots(r, 8, num_lookahead_tokens=4)
    assert len(new.blocks[0]) == 3
    assert [b.block_hash is not None for b in new.blocks[0]] == [True, True, False]


def test_preempted_request_hits_its_own_blocks_and_is_counted_apart():
    manager = make_manager()
    r = request("r", list(range(10)))
    admit(manager, r)
    table = manager.get_block_ids(r)[0]
    manager.free(r)  # preempted
    r.num_computed_tokens, r.num_preemptions = 0, 1
    manager.make_prefix_cache_stats()
    hit, num_hit_tokens, _ = admit(manager, r)
    assert num_hit_tokens == 8 and manager.get_block_ids(r)[0][:2] == table[:2]
    stats = manager.make_prefix_cache_stats()
    assert (
        stats.requests,
        stats.preempted_requests,
        stats.preempted_queries,
        stats.preempted_hits,
    ) == (0, 1, 10, 8)


def test_unhashed_blocks_are_reused_first_then_cached_ones_least_recently_freed_tail_first():
    manager = make_manager(num_blocks=7, enable_kv_cache_events=True)  # 6 usable
    a, b = request("a", list(range(9))), request("b", list(range(100, 109)))
    admit(manager, a)
    admit(manager, b)
    a_ids, b_ids = manager.get_block_ids(a)[0], manager.get_block_ids(b)[0]
    manager.free(a)
    manager.free(b)
    # The partial tails (no hash) go to the head, latest freed first; cached blocks to
    # the tail in freeing order, each chain tail first.
    free_order = [blk.block_id for blk in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == [b_ids[2], a_ids[2], a_ids[1], a_ids[0], b_ids[1], b_ids[0]]
    manager.take_events()
    c = request("c", list(range(200, 208)))
    admit(manager, c)  # the two unhashed tails: nothing cached is evicted
    assert manager.get_block_ids(c)[0] == [b_ids[2], a_ids[2]]
    assert manager.take_events()[0].block_hashes == c.block_hashes  # stored, none removed
    d = request("d", list(range(300, 307)))
    admit(manager, d)  # now a's chain, least recently freed, tail first
    assert manager.get_block_ids(d)[0] == [a_ids[1], a_ids[0]]
    removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [
        BlockRemoved([a.block_hashes[1]], group_idx=0),
        BlockRemoved([a.block_hashes[0]], group_idx=0),
    ]
    assert manager.get_computed_blocks(request("b2", list(range(100, 109))))[1] == 8


def test_a_pool_too_small_returns_none_and_takes_nothing():
    manager = make_manager(num_blocks=5)  # 4 usable
    a = request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)  # a's 2 cached blocks are free and evictable
    big = request("big", list(range(8)) + list(range(50, 62)))  # 20 tokens: 5 blocks
    before = [(blk.ref_cnt, blk.block_hash) for blk in manager.block_pool.blocks]
    hit, num_hit_tokens, new = admit(manager, big)
    assert num_hit_tokens == 8 and new is None
    assert [(blk.ref_cnt, blk.block_hash) for blk in manager.block_pool.blocks] == before
    assert manager.get_num_free_blocks() == 4 and manager.get_block_ids(big) == ([],)
    assert manager.usage == 0.0


def test_cache_salt_and_lora_separate_equal_prefixes():
    manager = make_manager()
    admit(manager, request("a", list(range(9)), cache_salt="tenant-a"))
    assert manager.get_computed_blocks(request("b", list(range(9)), cache_salt="tenant-b"))[1] == 0
    assert manager.get_computed_blocks(request("c", list(range(9))))[1] == 0
    assert manager.get_computed_blocks(request("d", list(range(9)), cache_salt="tenant-a"))[1] == 8
    admit(manager, request("e", list(range(9)), lora_id="adapter-1"))
    assert manager.get_computed_blocks(request("f", list(range(9)), lora_id="adapter-2"))[1] == 0
    assert manager.get_computed_blocks(request("g", list(range(9)), lora_id="adapter-1"))[1] == 8


def test_events_report_stores_evictions_and_clears():
    manager = make_manager(num_blocks=3, enable_kv_cache_events=True)  # 2 usable
    a = request("a", list(range(8)), lora_id="adapter-5")
    manager.allocate_slots(a, 8)
    assert manager.take_events() == [
        BlockStored(
            a.block_hashes[:2],
            None,
            list(range(8)),
            4,
            "adapter-5",
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    manager.free(a)
    assert not manager.take_events()
    b = request("b", list(range(50, 55)))
    manager.allocate_slots(b, 5)
    events = manager.take_events()
    assert events[:2] == [
        BlockRemoved([a.block_hashes[1]], 0),
        BlockRemoved([a.block_hashes[0]], 0),
    ]
    assert not manager.reset_prefix_cache()
    manager.free(b)
    assert manager.reset_prefix_cache() and manager.make_prefix_cache_stats().reset


def test_decode_steps_cache_each_block_as_it_fills():
    manager = make_manager()
    r = request("r", list(range(6)))
    admit(manager, r)
    for token in range(6, 12):
        r.append_token(token)
        assert manager.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    # 12 tokens, the last one computed in this step: 3 full blocks cached.
    assert manager.get_num_cached_blocks("r") == 3


def test_disabled_caching_never_hits_and_never_indexes():
    manager = make_manager(enable_caching=False)
    admit(manager, request("a", list(range(9))))
    assert manager.get_computed_blocks(request("b", list(range(9))))[1] == 0
    assert len(manager.block_pool.cached_block_hash_to_block) == 0


def test_bad_arguments_are_value_errors():
    manager = make_manager()
    r = request("r", list(range(8)))
    with pytest.raises(ValueError, match="greater than 0"):
        manager.allocate_slots(r, 0)
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate_slots(r, 4, num_lookahead_tokens=-1)
    admit(manager, r)
    hit, _ = manager.get_computed_blocks(request("x", list(range(8))))
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(r, 1, 4, hit)


def test_blocks_pulled_early_are_taken_once_by_their_hand_off_and_forgotten_on_reuse():
    """A KV-only request (an offer under lease L1) lands 12 tokens (3 blocks) and frees
    them. A request that names no lease, or another, hits them as a cache hit and leaves
    the mark (the hand-off may still come); the hand-off naming L1 takes them as an early
    pull, once; a later one is a cache hit. A marked block that is evicted and reused
    carries no mark."""
    manager = make_manager(num_blocks=5)  # 4 usable blocks of 4 tokens
    offer = request("offer", list(range(13)))
    hit, num_hit_tokens = manager.get_computed_blocks(offer)
    manager.allocate_slots(
        offer, 0, num_hit_tokens, hit, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    manager.cache_blocks(offer, 12)
    manager.mark_pulled_early(offer, 0, 12, "L1")
    manager.free(offer)
    hit, num_hit_tokens = manager.get_computed_blocks(request("local", list(range(13))))
    assert num_hit_tokens == 12
    assert manager.take_pulled_early(hit, None) == manager.take_pulled_early(hit, "L2") == 0
    hit, num_hit_tokens = manager.get_computed_blocks(request("hand-off", list(range(13))))
    assert num_hit_tokens == 12 and manager.take_pulled_early(hit, "L1") == 12
    hit, num_hit_tokens = manager.get_computed_blocks(request("again", list(range(13))))
    assert num_hit_tokens == 12 and manager.take_pulled_early(hit, "L1") == 0

    relanded = request("offer2", list(range(100, 113)))
    hit, num_hit_tokens = manager.get_computed_blocks(relanded)
    manager.allocate_slots(
        relanded, 0, 0, hit, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    manager.cache_blocks(relanded, 12)
    manager.mark_pulled_early(relanded, 0, 12, "L3")
    manager.free(relanded)
    taker = request("fresh", list(range(200, 216)))  # takes every free block: evicts them all
    assert manager.allocate_slots(taker, 16) is not None
    assert all(block.pulled_early_for is None for block in manager.get_blocks("fresh").blocks[0])


def test_pinned_blocks_outlive_their_request_until_unpinned_and_are_never_handed_out():
    """A lease's pins (an offer's blocks): the request frees its blocks, but the pinned ones
    stay out of the free queue, keep their hash, are never given to another request, and
    a new pin set replaces the old without dropping a block in both; a block it leaves out
    is held until ``release_retired``."""
    manager = make_manager(num_blocks=9)  # 8 usable
    a = request("a", list(range(16)))  # 4 blocks, 4 tokens each
    admit(manager, a)
    ids = manager.get_block_ids(a)[0]
    manager.pin_blocks("a", ids[:2])
    manager.pin_blocks("a", [0, *ids[1:3]])  # the null id is skipped; ids[1] stays pinned
    pinned = manager.block_pool.blocks
    # ids[0] left the pins, retired: a read begun before may still copy it.
    assert [pinned[i].ref_cnt for i in ids] == [2, 2, 2, 1]
    assert set(manager.retired_owners) == {"a"}
    manager.release_retired("a")
    assert [pinned[i].ref_cnt for i in ids] == [1, 2, 2, 1] and not manager.retired_owners
    manager.free(a)
    assert manager.get_num_free_blocks() == 6
    b = request("b", list(range(100, 124)))  # 6 blocks: every free one
    admit(manager, b)
    assert not set(manager.get_block_ids(b)[0]) & set(ids[1:3])
    assert all(pinned[i].block_hash is not None for i in ids[1:3])
    manager.free(b)
    hit, num_hit_tokens = manager.get_computed_blocks(request("again", list(range(16))))
    assert num_hit_tokens == 0  # block 0 of a was handed to b: the chain starts there
    manager.unpin_blocks("a")
    manager.unpin_blocks("a")  # nothing left: a no-op
    assert manager.get_num_free_blocks() == 8 and manager.usage == 0.0
