import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    longest_request_in_pool,
    num_blocks_for_memory,
)


def test_page_size_is_k_and_v_for_every_slot_of_one_layer():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="bfloat16")
    assert spec.page_size_bytes == 2 * 16 * 4 * 64 * 2
    assert FullAttentionSpec(16, 4, 64, "float32").page_size_bytes == 2 * spec.page_size_bytes


def test_a_block_is_one_page_of_the_largest_groups_layers():
    """Groups share the KV tensor's layer slots (hybrid layout): a block id is a page of the
    largest group's layers, whichever group holds it."""
    full = FullAttentionSpec(16, 2, 8, "float16")
    window = SlidingWindowSpec(16, 2, 8, "float16", sliding_window=64)
    groups = [KVCacheGroupSpec(["l0", "l2"], full), KVCacheGroupSpec(["l1"], window)]
    bytes_per_block = 2 * full.page_size_bytes
    assert num_blocks_for_memory(100 * bytes_per_block + 5, groups) == 100
    assert KVCacheConfig(100, groups).bytes_per_block == bytes_per_block


def test_pools_beside_share_the_budget_block_for_block():
    """A draft model's pool gets as many blocks as the model's: a block costs both pages."""
    model = [KVCacheGroupSpec(["l0", "l1"], FullAttentionSpec(16, 2, 8, "float16"))]
    draft = [KVCacheGroupSpec(["d0"], FullAttentionSpec(16, 1, 8, "float16"))]
    pair = model[0].page_size_bytes + draft[0].page_size_bytes
    assert num_blocks_for_memory(50 * pair + pair - 1, model, [draft]) == 50
    with pytest.raises(ValueError, match=f"holds 1 block.*of {pair} bytes"):
        num_blocks_for_memory(pair, model, [draft])


def test_a_budget_below_two_blocks_is_a_clear_error():
    groups = [KVCacheGroupSpec(["l0"], FullAttentionSpec(16, 2, 8, "float16"))]
    with pytest.raises(ValueError, match="holds 1 block"):
        num_blocks_for_memory(groups[0].page_size_bytes, groups)


def test_groups_must_share_one_block_size():
    groups = [
        KVCacheGroupSpec(["l0"], FullAttentionSpec(16, 2, 8, "float16")),
        KVCacheGroupSpec(["l1"], SlidingWindowSpec(32, 2, 8, "float16", sliding_window=64)),
    ]
    with pytest.raises(ValueError, match="share one block_size"):
        KVCacheConfig(10, groups)
    with pytest.raises(ValueError, match="share one block_size"):
        num_blocks_for_memory(10**9, groups)


@pytest.mark.parametrize(
    "make",
    [
        lambda: FullAttentionSpec(16, 2, 8, "float64"),
        lambda: FullAttentionSpec(0, 2, 8, "float16"),
        lambda: SlidingWindowSpec(16, 2, 8, "float16", sliding_window=0),
        lambda: KVCacheGroupSpec([], FullAttentionSpec(16, 2, 8, "float16")),
        lambda: KVCacheConfig(
            1, [KVCacheGroupSpec(["l0"], FullAttentionSpec(16, 2, 8, "float16"))]
        ),
    ],
)
def test_bad_specs_are_value_errors(make):
    with pytest.raises(ValueError):
        make()


@given(
    num_full=st.integers(0, 2),
    windows=st.lists(st.integers(1, 80), max_size=5),
    block_size=st.sampled_from([4, 16]),
    num_blocks=st.integers(2, 200),
    max_chunk_tokens=st.integers(1, 96),
)
def test_the_longest_request_is_the_last_length_whose_blocks_fit(
    num_full, windows, block_size, num_blocks, max_chunk_tokens
):
    """Every group takes its own blocks: all of a full-attention group's, at most a window
    and a chunk of a windowed one's. The longest request is the last length whose blocks
    all fit beside the null block (counted here length by length)."""
    full = FullAttentionSpec(block_size, 2, 8, "float16")
    specs = [full] * num_full + [
        SlidingWindowSpec(block_size, 2, 8, "float16", sliding_window=w) for w in windows
    ] or [full]
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]

    def needed(num_tokens: int) -> int:
        total = 0
        for spec in specs:
            blocks = -(-num_tokens // block_size)
            if isinstance(spec, SlidingWindowSpec):
                chunk = -(-(spec.sliding_window - 1 + max_chunk_tokens) // block_size) + 1
                blocks = min(blocks, chunk)
            total += blocks
        return total

    longest = longest_request_in_pool(groups, num_blocks, max_chunk_tokens)
    assert needed(longest) <= num_blocks - 1
    assert longest == (num_blocks - 1) * block_size or needed(longest + 1) > num_blocks - 1
    if specs == [full]:  # one full-attention group: the whole pool
        assert longest == (num_blocks - 1) * block_size
