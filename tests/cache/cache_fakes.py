"""A minimal request satisfying `pdserve.cache.CacheRequest`, and manager builders."""

from __future__ import annotations

from pdserve.cache import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LedgerRequest,
    RequestBlockHasher,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4


# The ledger's own minimal request serves as the tests' request.
FakeRequest = LedgerRequest


def make_hasher(block_size: int = BLOCK_SIZE, seed: int | str = 0) -> RequestBlockHasher:
    return RequestBlockHasher(BlockHasher("xxh3_128", seed), block_size)


def make_config(
    num_blocks: int, block_size: int = BLOCK_SIZE, sliding_window: int | None = None
) -> KVCacheConfig:
    """Full attention, plus a sliding-window group when `sliding_window` is set."""
    groups = [
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size, 2, 8, "float16")),
    ]
    if sliding_window is not None:
        spec = SlidingWindowSpec(block_size, 2, 8, "float16", sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["swa.0"], spec))
    return KVCacheConfig(num_blocks, groups)


def make_manager(
    num_blocks: int = 16,
    block_size: int = BLOCK_SIZE,
    sliding_window: int | None = None,
    max_model_len: int = 1024,
    **kwargs: bool,
) -> KVCacheManager:
    return KVCacheManager(
        make_config(num_blocks, block_size, sliding_window), max_model_len, **kwargs
    )
