"""The GPU's paged decode kernel (``model/paged_decode_triton.py``) as the static decode step
calls it (``engine/static_decode_batch.py``), checked in Triton's interpreter on CPU tensors:
no GPU is lent to this machine, so the interpreter stands in for one.

The static step hands the kernel a fixed grid: every row's table as wide as the longest
request (stale pages past a row's keys), padded rows over the null block's first key, and
the split count set by the padded size and that width alone. Each real token's output must
equal attention over exactly its own keys ``[low, high)``.

Run by ``test_triton_interpreter.py`` with ``TRITON_INTERPRET=1`` set before Triton is
imported (see that module), hence the name outside ``test_*``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model import latent_decode_triton, paged_decode_triton

BLOCK_SIZE = 16


def reference(query, layer_cache, table, row, low, high):
    """One token's attention over keys ``[low, high)`` of its row's pages, in float64."""
    pages = table[row, : -(-int(high) // layer_cache.shape[2])]
    keys = layer_cache[pages, 0].flatten(0, 1)[low:high].double()
    values = layer_cache[pages, -1].flatten(0, 1)[low:high].double()
    group = query.shape[0] // keys.shape[1]
    keys, values = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
    return F.scaled_dot_product_attention(query.double()[:, None], keys, values)[:, 0]


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 5),
    padded_extra=st.integers(0, 3),
    queries=st.sampled_from([1, 3]),
    width=st.sampled_from([4, 9]),
    block_size=st.sampled_from([4, 16]),
    window=st.sampled_from([None, 6, 20]),
    seed=st.integers(0, 2**16),
)
def test_the_fixed_grid_equals_attention_over_each_tokens_own_keys(
    rows, padded_extra, queries, width, block_size, window, seed
):
    """Block size 4 makes tiles (16 keys at least) wider than a split of pages, and a
    window of 6 leaves splits before it that see no key."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, group, head = 2, 3, 32
    num_blocks = 1 + rows * width
    layer_cache = torch.randn(num_blocks, 2, block_size, kv_heads, head, generator=generator)
    padded = rows + padded_extra
    # Tables as wide as the widest request; rows past ``rows`` are padding: block 0.
    table = torch.zeros(padded, width, dtype=torch.long)
    table[:rows] = (torch.randperm(num_blocks - 1, generator=generator)[: rows * width] + 1).view(
        rows, width
    )
    starts = torch.randint(0, width * block_size - queries + 1, (rows,), generator=generator)
    positions = (starts[:, None] + torch.arange(queries)).flatten()
    high = torch.ones(padded * queries, dtype=torch.long)
    low = torch.zeros(padded * queries, dtype=torch.long)
    high[: rows * queries] = positions + 1
    if window is not None:
        low[: rows * queries] = (positions - window + 1).clamp(min=0)
    token_rows = torch.arange(padded).repeat_interleave(queries)
    query = torch.randn(padded * queries, kv_heads * group, head, generator=generator)
    out = paged_decode_triton.paged_decode(query, layer_cache, table, token_rows, low, high, None)
    for token in range(rows * queries):
        expected = reference(
            query[token], layer_cache, table, int(token_rows[token]), low[token], high[token]
        )
        torch.testing.assert_close(out[token].double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()  # padded rows too: one key each, never an empty softmax


@settings(max_examples=6, deadline=None)
@given(
    rows=st.integers(1, 3),
    heads=st.sampled_from([4, 20]),
    queries=st.sampled_from([1, 2]),
    width=st.sampled_from([3, 7]),
    seed=st.integers(0, 2**16),
)
def test_the_latent_kernel_equals_absorbed_attention_over_the_latent_rows(
    rows, heads, queries, width, seed
):
    """MLA's absorbed decode (``latent_decode_triton.py``): each query head over the cached
    rows ``| latent | rope key |``, the latent part their values; a 40-wide row (32 + 8) as
    the CPU suite's DeepSeek models cache, heads over one block of 16 and over two."""
    generator = torch.Generator().manual_seed(seed)
    latent, rope = 32, 8
    num_blocks = 1 + rows * width
    pages = torch.randn(num_blocks, 1, BLOCK_SIZE, 1, latent + rope, generator=generator)
    table = (torch.randperm(num_blocks - 1, generator=generator)[: rows * width] + 1).view(
        rows, width
    )
    starts = torch.randint(0, width * BLOCK_SIZE - queries + 1, (rows,), generator=generator)
    positions = (starts[:, None] + torch.arange(queries)).flatten()
    high, low = positions + 1, torch.zeros_like(positions)
    token_rows = torch.arange(rows).repeat_interleave(queries)
    query = torch.randn(rows * queries, heads, latent + rope, generator=generator)
    scale = 0.3
    out = latent_decode_triton.latent_decode(
        query, pages, table, token_rows, low, high, scale, latent
    )
    assert out.shape == (rows * queries, heads, latent)
    for token in range(rows * queries):
        row, seen = int(token_rows[token]), int(high[token])
        cached = pages[table[row], 0].flatten(0, 1)[:seen, 0].double()  # [keys, R + P]
        weights = torch.softmax(query[token].double() @ cached.T * scale, dim=-1)
        torch.testing.assert_close(
            out[token].double(), weights @ cached[:, :latent], atol=1e-5, rtol=1e-5
        )
