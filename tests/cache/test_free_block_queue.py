import pytest

from pdserve.cache import FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [block.block_id for block in blocks]


def test_queue_pops_oldest_removes_from_middle_and_appends_at_tail():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft().block_id == 0
    queue.remove(blocks[3])
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5, 0]
    assert ids(queue.popleft_n(2)) == [1, 2]
    queue.append_n([blocks[2], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 2, 1]
    assert queue.num_free_blocks == 5


def test_queue_errors_on_empty_and_on_removing_a_block_not_in_it():
    blocks = [KVCacheBlock(0)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft_n(1)
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])
    assert queue.popleft_n(0) == [] and queue.num_free_blocks == 0
