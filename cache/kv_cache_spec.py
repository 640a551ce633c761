"""What one KV cache block holds, per layer group, and how many blocks fit in memory.

A worker keeps one KV tensor for all layers (docs/architecture.md):

```
kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_size]
           └────────── one block = one contiguous page of bytes_per_block ──────────┘
```

(latent attention stores one row per token instead: `[.., 1, block_size, 1, latent]`,
`MLAAttentionSpec`).

Layers are grouped by attention type (`KVCacheGroupSpec`); each group gets its own
block ids from the one shared pool. When groups mix (Gemma 3's global and windowed layers)
they hold equally many layers (`ModelConfig.kv_layer_groups`) and share the tensor's layer
axis: layer slot `i` of a block is layer `i` of whichever group holds the block, so a block
id is one page of the largest group's layers and `bytes_per_block` is that page (vLLM's
hybrid allocator shares its tensors the same way). All groups share one `block_size`: a
token position maps to the same block index in every group, which is what lets one list
of block hashes serve every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

_DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one layer's page: K and V for `block_size` tokens."""

    kind: ClassVar[str] = "full_attention"
    """The attention type's name in KV events (vLLM's `KVCacheSpecKind` values)."""
    entries: ClassVar[int] = 2
    """Rows stored per token and head: K and V."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        _check_positive("num_kv_heads", self.num_kv_heads)
        _check_positive("head_size", self.head_size)
        if self.dtype not in _DTYPE_ITEMSIZE:
            raise ValueError(
                f"unknown KV cache dtype {self.dtype!r}; use one of {sorted(_DTYPE_ITEMSIZE)}"
            )

    @property
    def itemsize(self) -> int:
        return _DTYPE_ITEMSIZE[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block in one layer: entries (K, V) * block_size * heads * head_size * itemsize."""
        return self.entries * self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    def event_metadata(self) -> tuple[str, int | None]:
        """(kind, sliding window in tokens or None), what a `BlockStored` carries."""
        return self.kind, None

    def max_num_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of `num_tokens` holds in this group at once, computed
        in chunks of at most `max_chunk_tokens`: all of them, here."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: every block stays needed."""


@dataclass(frozen=True, slots=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Full attention over one latent row per token (DeepSeek's MLA): no separate K and V,
    no heads (``num_kv_heads`` 1, ``head_size`` the latent plus its RoPE key), so a page is
    a fraction of a GQA page of the same width."""

    entries: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    """A token attends to the last `sliding_window` tokens (itself included).

    Blocks wholly before the window are no longer needed by the request and go back
    to the pool (they stay cached by hash for other requests).
    """

    kind: ClassVar[str] = "sliding_window"

    sliding_window: int

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        _check_positive("sliding_window", self.sliding_window)

    def event_metadata(self) -> tuple[str, int | None]:
        return self.kind, self.sliding_window

    def max_num_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """A chunk's queries read the `sliding_window - 1` tokens before them: the window
        and the chunk, plus one block where the window starts mid-block (vLLM's bound)."""
        window = -(-(self.sliding_window - 1 + max_chunk_tokens) // self.block_size) + 1
        return min(-(-num_tokens // self.block_size), window)


@dataclass(slots=True)
class KVCacheGroupSpec:
    """Layers that share one attention type, hence one block table per request."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError("a KVCacheGroupSpec needs at least one layer name")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block across this group's layers."""
        return len(self.layer_names) * self.kv_cache_spec.page_size_bytes


def _check_groups(groups: Sequence[KVCacheGroupSpec]) -> None:
    if not groups:
        raise ValueError("a KV cache needs at least one KVCacheGroupSpec")
    block_sizes = {group.kv_cache_spec.block_size for group in groups}
    if len(block_sizes) != 1:
        raise ValueError(
            f"all KV cache groups must share one block_size, got {sorted(block_sizes)}: "
            "a token position must map to the same block index in every group"
        )
    layer_names = [name for group in groups for name in group.layer_names]
    if len(layer_names) != len(set(layer_names)):
        raise ValueError("a layer name appears in more than one KV cache group")


def _bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """One page of the largest group: every group's blocks fill the same layer slots."""
    return max(group.page_size_bytes for group in groups)


@dataclass(slots=True)
class KVCacheConfig:
    """The pool size and the layer groups it serves.

    `num_blocks` counts block 0, which the pool reserves as the null block (it stands
    for sliding-window positions that hold no data), so `num_blocks - 1` are usable.
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        _check_groups(self.kv_cache_groups)
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is the reserved null block), "
                f"got {self.num_blocks!r}"
            )

    @property
    def block_size(self) -> int:
        return self.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id: a page of the largest group's layers."""
        return _bytes_per_block(self.kv_cache_groups)


def longest_request_in_pool(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, max_chunk_tokens: int
) -> int:
    """The most tokens one request can hold alone in a pool of `num_blocks` (block 0 is the
    null block) serving these groups, computed in chunks of at most `max_chunk_tokens`.

    Each group takes its own blocks from the pool: a model of one full-attention group fits
    `(num_blocks - 1) * block_size` tokens, Gemma 3's one global group and five windowed
    ones fewer. A request longer than this could never be scheduled (it would preempt
    itself for ever), so an engine serves no longer one (`EngineConfig.max_model_len_for`).
    """
    _check_groups(groups)
    block_size = groups[0].kv_cache_spec.block_size

    def fits(num_tokens: int) -> bool:
        needed = sum(g.kv_cache_spec.max_num_blocks(num_tokens, max_chunk_tokens) for g in groups)
        return needed <= num_blocks - 1

    low, high = 0, (num_blocks - 1) * block_size  # fits(low); more than high never does
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def num_blocks_for_memory(
    budget_bytes: int,
    groups: Sequence[KVCacheGroupSpec],
    beside: Sequence[Sequence[KVCacheGroupSpec]] = (),
) -> int:
    """How many blocks (null block included) a memory budget holds for these groups, and
    for the pools ``beside`` them that get as many blocks out of the same budget (a draft
    model's, which holds as many tokens as the model's).

    Raises ValueError when the budget holds fewer than 2 blocks: the null block plus
    one usable block is the least a pool can work with.
    """
    for pool in (groups, *beside):
        _check_groups(pool)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    bytes_per_block = sum(_bytes_per_block(pool) for pool in (groups, *beside))
    num_blocks = budget_bytes // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds {num_blocks} block(s) of "
            f"{bytes_per_block} bytes; need at least 2 (block 0 is the reserved null block). "
            "Raise the memory budget or shrink block_size / dtype."
        )
    return num_blocks
