"""MLA's absorbed decode on CUDA: a Triton kernel over the latent pages, read in place.

Why its own kernel: in the absorbed form (``architectures/mla.py``) every query head attends
the same cached rows ``| latent c (R) | k_rope (P) |`` (576 values for DeepSeek-V3), which
serve as keys and, their latent part, as values. ``paged_decode_triton.py`` gives one
program all the query heads of a KV head: here that is every head (128 for V3) times a
576-wide row, far past a program's registers, and 576 is no power of two for Triton's ranges.
So a program takes a block of ``HEADS`` query heads, and the row in its two parts::

    grid = (token, head block, split)       query  | q_lat [HEADS, R] | q_rope [HEADS, P] |
    per tile of KEYS cached rows:           rows   | c [KEYS, R]      | k_rope [KEYS, P]  |
      scores = q_lat · cᵀ + q_rope · k_ropeᵀ               [HEADS, KEYS], online softmax
      acc   += softmax · c                                  [HEADS, R]: the latent output

The latent output ``[tokens, heads, R]`` leaves through ``W_UV`` in the caller. Splits over
the pages and their merge are the GQA kernel's (``split_pages``, ``merge``): the grid depends
only on the token count and the tables' width, so a CUDA graph captures it
(``engine/decode_graphs.py``). Checked in Triton's interpreter on CPU tensors
(``tests/model/interpreter_checks_paged_decode.py``); on a GPU by ``tests/gpu/``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pdserve.model import paged_decode_triton
from pdserve.model.paged_decode_triton import keys_per_tile, merge, partials, split_pages

HEADS = 16  # query heads per program: tl.dot's least M
# The merge holds a row's splits x the latent width (512 for V3) in one program's registers.
MAX_SPLITS = 16
NUM_WARPS = 8  # a program holds HEADS x R float32 sums (8k values for V3's R = 512)


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, defined on first use: Triton is imported only where it runs."""
    import triton
    import triton.language as tl

    @triton.jit
    def latent_decode_split(  # type: ignore[no-untyped-def]
        query,
        pages,
        tables,
        token_rows,
        low_keys,
        high_keys,
        partial_out,
        partial_lse,
        output,
        scale,
        keys_per_split,
        num_heads,
        query_token_stride,
        query_head_stride,
        page_stride,
        slot_stride,
        table_row_stride,
        num_splits,
        LATENT: tl.constexpr,
        LATENT_PAD: tl.constexpr,
        ROPE: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        HEADS: tl.constexpr,
        BLOCK: tl.constexpr,
        KEYS: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        TENSOR_CORES: tl.constexpr,
    ):
        token = tl.program_id(0)
        split = tl.program_id(2)
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        row = tl.load(token_rows + token)
        low = tl.load(low_keys + token)
        high = tl.load(high_keys + token)
        latent = tl.arange(0, LATENT_PAD)
        rope = tl.arange(0, ROPE_PAD)
        tile = tl.arange(0, KEYS)
        head_ok = heads < num_heads
        latent_ok = latent < LATENT
        rope_ok = rope < ROPE
        query_rows = query + token * query_token_stride + heads[:, None] * query_head_stride
        q_latent = tl.load(
            query_rows + latent[None, :], mask=head_ok[:, None] & latent_ok[None, :], other=0.0
        ).to(tl.float32)
        q_rope = tl.load(
            query_rows + LATENT + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0
        ).to(tl.float32)
        q_latent_narrow = q_latent.to(pages.dtype.element_ty)  # used under TENSOR_CORES only
        q_rope_narrow = q_rope.to(pages.dtype.element_ty)
        best = tl.full([HEADS], float("-inf"), tl.float32)
        total = tl.zeros([HEADS], tl.float32)
        acc = tl.zeros([HEADS, LATENT_PAD], tl.float32)
        split_first = split * keys_per_split
        split_end = tl.minimum(split_first + keys_per_split, high)
        # From the tile holding the split's first visible key to its last, none where the
        # split sees no key: every tile sees one (one that saw none would take exp(-inf -
        # -inf): NaN), and pages past a row's context (a static step's tables are as wide
        # as the longest row) cost no step.
        first_tile = split_first + tl.maximum(low - split_first, 0) // KEYS * KEYS
        last = tl.where(low < split_end, split_end, first_tile)
        for first_key in range(first_tile, last, KEYS):
            positions = first_key + tile
            visible = (positions >= low) & (positions < split_end)
            page = tl.load(
                tables + row * table_row_stride + positions // BLOCK, mask=visible, other=0
            )
            slots = pages + page * page_stride + (positions % BLOCK) * slot_stride
            latents = tl.load(
                slots[:, None] + latent[None, :],
                mask=visible[:, None] & latent_ok[None, :],
                other=0.0,
            )
            ropes = tl.load(
                slots[:, None] + LATENT + rope[None, :],
                mask=visible[:, None] & rope_ok[None, :],
                other=0.0,
            )
            if TENSOR_CORES:  # 16-bit operands, float32 sums
                scores = tl.dot(q_latent_narrow, tl.trans(latents))
                scores += tl.dot(q_rope_narrow, tl.trans(ropes))
            else:
                latents = latents.to(tl.float32)
                scores = tl.dot(q_latent, tl.trans(latents), input_precision="ieee")
                scores += tl.dot(q_rope, tl.trans(ropes.to(tl.float32)), input_precision="ieee")
            scores = tl.where(visible[None, :], scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, axis=1)
            if TENSOR_CORES:
                attended = tl.dot(weights.to(latents.dtype), latents)
            else:
                attended = tl.dot(weights, latents, input_precision="ieee")
            acc = acc * rescale[:, None] + attended
            best = new_best
        out_row = token * num_heads + heads
        seen = total > 0
        out = acc / tl.where(seen, total, 1.0)[:, None]
        stored = head_ok[:, None] & latent_ok[None, :]
        if ONE_SPLIT:
            final = output + out_row[:, None] * LATENT + latent[None, :]
            tl.store(final, out.to(output.dtype.element_ty), mask=stored)
        else:
            partial = (
                partial_out + (out_row[:, None] * num_splits + split) * LATENT + latent[None, :]
            )
            tl.store(partial, out, mask=stored)
            lse = tl.where(seen, best + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
            tl.store(partial_lse + out_row * num_splits + split, lse, mask=head_ok)

    return latent_decode_split


def serves(query: torch.Tensor, layer_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these absorbed queries: CUDA tensors, one-entry pages of a
    supported dtype (latent rows), unit strides on the row, a power-of-two block size, and
    Triton importable."""
    return (
        query.is_cuda
        and layer_cache.is_cuda
        and layer_cache.shape[1] == 1
        and layer_cache.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and query.stride(-1) == 1
        and layer_cache.stride(-1) == 1
        and layer_cache.shape[2] & (layer_cache.shape[2] - 1) == 0
        and paged_decode_triton.triton_available()
    )


def latent_decode(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    tables: torch.Tensor,
    token_rows: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    scale: float,
    latent_size: int,
) -> torch.Tensor:
    """Absorbed queries ``[tokens, heads, R + P]`` over latent pages ``[blocks, 1,
    block_size, 1, R + P]`` (``R = latent_size``): token ``t`` of row ``token_rows[t]`` sees
    the rows ``[low[t], high[t])`` of ``tables[row]``; returns the attended latents
    ``[tokens, heads, R]``. Call only where ``serves``."""
    num_tokens, num_heads, row_size = query.shape
    block_size = layer_cache.shape[2]
    rope_size = row_size - latent_size
    head_blocks = -(-num_heads // HEADS)
    num_splits, keys_per_split = split_pages(
        tables.shape[1], block_size, num_tokens * head_blocks, MAX_SPLITS
    )
    output = query.new_empty(num_tokens, num_heads, latent_size)
    partial_out, partial_lse = partials(output, num_splits)
    _kernel()[(num_tokens, head_blocks, num_splits)](
        query,
        layer_cache,
        tables,
        token_rows,
        low,
        high,
        partial_out,
        partial_lse,
        output,
        scale,
        keys_per_split,
        num_heads,
        query.stride(0),
        query.stride(1),
        layer_cache.stride(0),
        layer_cache.stride(2),
        tables.stride(0),
        num_splits,
        LATENT=latent_size,
        LATENT_PAD=max(16, 1 << (latent_size - 1).bit_length()),
        ROPE=rope_size,
        ROPE_PAD=max(16, 1 << (rope_size - 1).bit_length()),
        HEADS=HEADS,
        BLOCK=block_size,
        KEYS=min(keys_per_tile(keys_per_split), 32),  # HEADS x KEYS x R stays in registers
        ONE_SPLIT=num_splits == 1,
        TENSOR_CORES=query.dtype == layer_cache.dtype and query.dtype != torch.float32,
        num_warps=NUM_WARPS,
    )
    merge(partial_out, partial_lse, output, num_splits)
    return output
