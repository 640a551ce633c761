"""Split-KV decode over pages equals dense attention over each row's visible keys.

Rows hold one query (a decode) or several (a speculative verification: each query sees the
keys up to its own position). Decode rows are served by the CPU's paged decode kernel
(``model/paged_decode_kernel.py``) where it is built, else by the chunked torch path: the
decode tests run both.

Random block tables (shuffled, never contiguous), rows of unequal lengths, sliding windows
and chunk budgets down to one block per row, so that chunks hold padded rows, rows that see
nothing of a chunk, and windows that start mid-block. The reference is float64 softmax
attention over exactly the keys a row may see.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model import paged_decode_kernel
from pdserve.model.attention import build_attention_metadata, paged_attention
from pdserve.model.split_kv import plan_split_kv, split_kv_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 8
BLOCK_SIZES = st.sampled_from([1, 4, 16])
WINDOWS = st.one_of(st.none(), st.integers(1, 40))
CHUNK_KEYS = st.one_of(st.none(), st.integers(1, 200))  # also split_kv_keys: keys per chunk
SEEDS = st.integers(0, 2**16)
DECODE_PATHS = pytest.mark.parametrize("path", ["kernel", "chunks"])


@contextlib.contextmanager
def decode_path(path: str) -> Iterator[None]:
    """Decode rows read by the kernel (skipped where it cannot be built), or by the chunks."""
    if path == "kernel":
        if paged_decode_kernel.build() is None:
            pytest.skip("the paged decode kernel cannot be built here (no C++ compiler)")
        yield
        return
    with mock.patch.object(paged_decode_kernel, "serves", return_value=False):
        yield


def dense_reference(query, keys, values, position, window):
    """float64 attention of one row's query ``[heads, head]`` over its visible keys."""
    first = 0 if window is None else max(0, position - window + 1)
    group = NUM_HEADS // NUM_KV_HEADS
    k = keys[first : position + 1].double().repeat_interleave(group, dim=1)
    v = values[first : position + 1].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", query.double(), k) / HEAD_SIZE**0.5
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


@settings(max_examples=60, deadline=None)
@given(
    positions=st.lists(st.integers(0, 90), min_size=1, max_size=5),
    block_size=BLOCK_SIZES,
    window=WINDOWS,
    chunk_keys=CHUNK_KEYS,
    seed=SEEDS,
)
@DECODE_PATHS
def test_split_kv_decode_equals_dense_attention(
    path, positions, block_size, window, chunk_keys, seed
):
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    tables_needed = [p // block_size + 1 for p in positions]
    num_blocks = sum(tables_needed) + 1
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(need)] for need in tables_needed]
    layer_cache = torch.randn(
        num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=generator
    )
    if window is not None:  # blocks wholly before the window are the null block, as in the pool
        for table, position in zip(tables, positions):
            for index in range(max(0, position - window + 1) // block_size):
                table[index] = 0
    query = torch.randn(len(positions), NUM_HEADS, HEAD_SIZE, generator=generator)
    decode = plan_split_kv(
        0, positions, tables, block_size, torch.device("cpu"), torch.float32, window, chunk_keys
    )
    first_blocks = [
        0 if window is None else max(0, p - window + 1) // block_size for p in positions
    ]
    width = max(need - first for need, first in zip(tables_needed, first_blocks))
    per_chunk = width if chunk_keys is None else max(1, chunk_keys // (len(positions) * block_size))
    assert len(decode.chunks) == -(-width // per_chunk)
    with decode_path(path):
        attended = split_kv_attention(query, layer_cache, decode)
    for row, (table, position) in enumerate(zip(tables, positions)):
        keys = layer_cache[table, 0].flatten(0, 1)
        values = layer_cache[table, 1].flatten(0, 1)
        expected = dense_reference(query[row], keys, values, position, window)
        torch.testing.assert_close(attended[row].double(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 6)), min_size=1, max_size=4),
    block_size=BLOCK_SIZES,
    window=WINDOWS,
    chunk_keys=CHUNK_KEYS,
    seed=SEEDS,
)
@DECODE_PATHS
def test_verification_rows_of_several_queries_equal_dense_causal_attention(
    path, rows, block_size, window, chunk_keys, seed
):
    """Rows of 1 to 6 queries (a last token and its drafts) at positions ``p .. p+n-1``:
    query ``j`` equals dense attention over the keys up to ``p + j``."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    tables_needed = [(p + n - 1) // block_size + 1 for p, n in rows]
    num_blocks = sum(tables_needed) + 1
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(need)] for need in tables_needed]
    layer_cache = torch.randn(
        num_blocks, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=generator
    )
    num_tokens = sum(n for _, n in rows)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator)
    decode = plan_split_kv(
        0,
        [p for p, _ in rows],
        tables,
        block_size,
        torch.device("cpu"),
        torch.float32,
        window,
        chunk_keys,
        [n for _, n in rows],
    )
    with decode_path(path):
        attended = split_kv_attention(query, layer_cache, decode)
    assert attended.shape == query.shape
    token = 0
    for table, (position, count) in zip(tables, rows):
        keys = layer_cache[table, 0].flatten(0, 1)
        values = layer_cache[table, 1].flatten(0, 1)
        for step in range(count):
            expected = dense_reference(query[token], keys, values, position + step, window)
            torch.testing.assert_close(attended[token].double(), expected, atol=1e-5, rtol=1e-5)
            token += 1


def test_a_windowed_decode_reads_only_the_windows_blocks():
    """A row at position 1,000 with a window of 64 reads 5 blocks of 16, not 63."""
    decode = plan_split_kv(
        0, [1000], [list(range(1, 64))], 16, torch.device("cpu"), torch.float32, 64, None
    )
    [chunk] = decode.chunks
    assert chunk.blocks.tolist() == list(range(59, 64))  # table indices 58..62
    assert chunk.num_keys == 1000 - 58 * 16 + 1
    assert chunk.attn_mask is not None  # the window's first key, 937, is the 10th of them
    assert chunk.attn_mask[0, 0, 0].isinf().tolist() == [True] * 9 + [False] * 64


@DECODE_PATHS
def test_a_step_mixing_prefills_and_chunked_decodes_writes_then_reads_every_token(path):
    """paged_attention on a prefill-then-decodes step: the decodes see this step's own K/V."""
    generator = torch.Generator().manual_seed(7)
    block_size, positions = 4, [9, 30]
    kv_cache = torch.randn(32, 1, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    tables = [[5, 9, 2, 7], [11, 3, 20, 14, 8, 1, 30, 6], list(range(12, 20))]
    counts = [6, 1, 1]
    starts = [0, *positions]
    metadata = build_attention_metadata(
        counts, starts, tables, block_size, 1, torch.device("cpu"), split_kv_keys=2 * 4
    )
    assert metadata.decode is not None and len(metadata.decode.chunks) == 8
    query = torch.randn(8, NUM_HEADS, HEAD_SIZE, generator=generator)
    key_value = torch.randn(8, 2, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    with decode_path(path):
        attended = paged_attention(query, key_value, kv_cache, 0, metadata)
    layer_cache = kv_cache[:, 0]
    for row, (table, position) in enumerate(zip(tables[1:], positions)):
        keys = layer_cache[table, 0].flatten(0, 1)
        values = layer_cache[table, 1].flatten(0, 1)
        torch.testing.assert_close(keys[position], key_value[6 + row, 0])
        expected = dense_reference(query[6 + row], keys, values, position, None)
        torch.testing.assert_close(attended[6 + row].double(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    positions=st.lists(st.integers(0, 90), min_size=1, max_size=5),
    block_size=BLOCK_SIZES,
    chunk_keys=CHUNK_KEYS,
    seed=SEEDS,
)
@DECODE_PATHS
def test_a_latent_cache_serves_as_its_own_values_at_the_given_scale(
    path, positions, block_size, chunk_keys, seed
):
    """MLA's absorbed decode: one-entry pages of latent rows, every query head over the one
    shared row (MQA), a softmax scale that is not 1/sqrt(row size)."""
    latent, scale = 12, 0.3
    generator = torch.Generator().manual_seed(seed)
    tables, next_block = [], 1
    for position in positions:
        need = position // block_size + 1
        tables.append(list(range(next_block, next_block + need))[::-1])  # not contiguous order
        next_block += need
    layer_cache = torch.randn(next_block, 1, block_size, 1, latent, generator=generator)
    query = torch.randn(len(positions), NUM_HEADS, latent, generator=generator)
    decode = plan_split_kv(
        0, positions, tables, block_size, torch.device("cpu"), torch.float32, None, chunk_keys
    )
    with decode_path(path):
        attended = split_kv_attention(query, layer_cache, decode, scale)
    for row, (table, position) in enumerate(zip(tables, positions)):
        rows = layer_cache[table, 0, :, 0].flatten(0, 1)[: position + 1].double()
        weights = (query[row].double() @ rows.T * scale).softmax(-1)
        torch.testing.assert_close(attended[row].double(), weights @ rows, atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    start=st.integers(1, 90),
    count=st.integers(2, 40),
    block_size=BLOCK_SIZES,
    window=WINDOWS,
    split_kv_keys=CHUNK_KEYS,
    seed=SEEDS,
)
def test_a_prefill_chunk_continuing_a_prefix_reads_its_pages_as_dense_causal_attention(
    start, count, block_size, window, split_kv_keys, seed
):
    """A step of a chunk from position 0, a chunk continuing a prefix at ``start`` and a
    decode: the continuing chunk's query ``j`` equals dense attention over the keys up to
    ``start + j`` (its prefix from the pages, its own K/V written this step), and only the
    split-KV chunks that hold its own positions are masked (the prefix is seen whole)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    counts, starts = [3, count, 1], [0, start, 50]
    needed = [(s + n - 1) // block_size + 1 for s, n in zip(starts, counts)]
    free = list(range(1, sum(needed) + 1))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(need)] for need in needed]
    kv_cache = torch.randn(
        sum(needed) + 1, 1, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=generator
    )
    metadata = build_attention_metadata(
        counts,
        starts,
        tables,
        block_size,
        1,
        torch.device("cpu"),
        sliding_window=window,
        split_kv_keys=split_kv_keys,
    )
    fresh, continuing = metadata.prefills
    assert fresh.paged is None and continuing.paged is not None
    num_tokens = sum(counts)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator)
    key_value = torch.randn(num_tokens, 2, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    attended = paged_attention(query, key_value, kv_cache, 0, metadata)
    keys = kv_cache[tables[1], 0, 0].flatten(0, 1)
    values = kv_cache[tables[1], 0, 1].flatten(0, 1)
    torch.testing.assert_close(keys[start : start + count], key_value[3 : 3 + count, 0])
    for step in range(count):
        expected = dense_reference(query[3 + step], keys, values, start + step, window)
        torch.testing.assert_close(attended[3 + step].double(), expected, atol=1e-5, rtol=1e-5)
    if window is None:
        read_keys = 0
        for chunk in continuing.paged.chunks:
            if read_keys + chunk.num_blocks * block_size <= start:
                assert chunk.attn_mask is None
            read_keys += chunk.num_blocks * block_size


@settings(max_examples=40, deadline=None)
@given(
    positions=st.lists(st.integers(0, 600), min_size=1, max_size=4),
    head_size=st.sampled_from([64, 128, 48]),
    group=st.integers(1, 9),
    num_kv_heads=st.integers(1, 3),
    window=st.one_of(st.none(), st.integers(1, 300)),
    page_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=SEEDS,
)
def test_the_kernels_compiled_shapes_read_one_layer_of_the_pool_as_dense_attention(
    positions, head_size, group, num_kv_heads, window, page_dtype, seed
):
    """The kernel's sizes fixed at compile time (head sizes 64 and 128, groups 1 to 8) and
    its general loop (48, a group of 9), over one layer of a three-layer pool (a strided
    view, as the engine passes it), rows longer than a span of 128 keys, windows, and
    16-bit pages (a float32 query: widened as read; the reference reads the same values)."""
    with decode_path("kernel"):
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        block_size, num_heads = 16, group * num_kv_heads
        tables_needed = [p // block_size + 1 for p in positions]
        num_blocks = sum(tables_needed) + 1
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(need)] for need in tables_needed]
        pool = torch.randn(
            num_blocks, 3, 2, block_size, num_kv_heads, head_size, generator=generator
        ).to(page_dtype)
        layer_cache = pool[:, 1]
        query = torch.randn(len(positions), num_heads, head_size, generator=generator)
        decode = plan_split_kv(
            0, positions, tables, block_size, torch.device("cpu"), torch.float32, window, None
        )
        attended = split_kv_attention(query, layer_cache, decode)
        for row, (table, position) in enumerate(zip(tables, positions)):
            first = 0 if window is None else max(0, position - window + 1)
            keys = layer_cache[table, 0].flatten(0, 1)[first : position + 1].double()
            values = layer_cache[table, 1].flatten(0, 1)[first : position + 1].double()
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,thd->ht", query[row].double(), keys) / head_size**0.5
            expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
            torch.testing.assert_close(attended[row].double(), expected, atol=2e-5, rtol=2e-5)
