"""KV events: what a worker tells the router about its prefix cache.

The router's prefix index is built from these, so every change to the hash index emits
one: a block cached (`BlockStored`), a cached block evicted (`BlockRemoved`), the whole
cache dropped (`AllBlocksCleared`). Hashes are plain `BlockHash` values, the same the
gateway computes.

Each event names its KV cache group (`group_idx`, as vLLM's do): a hybrid model caches
the same hash once per group, and a sliding-window group evicts blocks that fell out
of its window while the full-attention group still holds the whole prefix:

```
group 0 full_attention       h0 h1 h2 h3 h4   stored
group 1 sliding_window (32)  h0 h1 h2 h3 h4   stored
                             h0 h1            removed (group 1 only): the prefix still hits
```

`BlockStored` also carries its group's spec kind and window, so a consumer learns how
to read a group from the first event it sees. The new fields default to None, so
consumers that know only hashes keep working.

`medium` says which tier an event is about (vLLM's field): None for the device block pool,
`"cpu"` or `"disk"` for a KV tier below it (`kvconnector/tier/tier_store.py`). A block can sit in
the pool and a tier at once; the router ranks a pool hit above a tier hit:

```
pool (medium None)  h0 h1            BlockStored / BlockRemoved as before
tier "cpu"          h0 h1 h2 h3      stored when evicted (or filled: write-through)
                    → 2 blocks hit in the pool, 2 more load from the tier
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache.hashing import BlockHash


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one request became cached; `token_ids` are their tokens.

    `kv_cache_spec_kind` is `"full_attention"` or `"sliding_window"`;
    `kv_cache_spec_sliding_window` is the window in tokens (None for full attention).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    medium: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks of group `group_idx` were evicted from `medium` (None: the pool): their
    hashes no longer hit there."""

    block_hashes: list[BlockHash] = field(default_factory=list)
    group_idx: int | None = None
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: nothing hits here any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
