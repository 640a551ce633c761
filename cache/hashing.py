"""Content addresses for KV blocks: chained hashes over a canonical byte encoding.

A full block's hash names its tokens *and* everything before them, so equal hashes
mean equal KV bytes wherever they were computed:

```
NONE_HASH ──▶ h0 = H(NONE_HASH | tok[0:16]  | extras0 | n) ──▶ h1 = H(h0 | tok[16:32] | extras | n) ──▶ ...
              extras0 carries cache_salt (first block only), LoRA id, multimodal ids
```

One block's hashed bytes, in order:

```
| parent hash (16 B xxh3_128, 32 B sha256) | token ids, int32 little-endian | extra keys | u32 num tokens |
```

Each extra key is `tag (1 B) | u32 length | payload`, and the trailing token count pins
where the token bytes end, so no two different (parent, tokens, extras) share bytes.

`NONE_HASH` is derived from the cluster-wide `hash_seed` and nothing else, so every
process of a deployment (gateway, prefill and decode workers) computes the same hashes.
A per-process random seed silently turns every cross-worker hit into a miss.

xxh3_128 is the default (fast, 128 bits); sha256 is there for multi-tenant deployments
that want a cryptographic hash; `cache_salt` separates tenants under either.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import xxhash

if TYPE_CHECKING:
    from pdserve.cache.cache_request import CacheRequest

BlockHash = bytes
"""A block's content address: 16 bytes (xxh3_128) or 32 bytes (sha256)."""

HashAlgorithm = Literal["xxh3_128", "sha256"]

_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": lambda data: hashlib.sha256(data).digest(),
}

_U32 = struct.Struct("<I")
_TOKEN_DTYPE = "<i4"


@dataclass(frozen=True, slots=True)
class MultiModalFeature:
    """A multimodal input's identifier and the token positions its placeholder spans."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides token ids decides a block's KV bytes."""

    lora_id: str | None = None
    cache_salt: str | None = None
    mm_identifiers: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """Tagged, length-prefixed bytes; empty when there are no extra keys."""
        parts: list[bytes] = []
        if self.lora_id is not None:
            parts.append(_encode_field(b"L", self.lora_id.encode()))
        if self.cache_salt is not None:
            parts.append(_encode_field(b"S", self.cache_salt.encode()))
        for identifier in self.mm_identifiers:
            parts.append(_encode_field(b"M", identifier.encode()))
        return b"".join(parts)


def _encode_field(tag: bytes, payload: bytes) -> bytes:
    return tag + _U32.pack(len(payload)) + payload


def _encode_seed(seed: int | str) -> bytes:
    if isinstance(seed, bool) or not isinstance(seed, int | str):
        raise ValueError(f"hash seed must be an int or a str, got {seed!r}")
    tag = b"i" if isinstance(seed, int) else b"s"
    return _encode_field(tag, str(seed).encode())


def _digest_for(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm not in _DIGESTS:
        raise ValueError(
            f"unknown block hash algorithm {algorithm!r}; use one of {sorted(_DIGESTS)}"
        )
    return _DIGESTS[algorithm]


def none_hash(seed: int | str = 0, algorithm: HashAlgorithm = "xxh3_128") -> BlockHash:
    """The parent hash of a request's first block, derived from the cluster-wide seed."""
    return _digest_for(algorithm)(b"pdserve-none-hash" + _encode_seed(seed))


_SHORT_LIST_TOKENS = 64


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as int32 little-endian bytes.

    A short list (a decode step completing one block) is packed by `struct`, several
    times cheaper than building a numpy array for 16 ints; anything longer goes
    through numpy.
    """
    if isinstance(token_ids, list) and len(token_ids) <= _SHORT_LIST_TOKENS:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    return np.asarray(token_ids, dtype=_TOKEN_DTYPE).tobytes()


def hash_block_tokens(
    parent_block_hash: BlockHash,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: ExtraKeys | None = None,
    algorithm: HashAlgorithm = "xxh3_128",
) -> BlockHash:
    """Hash one block: its parent's hash, its token ids and its extra keys."""
    token_bytes = _token_bytes(token_ids)
    extra = extra_keys.encode() if extra_keys is not None else b""
    num_tokens = _U32.pack(len(token_bytes) // 4)
    return _digest_for(algorithm)(parent_block_hash + token_bytes + extra + num_tokens)


class BlockHasher:
    """One deployment's hash function: an algorithm and the cluster-wide seed."""

    def __init__(self, algorithm: HashAlgorithm = "xxh3_128", seed: int | str = 0) -> None:
        self.algorithm = algorithm
        self.seed = seed
        self._digest = _digest_for(algorithm)
        self.none_hash: BlockHash = none_hash(seed, algorithm)

    def hash_block_tokens(
        self,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int] | np.ndarray,
        extra_keys: ExtraKeys | None = None,
    ) -> BlockHash:
        """One block's hash; a `None` parent means the first block (`none_hash`)."""
        parent = self.none_hash if parent_block_hash is None else parent_block_hash
        return hash_block_tokens(parent, token_ids, extra_keys, self.algorithm)

    def hash_request_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        block_size: int,
        block_hashes: Sequence[BlockHash] = (),
        lora_id: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> list[BlockHash]:
        """Hashes of the full blocks of `token_ids` past the `block_hashes` already known.

        Only full blocks are hashed; a partial tail block waits for more tokens. The
        tokens of the new blocks become one int32 buffer, and each block is a slice of
        its memoryview, so the per-block cost is one concatenation and one digest.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        first = len(block_hashes)
        end = len(token_ids) // block_size
        if first >= end:
            return []
        start_token = first * block_size
        tokens = memoryview(_token_bytes(token_ids[start_token : end * block_size]))
        step = 4 * block_size
        tail = _U32.pack(block_size)
        suffix = ExtraKeys(lora_id).encode() + tail if lora_id is not None else tail
        parent = block_hashes[-1] if first else self.none_hash
        digest = self._digest
        new_hashes: list[BlockHash] = []
        append = new_hashes.append
        if mm_features:
            for index in range(first, end):
                block_start = index * block_size
                extra = ExtraKeys(
                    lora_id,
                    cache_salt if index == 0 else None,
                    _mm_identifiers(mm_features, block_start, block_start + block_size),
                )
                offset = (index - first) * step
                parent = digest(parent + tokens[offset : offset + step] + extra.encode() + tail)
                append(parent)
            return new_hashes
        rest = 0
        if first == 0:
            # cache_salt goes into the first block only: that alone changes every later hash.
            block0_suffix = ExtraKeys(lora_id, cache_salt).encode() + tail
            parent = digest(parent + tokens[0:step] + block0_suffix)
            append(parent)
            rest = step
        for offset in range(rest, len(tokens), step):
            parent = digest(parent + tokens[offset : offset + step] + suffix)
            append(parent)
        return new_hashes


def _mm_identifiers(features: Sequence[MultiModalFeature], start: int, end: int) -> tuple[str, ...]:
    return tuple(
        feature.identifier
        for feature in features
        if feature.offset < end and feature.offset + feature.length > start
    )


class RequestBlockHasher:
    """Keeps a request's `block_hashes` current as its tokens arrive.

    The engine's Request calls `new_block_hashes(self)` after each appended token (or
    chunk) and extends its `block_hashes` with the result: only blocks that just became
    full are hashed, so a decode step costs one length check until a block fills.
    """

    def __init__(self, block_hasher: BlockHasher, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_hasher = block_hasher
        self.block_size = block_size

    def new_block_hashes(
        self, request: CacheRequest, mm_features: Sequence[MultiModalFeature] = ()
    ) -> list[BlockHash]:
        """Hashes of the request's blocks that filled since `request.block_hashes` was extended."""
        return self.block_hasher.hash_request_blocks(
            request.all_token_ids,
            self.block_size,
            request.block_hashes,
            lora_id=request.lora_id,
            cache_salt=request.cache_salt,
            mm_features=mm_features,
        )
