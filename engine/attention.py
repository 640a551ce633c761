"""Paged attention in plain torch: write K/V into slots, gather blocks, one SDPA call.

The KV tensor is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]``
(docs/architecture.md); a layer sees ``kv_cache[:, layer]``. A step's tokens arrive
flattened, multi-token chunks (prefills) first, then single-token chunks (decodes):

    tokens:  | prefill A (n_A) | prefill B (n_B) | d0 | d1 | d2 |
              └ one SDPA each ┘                   └ one SDPA for all, padded + masked ┘

Per layer: every token's K/V goes to its slot (``block_id * block_size + offset``);
then each prefill chunk gathers its blocks (positions ``0 .. end``) and attends with
the causal offset its prefix needs (query ``i`` at position ``start + i`` sees keys
``0 .. start + i``); the decodes gather their block tables padded to the longest, and
a mask hides the padding. Everything that is the same for all layers (indices, masks)
is built once per step in :func:`build_attention_metadata`, with O(batch) Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillAttention:
    """One multi-token chunk: its query rows, its blocks and its mask.

    ``attn_mask`` is ``None`` for a chunk that starts at position 0 with full attention
    (plain causal, so SDPA's ``is_causal`` serves); else ``[1, 1, num_queries, seq_len]`` bool.
    """

    query_start: int
    query_end: int
    block_table: torch.Tensor  # [num_blocks_needed] long
    seq_len: int
    attn_mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeAttention:
    """All single-token chunks of the step, as one padded batch.

    Rows ``query_start ..`` of the step's tokens; ``block_tables`` ``[batch, max_blocks]``
    (padded with block 0, masked); ``attn_mask`` ``[batch, 1, 1, max_blocks * block_size]``.
    """

    query_start: int
    block_tables: torch.Tensor
    attn_mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's K/V go and what each query may see; shared by all layers."""

    positions: torch.Tensor  # [num_tokens] long: each token's position in its request
    slot_block_ids: torch.Tensor  # [num_tokens] long: the block each token's K/V is written to
    slot_offsets: torch.Tensor  # [num_tokens] long: its offset inside that block
    prefills: list[PrefillAttention]
    decode: DecodeAttention | None


def build_attention_metadata(
    token_counts: list[int],
    start_positions: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Index tensors and masks for a step whose chunks are ordered prefills-then-decodes.

    ``token_counts[i] > 1`` for every prefill, ``== 1`` for every decode; decodes come last.
    ``block_ids[i]`` must cover the chunk's end position.
    """
    num_chunks = len(token_counts)
    blocks_needed = [-(-(start + count) // block_size) for start, count in zip(start_positions, token_counts)]
    for i in range(num_chunks):
        if len(block_ids[i]) < blocks_needed[i]:
            raise ValueError(
                f"chunk {i} ends at position {start_positions[i] + token_counts[i]} but has only "
                f"{len(block_ids[i])} blocks of {block_size} tokens"
            )
    flat_blocks = torch.tensor(
        list(chain.from_iterable(ids[:need] for ids, need in zip(block_ids, blocks_needed))), dtype=torch.long
    )
    counts = torch.tensor(token_counts, dtype=torch.long)
    starts = torch.tensor(start_positions, dtype=torch.long)
    needed = torch.tensor(blocks_needed, dtype=torch.long)
    block_offsets = torch.cumsum(needed, 0) - needed  # where each chunk's table starts in flat_blocks
    query_offsets = torch.cumsum(counts, 0) - counts

    # Per token: its chunk, its position, and the slot it writes.
    chunk_of_token = torch.repeat_interleave(torch.arange(num_chunks), counts)
    positions = starts[chunk_of_token] + torch.arange(int(counts.sum())) - query_offsets[chunk_of_token]
    slot_block_ids = flat_blocks[block_offsets[chunk_of_token] + positions // block_size]
    slot_offsets = positions % block_size

    num_prefills = sum(1 for count in token_counts if count > 1)
    prefills = []
    for i in range(num_prefills):
        start, count = start_positions[i], token_counts[i]
        query_start = int(query_offsets[i])
        table = flat_blocks[int(block_offsets[i]) : int(block_offsets[i]) + blocks_needed[i]]
        mask = None
        if start > 0 or sliding_window is not None:
            query_pos = torch.arange(start, start + count)[:, None]
            mask = _visible(query_pos, torch.arange(start + count)[None, :], sliding_window)[None, None]
            mask = mask.to(device)
        prefills.append(
            PrefillAttention(query_start, query_start + count, table.to(device), start + count, mask)
        )

    decode = None
    if num_prefills < num_chunks:
        decode_counts = needed[num_prefills:]
        max_blocks = int(decode_counts.max())
        # Padded [batch, max_blocks] table from the flat list: column j of row b is
        # flat_blocks[offset_b + j] while j < blocks_b, else block 0 (masked below).
        columns = torch.arange(max_blocks)[None, :]
        in_table = columns < decode_counts[:, None]
        gather_at = torch.where(in_table, block_offsets[num_prefills:, None] + columns, 0)
        tables = torch.where(in_table, flat_blocks[gather_at], 0)
        query_pos = starts[num_prefills:, None]
        key_pos = torch.arange(max_blocks * block_size)[None, :]
        mask = _visible(query_pos, key_pos, sliding_window)[:, None, None, :]
        decode = DecodeAttention(int(query_offsets[num_prefills]), tables.to(device), mask.to(device))

    return AttentionMetadata(
        positions.to(device), slot_block_ids.to(device), slot_offsets.to(device), prefills, decode
    )


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Causal (and optionally windowed) visibility, broadcast over the two position grids."""
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    return visible


def _gather_pages(layer_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in ``block_table`` (any shape), as ``[*table_shape[:-1], tokens, ...]``.

    One ``index_select`` of whole pages (K and V together, contiguous per block) is
    about twice as fast on the CPU as advanced indexing the strided K and V views.
    """
    pages = layer_cache.index_select(0, block_table.flatten()).view(*block_table.shape, *layer_cache.shape[1:])
    block_dim = block_table.dim() - 1  # pages: [*table, 2, block_size, kv_heads, head]
    keys = pages.select(block_dim + 1, 0).flatten(block_dim, block_dim + 1)
    values = pages.select(block_dim + 1, 1).flatten(block_dim, block_dim + 1)
    return keys, values


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Store this step's K/V in the layer's pages, then attend.

    ``query`` ``[num_tokens, num_heads, head_size]``; ``key``/``value``
    ``[num_tokens, num_kv_heads, head_size]``; ``layer_cache`` is ``kv_cache[:, layer]``,
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]``. Returns ``[num_tokens, num_heads, head_size]``.
    """
    key_cache, value_cache = layer_cache[:, 0], layer_cache[:, 1]
    key_cache[metadata.slot_block_ids, metadata.slot_offsets] = key
    value_cache[metadata.slot_block_ids, metadata.slot_offsets] = value
    output = torch.empty_like(query)
    for chunk in metadata.prefills:
        keys, values = _gather_pages(layer_cache, chunk.block_table)  # [seq, kv_heads, head] each
        keys, values = keys[: chunk.seq_len], values[: chunk.seq_len]
        queries = query[chunk.query_start : chunk.query_end]
        attended = F.scaled_dot_product_attention(
            queries.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=chunk.attn_mask,
            is_causal=chunk.attn_mask is None,
            enable_gqa=True,
        )
        output[chunk.query_start : chunk.query_end] = attended[0].transpose(0, 1)
    decode = metadata.decode
    if decode is not None:
        batch = decode.block_tables.shape[0]
        keys, values = _gather_pages(layer_cache, decode.block_tables)  # [batch, max_blocks * block_size, ...]
        queries = query[decode.query_start : decode.query_start + batch]
        attended = F.scaled_dot_product_attention(
            queries[:, :, None, :],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=decode.attn_mask,
            enable_gqa=True,
        )
        output[decode.query_start :] = attended[:, :, 0, :]
    return output
