"""Decode attention over paged KV, the candidates measured side by side rather than
assumed (issue 24), against SDPA over a contiguous cache of the same keys:

- *kernel*: the engine's path on CPU, the C++ kernel reading the pages in place
  (``model/paged_decode_kernel.py``);
- *chunks*: the torch split-KV path it falls back to (each chunk of pages gathered into a
  buffer, then attended; ``model/split_kv.py``);
- *flex*: PyTorch's FlexAttention over the same pages, compiled.

One layer, smollm2's heads (9 query / 3 KV heads of 64, float32), one decode query per
row, shuffled pages of the engine's layout ``[blocks, layers, K/V, block_size, heads, dim]``
(30 layers), one thread.

How FlexAttention reads the pages in place: the whole KV tensor, flattened to rows, is one
key sequence (and, one page further on, one value sequence); a block mask's KV blocks, at the
page size, name each row's pages in it (``(block * layers + layer) * 2``), and its mask
cuts the last page at the context's end. No copy; a compiled kernel (``torch.compile``,
dynamic shapes: the first call compiles, a new batch size compiles once more).

Per page size and shape: the times (best of ``--rounds``), their ratios to contiguous SDPA,
and the kernel's and flex's largest difference from SDPA's output. The aim is <= 1.3x
contiguous. Last, the kernel over the same pages stored in float16 and bfloat16 (a 16-bit
``kv_cache_dtype``, widened as read), as a ratio to its time over the float32 pages.

Run: python bench/bench_paged_attention.py   (≈ 2 minutes, 1.5 GiB of pages)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pdserve.model import paged_decode_kernel
from pdserve.model.attention import build_attention_metadata
from pdserve.model.split_kv import SPLIT_KV_BYTES, split_kv_attention

LAYERS, KV_HEADS, QUERY_HEADS, HEAD_DIM = 30, 3, 9, 64
LAYER = 3  # the layer attended (any: its pages are interleaved with the others')
SHAPES = [(1, 2048), (8, 2048), (1, 8192), (8, 8192)]


def best_of(rounds: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def flex_block_mask(
    tables: list[list[int]], context: int, block_size: int, num_rows: int
) -> BlockMask:
    """The pages of each row's ``context`` keys for layer ``LAYER``'s keys, as KV blocks of
    the flattened pool; the last page masked past the context's end."""
    batch, num_pages = len(tables), len(tables[0])
    # The mask must span the whole pool's rows, though only the first entries are read.
    indices = torch.zeros(batch, 1, 1, -(-num_rows // block_size), dtype=torch.int32)
    pages = torch.tensor(tables, dtype=torch.int32)
    indices[:, 0, 0, :num_pages] = (pages * LAYERS + LAYER) * 2
    last_page_rows = indices[:, 0, 0, num_pages - 1].long() * block_size
    fill = context - (num_pages - 1) * block_size

    def within_context(b, h, q, kv):
        offset = kv - last_page_rows[b]  # in the last page: 0 .. block_size - 1
        return (offset < 0) | (offset >= block_size) | (offset < fill)

    counts = torch.full((batch, 1, 1), num_pages, dtype=torch.int32)
    return BlockMask.from_kv_blocks(
        counts,
        indices,
        BLOCK_SIZE=(1, block_size),
        mask_mod=within_context,
        seq_lengths=(1, num_rows),
        compute_q_blocks=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    compiled = torch.compile(flex_attention, dynamic=True)
    print(
        f"one layer's decode attention, {QUERY_HEADS} query / {KV_HEADS} KV heads x {HEAD_DIM}, "
        f"float32, pages of a {LAYERS}-layer pool, shuffled; 1 thread, best of {args.rounds}"
    )
    if paged_decode_kernel.build() is None:
        raise SystemExit("the paged decode kernel cannot be built here (no C++ compiler)")
    print(
        f"{'page':>4} {'shape':>9} {'kernel':>7} {'chunks':>7} {'flex':>7} {'SDPA':>6} "
        f"{'kernel/SDPA':>11} {'chunks/SDPA':>11} {'flex/SDPA':>9} {'kernel err':>10} "
        f"{'flex err':>8} {'compile s':>9} {'f16/f32':>7} {'bf16/f32':>8}"
    )
    for block_size in args.page_sizes:
        num_blocks = max(b * c for b, c in SHAPES) // block_size + 1
        pool = torch.zeros(num_blocks, LAYERS, 2, block_size, KV_HEADS, HEAD_DIM)
        pool.uniform_(-1, 1, generator=generator)
        narrow = [pool.to(torch.float16), pool.to(torch.bfloat16)]
        for batch, context in SHAPES:
            print(shape_row(pool, narrow, batch, context, compiled, generator, args.rounds))


def shape_row(
    pool: torch.Tensor,
    narrow: list[torch.Tensor],
    batch: int,
    context: int,
    compiled: Callable,
    generator: torch.Generator,
    rounds: int,
) -> str:
    """The candidates at ``batch`` rows of ``context`` keys over shuffled pages of ``pool``,
    and the kernel over the same pages in each 16-bit dtype of ``narrow``."""
    block_size = pool.shape[3]
    rows = pool.view(-1, KV_HEADS, HEAD_DIM)
    keys = rows[:-block_size].permute(1, 0, 2).unsqueeze(0)  # [1, heads, rows, dim]
    values = rows[block_size:].permute(1, 0, 2).unsqueeze(0)  # one page on: V's rows
    num_pages = context // block_size
    order = torch.randperm(pool.shape[0] - 1, generator=generator)[: batch * num_pages] + 1
    tables = order.view(batch, num_pages).tolist()
    query = torch.randn(batch, QUERY_HEADS, HEAD_DIM, generator=generator)
    metadata = build_attention_metadata(
        [1] * batch,
        [context - 1] * batch,
        tables,
        block_size,
        LAYERS,
        torch.device("cpu"),
        split_kv_keys=max(1, SPLIT_KV_BYTES // pool[0, 0, :, 0].nbytes),
    )
    decode = metadata.decode
    assert decode is not None and decode.key_ranges is not None  # decode rows on CPU
    in_chunks = dataclasses.replace(decode, key_ranges=None)
    gathered = pool[torch.tensor(tables), LAYER].transpose(1, 2)  # [b, K/V, pages, ...]
    contiguous = gathered.reshape(batch, 2, context, KV_HEADS, HEAD_DIM).transpose(2, 3)
    contiguous = contiguous.contiguous()
    grouped = query.view(batch, KV_HEADS, -1, HEAD_DIM)
    mask = flex_block_mask(tables, context, block_size, keys.shape[2])

    def kernel() -> torch.Tensor:  # what split_kv_attention runs for decode rows on CPU
        with torch.inference_mode():
            return split_kv_attention(query, pool[:, LAYER], decode)

    def chunks() -> torch.Tensor:
        with torch.inference_mode():
            return split_kv_attention(query, pool[:, LAYER], in_chunks)

    def flex() -> torch.Tensor:
        heads_first = query.unsqueeze(2)  # [b, heads, 1, dim]
        return compiled(heads_first, keys, values, block_mask=mask, enable_gqa=True).squeeze(2)

    def sdpa() -> torch.Tensor:
        attended = F.scaled_dot_product_attention(grouped, contiguous[:, 0], contiguous[:, 1])
        return attended.reshape(batch, QUERY_HEADS, HEAD_DIM)

    started = time.perf_counter()
    flex_out = flex()
    compile_s = time.perf_counter() - started
    reference = sdpa()
    flex_error = (flex_out - reference).abs().max().item()
    kernel_error = (kernel() - reference).abs().max().item()

    def kernel_over(pages: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.inference_mode():
                return split_kv_attention(query, pages[:, LAYER], decode)

        return run

    runs = {"kernel": kernel, "chunks": chunks, "flex": flex, "sdpa": sdpa}
    runs |= {str(pages.dtype): kernel_over(pages) for pages in narrow}
    times = {name: best_of(rounds, run) for name, run in runs.items()}
    widened = "".join(f" {times[str(pages.dtype)] / times['kernel']:>7.2f}x" for pages in narrow)
    sdpa_s = times["sdpa"]
    return (
        f"{block_size:>4} {batch:>2} x {context:<5} {times['kernel'] * 1e3:6.2f}m "
        f"{times['chunks'] * 1e3:6.2f}m {times['flex'] * 1e3:6.2f}m {sdpa_s * 1e3:5.2f}m "
        f"{times['kernel'] / sdpa_s:>10.2f}x {times['chunks'] / sdpa_s:>10.2f}x "
        f"{times['flex'] / sdpa_s:>8.2f}x {kernel_error:10.1e} {flex_error:8.1e} "
        f"{compile_s:9.1f}{widened}"
    )


if __name__ == "__main__":
    main()
