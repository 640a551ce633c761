"""pdserve.cache: the KV cache ledger (vLLM v1's three layers).

    KVCacheManager        the scheduler's API: get_computed_blocks, allocate_slots, free
      KVCacheCoordinator  one hit length / allocation across KV cache groups
        SingleTypeKVCacheManager  per group: FullAttentionManager, SlidingWindowManager
          BlockPool       blocks, free queue (= LRU prefix cache), hash index, KV events

Block hashing (`hashing`) is shared with the gateway, which hashes prompts with the
same cluster-wide seed. Pure Python + numpy + xxhash: no torch.
"""

from pdserve.cache.block_hash_map import BlockHashToBlockMap
from pdserve.cache.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolListener
from pdserve.cache.cache_request import CacheRequest, LedgerRequest
from pdserve.cache.free_block_queue import FreeKVCacheBlockQueue
from pdserve.cache.hashing import (
    BlockHash,
    BlockHasher,
    ExtraKeys,
    HashAlgorithm,
    MultiModalFeature,
    RequestBlockHasher,
    hash_block_tokens,
    none_hash,
)
from pdserve.cache.held_blocks import HeldBlocks, HeldGroup
from pdserve.cache.kv_cache_block import (
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    make_block_hash_with_group_id,
)
from pdserve.cache.kv_cache_coordinator import KVCacheCoordinator
from pdserve.cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pdserve.cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    longest_request_in_pool,
    num_blocks_for_memory,
)
from pdserve.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.cache.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)
from pdserve.cache.stats import PrefixCacheStats

__all__ = [
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockHasher",
    "BlockPool",
    "BlockPoolListener",
    "BlockRemoved",
    "BlockStored",
    "CacheRequest",
    "LedgerRequest",
    "ExtraKeys",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "HashAlgorithm",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "HeldBlocks",
    "HeldGroup",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "MultiModalFeature",
    "PrefixCacheStats",
    "RequestBlockHasher",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "cdiv",
    "SlidingWindowSpec",
    "get_block_hash",
    "hash_block_tokens",
    "make_block_hash_with_group_id",
    "none_hash",
    "longest_request_in_pool",
    "num_blocks_for_memory",
]
