"""What the ledger needs to know about a request (the engine's Request satisfies it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pdserve.cache.hashing import BlockHash


@runtime_checkable
class CacheRequest(Protocol):
    """A request as the KV cache ledger sees it.

    `block_hashes` holds the hashes of the request's full blocks, kept current by the
    owner as tokens arrive (see `RequestBlockHasher`). `num_preemptions > 0` marks a
    re-admitted request, whose prefix-cache lookups are counted apart.
    """

    request_id: str
    all_token_ids: Sequence[int]
    num_tokens: int
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    cache_salt: str | None
    lora_id: int | None
    num_preemptions: int
