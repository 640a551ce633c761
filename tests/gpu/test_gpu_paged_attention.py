"""Paged attention on CUDA equals float64 dense attention, float32 and 16-bit KV.

On CUDA decodes read their pages in place through the Triton kernel
(model/paged_decode_triton.py) and a prefill chunk continuing a prefix reads its table in one
chunk (model/split_kv.py); the pages live in a CUDA KV tensor with shuffled block ids, with
and without a sliding window. Needs torch with CUDA only (no Ray): tests/gpu/run_gpu_checks.sh.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.model import paged_decode_triton
from pdserve.model.attention import build_attention_metadata, paged_attention
from pdserve.model.split_kv import plan_split_kv, split_kv_attention

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_paged_decode_and_prefix_continuation_equal_dense_attention(window, kv_dtype):
    generator = torch.Generator().manual_seed(3)
    positions, counts = [1500, 2047, 300, 1000, 17], [64, 1, 1, 1, 1]
    needs = [(p + n - 1) // BLOCK_SIZE + 1 for p, n in zip(positions, counts)]
    order = torch.randperm(sum(needs) + 1, generator=generator)
    order = order[order != 0].tolist()  # block 0 is the null block
    tables = [[order.pop() for _ in range(need)] for need in needs]
    kv_cache = torch.randn(
        sum(needs) + 1, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=generator
    ).to("cuda", kv_dtype)
    num_tokens = sum(counts)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_SIZE, generator=generator)
    key_value = torch.randn(num_tokens, 2, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    metadata = build_attention_metadata(
        counts,
        positions,
        tables,
        BLOCK_SIZE,
        1,
        torch.device("cuda"),
        sliding_window=window,
        dtype=torch.float32,
    )
    with torch.inference_mode():
        attended = paged_attention(query.cuda(), key_value.cuda(), kv_cache, 0, metadata).cpu()
    layer = kv_cache[:, 0].double().cpu()
    group = NUM_HEADS // NUM_KV_HEADS
    assert metadata.prefills[0].paged is not None  # read in place, not gathered
    assert metadata.decode is not None and metadata.decode.device_key_ranges is not None
    tokens = [(t, p + j) for t, p, n in zip(tables, positions, counts) for j in range(n)]
    for row, (table, position) in enumerate(tokens):
        first = 0 if window is None else max(0, position - window + 1)
        keys = layer[table, 0].flatten(0, 1)[first : position + 1].repeat_interleave(group, 1)
        values = layer[table, 1].flatten(0, 1)[first : position + 1].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", query[row].double(), keys) / HEAD_SIZE**0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(attended[row].double(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("target_programs", [1, paged_decode_triton.TARGET_PROGRAMS])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_decode_kernel_equals_the_gather_path_on_verification_rows(
    window, dtype, target_programs, monkeypatch
):
    """Rows of several queries (a speculative verification's last token and drafts, each with
    its own causal limit), rows of one, a window: the kernel's output equals the gathered
    pages' SDPA, the path it replaces; with one split per row (no merge) and with many."""
    monkeypatch.setattr(paged_decode_triton, "TARGET_PROGRAMS", target_programs)
    generator = torch.Generator().manual_seed(5)
    positions, lens = [700, 33, 1200, 5], [3, 1, 4, 2]
    needs = [(p + n - 1) // BLOCK_SIZE + 1 for p, n in zip(positions, lens)]
    order = (torch.randperm(sum(needs), generator=generator) + 1).tolist()
    tables = [[order.pop() for _ in range(need)] for need in needs]
    layer_cache = torch.randn(
        sum(needs) + 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=generator
    ).to("cuda", dtype)
    query = torch.randn(sum(lens), NUM_HEADS, HEAD_SIZE, generator=generator).to("cuda", dtype)
    plan = plan_split_kv(
        0, positions, tables, BLOCK_SIZE, torch.device("cuda"), dtype, window, None, lens
    )
    assert plan.device_key_ranges is not None
    with torch.inference_mode():
        in_place = split_kv_attention(query, layer_cache, plan)
        plan.device_key_ranges = None
        gathered = split_kv_attention(query, layer_cache, plan)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(in_place, gathered, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("position", [21, 26])
def test_triton_decode_kernel_on_small_blocks_skips_tiles_with_no_visible_key(position):
    """Blocks of 8 under a window of 4: a split holds one block, but a tile is 16 keys wide
    and reaches past it. A draft whose window starts past its split's end met a tile with
    nothing visible there, whose softmax took exp(-inf - -inf): NaN in the merge (found by
    review, under Triton's interpreter). Each row of a token and 3 drafts equals float64
    dense attention over its window."""
    block_size, window, lens = 8, 4, [4]
    generator = torch.Generator().manual_seed(7)
    table = list(range(1, 6))
    layer_cache = torch.randn(8, 2, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=generator)
    layer_cache[0] = 0  # the null block
    query = torch.randn(lens[0], NUM_HEADS, HEAD_SIZE, generator=generator)
    plan = plan_split_kv(
        0, [position], [table], block_size, torch.device("cuda"), torch.float32, window, None, lens
    )
    assert plan.device_key_ranges is not None
    tables, _, low, high = (t.cpu() for t in plan.device_key_ranges)
    with torch.inference_mode():
        attended = split_kv_attention(query.cuda(), layer_cache.cuda(), plan).cpu()
    group = NUM_HEADS // NUM_KV_HEADS
    # The row's table starts at the window's first block; low and high count from there.
    pages = layer_cache[tables[0]].double()  # [blocks, 2, slots, kv heads, head]
    keys = pages[:, 0].reshape(-1, NUM_KV_HEADS, HEAD_SIZE).repeat_interleave(group, 1)
    values = pages[:, 1].reshape(-1, NUM_KV_HEADS, HEAD_SIZE).repeat_interleave(group, 1)
    for row in range(lens[0]):
        visible = slice(int(low[row]), int(high[row]))
        scores = torch.einsum("hd,thd->ht", query[row].double(), keys[visible]) / HEAD_SIZE**0.5
        expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values[visible])
        assert not attended[row].isnan().any()
        torch.testing.assert_close(attended[row].double(), expected, atol=1e-5, rtol=1e-5)
