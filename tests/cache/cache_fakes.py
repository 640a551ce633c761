"""A minimal request satisfying `pdserve.cache.CacheRequest`, and manager builders."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache import (
    BlockHash,
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RequestBlockHasher,
    SlidingWindowSpec,
)

BLOCK_SIZE = 4


@dataclass
class FakeRequest:
    """Keeps its block hashes current as tokens are appended, like the engine's Request."""

    request_id: str
    all_token_ids: list[int]
    hasher: RequestBlockHasher
    cache_salt: str | None = None
    lora_id: int | None = None
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.all_token_ids)
        self.block_hashes.extend(self.hasher.new_block_hashes(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.block_hashes.extend(self.hasher.new_block_hashes(self))


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
    return KVCacheManager(make_config(num_blocks, block_size, sliding_window), max_model_len, **kwargs)
