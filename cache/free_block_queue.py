"""The free blocks in eviction order: an intrusive doubly-linked list.

```
fake_head <-> u5 <-> u4 <-> b7 <-> b3 <-> ... <-> b2 <-> fake_tail
 ▲ prepend_n puts unhashed blocks here            ▲ append_n puts cached blocks here
 popleft takes here: reused first                   (evicted last: LRU)
```

Freed blocks keep their hash, so the queue *is* the prefix cache: a cached block is
reused on a hit (`remove`, O(1) from the middle) or evicted when it reaches the head.
A freed block without a hash can never be hit, so the pool puts it at the head
(`prepend_n`) to be reused before any cached block is evicted.
The links live in the blocks themselves and the sentinels remove every edge case, so
no operation allocates or branches on emptiness of a neighbour.
"""

from __future__ import annotations

from pdserve.cache.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """O(1) `popleft`, `remove` and `append` over blocks linked through themselves."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free_block = right
            right.prev_free_block = left

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self.fake_free_list_head.next_free_block
        assert block is not None
        if block is self.fake_free_list_tail:
            raise ValueError("no free blocks available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the `n` least recently freed blocks, oldest first."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} free")
        blocks = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        assert block is not None
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Take `block` out of the middle of the queue (a prefix-cache hit on it)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put a just-freed block at the tail: it is evicted last."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Append blocks in order at the tail: the first is evicted first."""
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks in order at the head: the first is handed out first."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None
        previous = self.fake_free_list_head
        for block in blocks:
            block.prev_free_block = previous
            previous.next_free_block = block
            previous = block
        previous.next_free_block = first
        first.prev_free_block = previous
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks head to tail (O(n): for tests and debugging)."""
        blocks = []
        block = self.fake_free_list_head.next_free_block
        while block is not self.fake_free_list_tail:
            assert block is not None
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        previous, following = block.prev_free_block, block.next_free_block
        assert previous is not None and following is not None
        previous.next_free_block = following
        following.prev_free_block = previous
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
