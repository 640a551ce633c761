"""What the ledger needs to know about a request (the engine's Request satisfies it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from pdserve.cache.hashing import BlockHash, RequestBlockHasher


@runtime_checkable
class CacheRequest(Protocol):
    """A request as the KV cache ledger sees it.

    `block_hashes` holds the hashes of the request's full blocks, kept current by the
    owner as tokens arrive (see `RequestBlockHasher`). `num_preemptions > 0` marks a
    re-admitted request, whose prefix-cache lookups are counted apart.

    Every member is a read-only property: the ledger only reads them (the owner keeps them
    current), so an implementation may hold each as a plain attribute or compute it, as
    ``num_tokens`` is computed by both ``Request`` and ``LedgerRequest``.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def block_hashes(self) -> list[BlockHash]: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_id(self) -> str | None: ...
    @property
    def num_preemptions(self) -> int: ...


@dataclass(slots=True)
class LedgerRequest:
    """The smallest concrete ``CacheRequest``: tokens plus hashes kept current.

    Part of the ledger's public API: the request type for code that drives the ledger
    without the engine (simulators, capacity planning, benchmarks, the ledger's own
    tests). The engine's ``Request`` carries the same fields and much more.
    `append_token` hashes only when the new token completes a block.
    """

    request_id: str
    all_token_ids: list[int]
    hasher: RequestBlockHasher
    cache_salt: str | None = None
    lora_id: str | None = None
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
        """Append one token; hash a block only when this token completes it."""
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.hasher.block_size:
            self.block_hashes.extend(self.hasher.new_block_hashes(self))
