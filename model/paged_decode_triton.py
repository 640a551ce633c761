"""Decode attention on CUDA that reads the KV pages in place: a Triton kernel, split over
the keys (flash-decoding), the GPU twin of the CPU's C++ kernel (``paged_decode_kernel.py``).

Why: without it a CUDA step gathers every row's whole context out of the pages into one
buffer per layer and then runs SDPA over it (``model/split_kv.py``), so each key is read,
written and read again. Here each program reads its keys once, where they lie:

    grid = (token, kv head, split)          row b's table: | p7 p2 p9 p4 | p1 p8 p3 p6 | p5 .. |
                                                             split 0       split 1      split 2
    program (t, h, s): the query heads of KV head h for token t, over split s's pages
      -> (out_s, lse_s) per query head      (online softmax over its pages, a tile of
                                              KEYS_PER_TILE keys from several pages at a time)
    out = sum_s out_s * softmax_s(lse_s)     (a second kernel, one program per query head;
                                              none where one split covers every row)

A token sees the keys ``[low, high)`` of its row's table (counted from the table's first
page, as the CPU kernel's ``key_ranges``): a decode's causal limit, a speculative draft's
own limit, a sliding window's start. Splits are sized so that about ``TARGET_PROGRAMS``
programs run at once (at most ``MAX_SPLITS`` per row): batch 1 at 8k tokens gets 64 short
splits per KV head, a large batch few.

Serves any query dtype over float32 or 16-bit pages, summing in float32; a 16-bit model over
pages of its own dtype multiplies on the tensor cores. Used only where Triton imports and the
tensors are on CUDA (``serves``); elsewhere the callers keep their paths. Checked on a GPU by
``tests/gpu/test_gpu_paged_attention.py``.

Measured on an H200 (``bench/bench_engine.py --device cuda``, smollm2's heads, bfloat16, GPU
time per layer from CUDA graph replays): 9-34 us at batch 1 and 8 x 2k and 8k tokens, 0.17-
0.58x contiguous SDPA's time and 2.7-6.6x faster than gathering the pages for SDPA. How it
got there, batch 8 x 8k: a page of 16 keys per step with float32 products took 126 us
(contiguous SDPA: 74); tiles of 64 keys 122 us; the tensor cores 34 us.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Programs to have in flight: several per streaming multiprocessor (an H100/H200 has 132),
# so that enough page reads are outstanding to keep the memory busy.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 64  # the merge holds a row's splits x the head in registers
# Keys a program reads per step, over several pages, so that their loads are in flight
# together. These three were swept on an H200 (32-128 keys, 1-4k programs, 4 or 8 warps):
# within 1.0-1.25x of the best at every shape measured.
KEYS_PER_TILE = 64
NUM_WARPS = 4  # per program of the split kernel
_PAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A 16-bit model over pages of its dtype multiplies on the tensor cores; a float32 query (a
# float32 model, over any pages) keeps float32 products, which the CUDA cores compute, a
# query head padded to 16 rows for tl.dot: compute-bound, 3.6x slower at batch 8 x 8k.
_NARROW_DTYPES = (torch.float16, torch.bfloat16)
# A program holds its query heads x a page's keys x the head in registers: wider heads keep
# the gather path (MLA's 576-wide latent rows have their own kernel: latent_decode_triton.py).
MAX_HEAD_SIZE = 256


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The jitted kernels (a split's attention, the splits' merge), defined on first use:
    Triton is imported only where CUDA is."""
    import triton
    import triton.language as tl

    # Triton reads a kernel's annotations (only its compile-time constants carry one).
    @triton.jit
    def paged_decode_split(  # type: ignore[no-untyped-def]
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
        query_token_stride,
        query_head_stride,
        page_stride,
        entry_stride,
        slot_stride,
        page_head_stride,
        table_row_stride,
        num_splits,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        KEYS: tl.constexpr,
        VALUE_ENTRY: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        TENSOR_CORES: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(token_rows + token)
        low = tl.load(low_keys + token)
        high = tl.load(high_keys + token)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_PAD)
        tile = tl.arange(0, KEYS)
        head_ok = heads < GROUP
        dim_ok = dims < HEAD
        q = tl.load(
            query
            + token * query_token_stride
            + (kv_head * GROUP + heads)[:, None] * query_head_stride
            + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        q_narrow = q.to(pages.dtype.element_ty)  # used under TENSOR_CORES only
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        split_first = split * keys_per_split
        split_end = tl.minimum(split_first + keys_per_split, high)
        # From the tile holding the split's first visible key to its last, none where the
        # split sees no key: every tile sees one (one that saw none would take exp(-inf -
        # -inf): NaN), and pages past a row's context (a static step's tables are as wide
        # as the longest row) cost no step.
        first_tile = split_first + tl.maximum(low - split_first, 0) // KEYS * KEYS
        last = tl.where(low < split_end, split_end, first_tile)
        for first_key in range(first_tile, last, KEYS):
            # KEYS keys over several pages at once: their loads are in flight together.
            positions = first_key + tile
            visible = (positions >= low) & (positions < split_end)
            page = tl.load(
                tables + row * table_row_stride + positions // BLOCK, mask=visible, other=0
            )
            offsets = (
                page[:, None] * page_stride
                + (positions % BLOCK)[:, None] * slot_stride
                + kv_head * page_head_stride
                + dims[None, :]
            )
            loaded = visible[:, None] & dim_ok[None, :]
            keys = tl.load(pages + offsets, mask=loaded, other=0.0)
            values = tl.load(pages + VALUE_ENTRY * entry_stride + offsets, mask=loaded, other=0.0)
            if TENSOR_CORES:  # 16-bit operands, float32 sums: a 16-bit model's own precision
                scores = tl.dot(q_narrow, tl.trans(keys)) * scale
            else:
                keys = keys.to(tl.float32)
                values = values.to(tl.float32)
                scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, axis=1)
            if TENSOR_CORES:
                attended = tl.dot(weights.to(values.dtype), values)
            else:
                attended = tl.dot(weights, values, input_precision="ieee")
            acc = acc * rescale[:, None] + attended
            best = new_best
        out_row = (token * tl.num_programs(1) + kv_head) * GROUP + heads
        seen = total > 0
        out = acc / tl.where(seen, total, 1.0)[:, None]
        stored = head_ok[:, None] & dim_ok[None, :]
        if ONE_SPLIT:  # the whole row in one program: its output is final
            final = output + out_row[:, None] * HEAD + dims[None, :]
            tl.store(final, out.to(output.dtype.element_ty), mask=stored)
        else:
            partial = partial_out + (out_row[:, None] * num_splits + split) * HEAD + dims[None, :]
            tl.store(partial, out, mask=stored)
            lse = tl.where(seen, best + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
            tl.store(partial_lse + out_row * num_splits + split, lse, mask=head_ok)

    @triton.jit
    def merge_splits(  # type: ignore[no-untyped-def]
        partial_out,
        partial_lse,
        output,
        num_splits,
        HEAD: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)  # token * num_heads + head
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_PAD)
        split_ok = splits < num_splits
        lse = tl.load(partial_lse + row * num_splits + splits, mask=split_ok, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, axis=0))
        weights = weights / tl.sum(weights, axis=0)
        parts = tl.load(
            partial_out + (row * num_splits + splits)[:, None] * HEAD + dims[None, :],
            mask=split_ok[:, None] & (dims < HEAD)[None, :],
            other=0.0,
        )
        merged = tl.sum(parts * weights[:, None], axis=0)
        tl.store(output + row * HEAD + dims, merged.to(output.dtype.element_ty), mask=dims < HEAD)

    return paged_decode_split, merge_splits


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def serves(query: torch.Tensor, layer_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these decode rows: CUDA tensors, pages of a supported dtype,
    unit stride on the head dimension, heads of at most ``MAX_HEAD_SIZE``, a power-of-two
    block size (Triton's ranges are), and Triton importable."""
    return (
        query.is_cuda
        and layer_cache.is_cuda
        and layer_cache.dtype in _PAGE_DTYPES
        and query.stride(-1) == 1
        and layer_cache.stride(-1) == 1
        and layer_cache.shape[-1] <= MAX_HEAD_SIZE
        and layer_cache.shape[2] & (layer_cache.shape[2] - 1) == 0
        and triton_available()
    )


def paged_decode(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    tables: torch.Tensor,
    token_rows: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """``query`` ``[num_tokens, num_heads, head_size]`` attended over ``layer_cache``
    ``[blocks, entries, block_size, kv_heads, head_size]``: token ``t`` of row
    ``token_rows[t]`` sees keys ``[low[t], high[t])`` of that row's pages ``tables[row]``.
    A one-entry cache (latent rows) serves as its own values. Call only where ``serves``."""
    num_tokens, num_heads, head_size = query.shape
    _, entries, block_size, num_kv_heads, _ = layer_cache.shape
    group = num_heads // num_kv_heads
    num_splits, keys_per_split = split_pages(tables.shape[1], block_size, num_tokens * num_kv_heads)
    output = torch.empty(num_tokens, num_heads, head_size, device=query.device, dtype=query.dtype)
    partial_out, partial_lse = partials(output, num_splits)
    head_pad = max(16, 1 << (head_size - 1).bit_length())
    split_kernel, _ = _kernels()
    split_kernel[(num_tokens, num_kv_heads, num_splits)](
        query,
        layer_cache,
        tables,
        token_rows,
        low,
        high,
        partial_out,
        partial_lse,
        output,
        head_size**-0.5 if scale is None else scale,
        keys_per_split,
        query.stride(0),
        query.stride(1),
        layer_cache.stride(0),
        layer_cache.stride(1),
        layer_cache.stride(2),
        layer_cache.stride(3),
        tables.stride(0),
        num_splits,
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),  # tl.dot takes 16 rows or more
        HEAD=head_size,
        HEAD_PAD=head_pad,
        BLOCK=block_size,
        KEYS=keys_per_tile(keys_per_split),
        VALUE_ENTRY=entries - 1,
        ONE_SPLIT=num_splits == 1,
        TENSOR_CORES=query.dtype == layer_cache.dtype and query.dtype in _NARROW_DTYPES,
        num_warps=NUM_WARPS,
    )
    merge(partial_out, partial_lse, output, num_splits)
    return output


def split_pages(
    width: int, block_size: int, programs_per_split: int, max_splits: int = MAX_SPLITS
) -> tuple[int, int]:
    """``(splits, keys per split)`` of tables ``width`` pages wide, so that about
    ``TARGET_PROGRAMS`` programs run when each split takes ``programs_per_split`` of them
    (at most ``max_splits``). Only the shapes decide: a padded batch's grid is fixed."""
    wanted = min(max_splits, max(1, TARGET_PROGRAMS // max(1, programs_per_split)))
    blocks_per_split = -(-width // min(width, wanted))
    return -(-width // blocks_per_split), blocks_per_split * block_size


def keys_per_tile(keys_per_split: int) -> int:
    """Keys a program reads per step: ``KEYS_PER_TILE``, or fewer for a short split (16 at
    least, what ``tl.dot`` takes)."""
    return min(KEYS_PER_TILE, max(16, 1 << (keys_per_split - 1).bit_length()))


def partials(output: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's float32 output and log-sum-exp per (token, head) row of ``output``
    ``[tokens, heads, width]``; ``output`` itself (unused) where one split finishes a row."""
    if num_splits == 1:
        return output, output
    rows, width = output.shape[0] * output.shape[1], output.shape[2]
    return (
        output.new_empty(rows, num_splits, width, dtype=torch.float32),
        output.new_empty(rows, num_splits, dtype=torch.float32),
    )


def merge(
    partial_out: torch.Tensor, partial_lse: torch.Tensor, output: torch.Tensor, num_splits: int
) -> None:
    """The splits' outputs, weighed by their log-sum-exps, into ``output`` (none to merge
    where one split finished each row)."""
    if num_splits == 1:
        return
    width = output.shape[2]
    _, merge_kernel = _kernels()
    merge_kernel[(output.shape[0] * output.shape[1],)](
        partial_out,
        partial_lse,
        output,
        num_splits,
        HEAD=width,
        HEAD_PAD=max(16, 1 << (width - 1).bit_length()),
        SPLITS_PAD=max(2, 1 << (num_splits - 1).bit_length()),
    )
