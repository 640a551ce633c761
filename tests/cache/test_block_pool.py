import pytest

from pdserve.cache import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    make_block_hash_with_group_id,
)
from tests.cache.cache_fakes import FakeRequest, make_hasher


def make_cached_request(pool, tokens, request_id="a"):
    request = FakeRequest(request_id, tokens, make_hasher())
    blocks = pool.get_new_blocks(len(tokens) // 4)
    pool.cache_full_blocks(request, blocks, 0, len(blocks), 4)
    return request, blocks


def test_block_zero_is_the_reserved_null_block():
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, enable_caching=True)


def test_cached_blocks_are_found_by_hash_and_stored_events_carry_the_chain():
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    request, blocks = make_cached_request(pool, list(range(12)))
    assert pool.get_cached_block(request.block_hashes[1], [0]) == [blocks[1]]
    assert pool.get_cached_block(request.block_hashes[1], [0, 1]) is None
    [event] = pool.take_events()
    assert event == BlockStored(request.block_hashes, None, list(range(12)), 4, None, group_idx=0)
    assert pool.take_events() == []


def test_reusing_a_freed_cached_block_evicts_its_hash():
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    request, blocks = make_cached_request(pool, list(range(8)))
    pool.take_events()
    pool.free_blocks(reversed(blocks))
    assert pool.get_usage() == 0.0
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [blocks[0]]  # still a hit
    pool.touch([blocks[0]])  # a hit takes it out of the free queue
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    new = pool.get_new_blocks(2)  # the never-used block, then the tail of the chain
    assert [b.block_id for b in new] == [3, blocks[1].block_id]
    assert pool.take_events() == [BlockRemoved([request.block_hashes[1]], group_idx=0)]
    assert pool.get_cached_block(request.block_hashes[1], [0]) is None
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)


def test_evict_blocks_drops_only_unreferenced_cached_blocks():
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    request, blocks = make_cached_request(pool, list(range(8)))
    pool.free_blocks([blocks[1]])
    pool.take_events()
    assert pool.evict_blocks(request.block_hashes) == 1
    assert blocks[1].block_hash is None and blocks[0].block_hash is not None
    assert pool.take_events() == [BlockRemoved([request.block_hashes[1]], group_idx=0)]
    assert pool.num_evicted_blocks == 1


def test_reset_prefix_cache_only_when_nothing_is_referenced():
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    request, blocks = make_cached_request(pool, list(range(8)))
    pool.take_events()
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]


def test_duplicate_blocks_under_one_hash_are_all_indexed():
    pool = BlockPool(8, enable_caching=True)
    first, first_blocks = make_cached_request(pool, list(range(4)), "a")
    second, second_blocks = make_cached_request(pool, list(range(4)), "b")
    key = make_block_hash_with_group_id(first.block_hashes[0], 0)
    index = pool.cached_block_hash_to_block
    assert {b.block_id for b in index.blocks_of(key)} == {
        first_blocks[0].block_id,
        second_blocks[0].block_id,
    }
    pool.free_blocks(first_blocks)
    pool.evict_blocks(first.block_hashes)
    assert index.blocks_of(key) == second_blocks


def test_freed_blocks_without_hash_go_to_the_head_in_order_cached_ones_to_the_tail():
    pool = BlockPool(8, enable_caching=True)
    request, cached = make_cached_request(pool, list(range(8)))  # blocks 1, 2 cached
    unhashed = pool.get_new_blocks(2)  # blocks 3, 4
    pool.free_blocks([unhashed[1], cached[1], unhashed[0], cached[0]])
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [
        4,
        3,
        5,
        6,
        7,
        2,
        1,
    ]


def test_with_caching_off_every_freed_block_is_reused_first():
    pool = BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_evicting_from_several_groups_reports_one_removed_event_per_group():
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    request = FakeRequest("a", list(range(8)), make_hasher())
    for group_id in (0, 1):
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(request, blocks, 0, 2, 4, kv_cache_group_id=group_id)
        pool.free_blocks(reversed(blocks))
    stored = pool.take_events()
    assert [event.group_idx for event in stored] == [0, 1]
    assert pool.evict_blocks(request.block_hashes[1:], kv_cache_group_ids=(0, 1)) == 2
    assert pool.take_events() == [
        BlockRemoved([request.block_hashes[1]], group_idx=0),
        BlockRemoved([request.block_hashes[1]], group_idx=1),
    ]
