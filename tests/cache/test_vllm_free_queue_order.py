"""vLLM 0.33's free-queue order, scenario by scenario (its prefix-caching unit tests).

16-token blocks, 11 blocks (block 0 is the null block, so 1..10 are usable). A freed
block with no hash goes to the head of the free queue; a cached one to the tail. The
expected orders were checked against vLLM 0.33.0's own `KVCacheManager`.
"""

from tests.cache.cache_fakes import FakeRequest, make_hasher, make_manager

BLOCK_SIZE = 16
HASHER = make_hasher(BLOCK_SIZE)


def free_queue(manager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def admit(manager, request_id, tokens):
    """Look the prefix up and allocate the whole prompt; returns (request, hit tokens, new ids)."""
    req = FakeRequest(request_id, tokens, HASHER)
    hit, num_hit_tokens = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit_tokens, num_hit_tokens, hit)
    req.num_computed_tokens = req.num_tokens
    return req, num_hit_tokens, new.get_block_ids()[0]


def test_prefill_two_requests_sharing_three_blocks_then_freed():
    manager = make_manager(num_blocks=11, block_size=BLOCK_SIZE)
    common = [i for i in range(3) for _ in range(BLOCK_SIZE)]
    req0, hit0, new0 = admit(manager, "0", common + [3] * 7)
    assert (hit0, new0) == (0, [1, 2, 3, 4])
    req1, hit1, new1 = admit(manager, "1", common + [5] * 5)
    assert (hit1, new1) == (48, [5])
    assert manager.get_block_ids(req1)[0] == [1, 2, 3, 5]
    manager.free(req0)  # 4 (partial) to the head; 1..3 still held by req1
    assert free_queue(manager) == [4, 6, 7, 8, 9, 10]
    manager.free(req1)  # 5 (partial) to the head; 3, 2, 1 to the tail, tail first
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_evict_reuses_the_unhashed_tail_before_any_cached_block():
    manager = make_manager(num_blocks=11, block_size=BLOCK_SIZE)
    last_token = 5 * BLOCK_SIZE + 7
    req0, _, new0 = admit(manager, "0", list(range(last_token)))
    assert new0 == [1, 2, 3, 4, 5, 6]
    req1, _, new1 = admit(manager, "1", list(range(last_token, last_token + 3 * BLOCK_SIZE)))
    assert new1 == [7, 8, 9]
    manager.free(req0)
    manager.free(req1)
    assert free_queue(manager) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    req2, hit2, new2 = admit(manager, "2", list(range(2 * BLOCK_SIZE + 3)))
    assert (hit2, new2) == (32, [6])
    assert manager.get_block_ids(req2)[0] == [1, 2, 6]
    assert free_queue(manager) == [10, 5, 4, 3, 9, 8, 7]


def test_with_caching_off_freed_blocks_are_reused_last_freed_first():
    manager = make_manager(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=False)
    req0, _, new0 = admit(manager, "0", list(range(40)))
    req1 = FakeRequest("1", list(range(40)), HASHER)
    new1 = manager.allocate_slots(req1, 20).get_block_ids()[0]
    assert (new0, new1) == ([1, 2, 3], [4, 5])
    manager.free(req0)
    manager.free(req1)
    assert free_queue(manager) == [5, 4, 3, 2, 1, 6, 7, 8, 9, 10]
