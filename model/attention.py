"""Paged attention in plain torch: write K/V into slots, then attend over the pages.

The KV tensor is ``[num_blocks, num_layers, entries, block_size, heads, head_size]``
(docs/architecture.md): ``entries`` is 2 (K and V of each KV head) or, for latent attention
(``architectures/mla.py``), 1 (one latent row, no heads). A step's tokens arrive flattened,
multi-token chunks (prefills) first, then single-token chunks (decodes) and speculative
verifications (a last token and its drafts, which read their pages as decodes do):

    tokens:  | prefill A from 0 | prefill B at 4,096 | d0 | v1 v1' v1'' | d2 |
              └ SDPA over its    └ split-KV, its own   └ split-KV over the pages, one plan ┘
                fresh K/V          plan (one row)        for the batch (split_kv.py)

Per layer: every token's K and V go to their rows of the KV tensor seen as
``[num_blocks * num_layers * entries * block_size, heads * head_size]`` (one
``index_put`` for K and V of all tokens), where the row of slot ``(block, offset)``
of ``layer`` is ``((block * num_layers + layer) * entries + kv) * block_size + offset``.
A prefill chunk that starts at position 0 attends to its own fresh K/V (no pages read);
one that continues a prefix reads its pages where they lie, as one split-KV row of
``count`` queries (``model/split_kv.py``; from the window's first block under a sliding
window), so no chunk copies its whole context out of the pages per layer.
Everything that is the same for all layers (rows, tables, masks) is built once per
step in :func:`build_attention_metadata`, with O(batch) Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from pdserve.cache import cdiv
from pdserve.model.split_kv import SplitKVPlan, plan_split_kv, split_kv_attention


@dataclass(slots=True)
class PrefillAttention:
    """One multi-token chunk: its query rows and how it reads its keys.

    ``paged`` is ``None`` for a chunk starting at position 0: it attends to its own fresh
    K/V, with ``attn_mask`` ``None`` for plain causal attention (SDPA's ``is_causal``) or,
    under a sliding window, ``[1, 1, num_queries, num_queries]`` bool. A chunk continuing a
    prefix reads its pages in place through ``paged``, one split-KV row of its queries.
    """

    query_start: int
    query_end: int
    attn_mask: torch.Tensor | None
    paged: SplitKVPlan | None


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's K/V go and what each query may see; shared by all layers."""

    positions: torch.Tensor  # [num_tokens] long: each token's position in its request
    write_rows: torch.Tensor  # [num_layers, num_tokens, entries] long: K and V rows (module doc)
    max_position: int  # the largest position in the step, plus one
    prefills: list[PrefillAttention]
    decode: SplitKVPlan | None


@dataclass(slots=True)
class StepAttention:
    """A step's attention for every layer: each KV group's metadata (its own block tables,
    its window) and each layer's ``(group, slot)``, its slot being its place in the KV
    tensor's layer axis (``ModelConfig.kv_layer_groups``). One group: slot = layer."""

    groups: list[AttentionMetadata]
    layer_slots: tuple[tuple[int, int], ...]

    def for_layer(self, layer: int) -> tuple[AttentionMetadata, int]:
        group, slot = self.layer_slots[layer]
        return self.groups[group], slot

    @property
    def positions(self) -> torch.Tensor:
        return self.groups[0].positions

    @property
    def max_position(self) -> int:
        return self.groups[0].max_position


def build_attention_metadata(
    token_counts: list[int],
    start_positions: list[int],
    block_ids: list[list[int]],
    block_size: int,
    num_layers: int,
    device: torch.device,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    split_kv_keys: int | None = None,
    kv_entries: int = 2,
    num_prefills: int | None = None,
) -> AttentionMetadata:
    """Index tensors and masks for a step whose chunks are ordered prefills-then-decodes.

    The first ``num_prefills`` chunks are prefills, the rest decode rows: a single token, or
    a speculative verification (a last token and its drafts, read as decode rows read:
    ``model/split_kv.py``). ``None``: every chunk of more than one token is a prefill.
    ``block_ids[i]`` must cover the chunk's end position. ``dtype`` is the query's (the
    split-KV masks are additive); ``split_kv_keys`` how many keys one split-KV chunk gathers
    over its rows (``model/split_kv.py``; ``None``: the whole table at once);
    ``kv_entries`` the KV tensor's entries per token (2: K and V; 1: a latent row).
    """
    ends = [start + count for start, count in zip(start_positions, token_counts)]
    blocks_needed = [cdiv(end, block_size) for end in ends]
    for i, (ids, need) in enumerate(zip(block_ids, blocks_needed)):
        if len(ids) < need:
            raise ValueError(
                f"chunk {i} ends at position {ends[i]} but has only "
                f"{len(ids)} blocks of {block_size} tokens"
            )
    if num_prefills is None:
        num_prefills = sum(1 for count in token_counts if count > 1)
    rows_per_block = num_layers * kv_entries * block_size
    if num_prefills == 0 and sum(token_counts) == len(token_counts):
        # decode-only step, one token per chunk: plain Python lists
        positions = torch.tensor(start_positions, dtype=torch.long)
        base_rows = torch.tensor(
            [
                ids[p // block_size] * rows_per_block + p % block_size
                for ids, p in zip(block_ids, start_positions)
            ],
            dtype=torch.long,
        )
    else:
        positions, base_rows = _token_rows(
            token_counts, start_positions, block_ids, blocks_needed, block_size, rows_per_block
        )
    write_rows = base_rows[None, :, None] + _layer_rows(num_layers, kv_entries, block_size)

    prefills = []
    query_start = 0
    for i in range(num_prefills):
        start, count = start_positions[i], token_counts[i]
        mask = paged = None
        if start > 0:
            paged = plan_split_kv(
                query_start,
                [start],
                [block_ids[i]],
                block_size,
                device,
                dtype,
                sliding_window,
                split_kv_keys,
                [count],
            )
        elif sliding_window is not None:
            query_pos = torch.arange(count)
            mask = _visible(query_pos[:, None], query_pos[None, :], sliding_window)
            mask = mask[None, None].to(device)
        prefills.append(PrefillAttention(query_start, query_start + count, mask, paged))
        query_start += count

    decode = None
    if num_prefills < len(token_counts):
        decode = plan_split_kv(
            query_start,
            start_positions[num_prefills:],
            block_ids[num_prefills:],
            block_size,
            device,
            dtype,
            sliding_window,
            split_kv_keys,
            token_counts[num_prefills:],
        )

    return AttentionMetadata(
        positions.to(device), write_rows.to(device), max(ends), prefills, decode
    )


@functools.cache
def _layer_rows(num_layers: int, kv_entries: int, block_size: int) -> torch.Tensor:
    """``[num_layers, 1, entries]``: row of (layer, kv) relative to a token's block row,
    ``(layer * entries + kv) * block_size``. The same every step, so built once (read-only)."""
    rows = torch.arange(kv_entries * num_layers, dtype=torch.long) * block_size
    return rows.view(num_layers, 1, kv_entries)


def _token_rows(
    token_counts: list[int],
    start_positions: list[int],
    block_ids: list[list[int]],
    blocks_needed: list[int],
    block_size: int,
    rows_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its position, and its K row in layer 0 (torch ops, no per-token Python)."""
    flat_blocks = torch.tensor(
        list(chain.from_iterable(ids[:need] for ids, need in zip(block_ids, blocks_needed))),
        dtype=torch.long,
    )
    counts = torch.tensor(token_counts, dtype=torch.long)
    starts = torch.tensor(start_positions, dtype=torch.long)
    needed = torch.tensor(blocks_needed, dtype=torch.long)
    block_offsets = (
        torch.cumsum(needed, 0) - needed
    )  # where each chunk's table starts in flat_blocks
    query_offsets = torch.cumsum(counts, 0) - counts
    chunk_of_token = torch.repeat_interleave(torch.arange(len(token_counts)), counts)
    positions = (
        starts[chunk_of_token] + torch.arange(int(counts.sum())) - query_offsets[chunk_of_token]
    )
    blocks = flat_blocks[block_offsets[chunk_of_token] + positions // block_size]
    return positions, blocks * rows_per_block + positions % block_size


def _visible(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Causal (and optionally windowed) visibility, broadcast over the two position grids."""
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    return visible


def as_stored(fresh: torch.Tensor, kv_cache_dtype: torch.dtype) -> torch.Tensor:
    """``fresh`` K or V as a read from the cache would give it back: rounded to a 16-bit
    cache's dtype under a wider model. Every read sees the cache's precision, so a prompt's
    tokens are the same computed in one chunk or several, or found in the prefix cache."""
    if fresh.dtype == kv_cache_dtype:
        return fresh
    return fresh.to(kv_cache_dtype).to(fresh.dtype)


def store_kv(
    key_value: torch.Tensor, kv_cache: torch.Tensor, layer: int, metadata: AttentionMetadata
) -> None:
    """Write this step's ``[num_tokens, entries, heads, head_size]`` rows into the layer's pages."""
    # Rows of [heads, head_size]: a view also of a tensor-parallel rank's head slice.
    rows = kv_cache.view(-1, *kv_cache.shape[-2:])
    rows[metadata.write_rows[layer]] = key_value.to(kv_cache.dtype)


def fresh_keys_values(
    chunk: PrefillAttention, key_value: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a chunk starting the prompt attends, ``[count, heads, head_size]``
    each: its own rows of the step's ``key_value``, at the cache's precision (as a later
    chunk reading them from the pages sees them). A one-entry cache's latent row is both."""
    fresh = key_value[chunk.query_start : chunk.query_end]
    last = fresh.shape[1] - 1
    return as_stored(fresh[:, 0], cache_dtype), as_stored(fresh[:, last], cache_dtype)


def paged_attention(
    query: torch.Tensor,
    key_value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    metadata: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Store this step's K/V in the layer's pages, then attend.

    ``query`` ``[num_tokens, num_heads, head_size]``; ``key_value``
    ``[num_tokens, 2, num_kv_heads, head_size]`` (K then V, any row stride); ``kv_cache``
    the whole KV tensor, ``layer`` the layer's slot in it. ``scale``: the softmax scale
    (``None``: ``1/sqrt(head_size)``). Returns ``[num_tokens, num_heads, head_size]``.
    """
    num_tokens = query.shape[0]
    store_kv(key_value, kv_cache, layer, metadata)
    layer_cache = kv_cache[:, layer]
    decode = metadata.decode
    if not metadata.prefills and decode is not None:  # decode-only: no output copy
        return split_kv_attention(query, layer_cache, decode, scale)
    output = torch.empty_like(query)
    for chunk in metadata.prefills:
        span = slice(chunk.query_start, chunk.query_end)
        if chunk.paged is not None:
            output[span] = split_kv_attention(query[span], layer_cache, chunk.paged, scale)
            continue
        keys, values = fresh_keys_values(chunk, key_value, layer_cache.dtype)
        attended = F.scaled_dot_product_attention(
            query[span].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=chunk.attn_mask,
            is_causal=chunk.attn_mask is None,
            enable_gqa=True,
            scale=scale,
        )
        output[span] = attended[0].transpose(0, 1)
    if decode is not None:
        output[decode.query_start :] = split_kv_attention(
            query[decode.query_start : num_tokens], layer_cache, decode, scale
        )
    return output
