import pytest

from pdserve.cache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
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
