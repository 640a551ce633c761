import dataclasses

import pytest
import torch

from pdserve.kvconnector.transport.layout import KVLayout, LayoutMismatchError, check_compatible


def tiny_cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(3, 4, 2, 16, 2, 64, dtype=dtype)


def test_layout_of_a_kv_cache_gives_its_page_bytes() -> None:
    layout = KVLayout.from_kv_cache(tiny_cache(torch.float16), "xxh3_128", 7)
    assert layout == KVLayout(4, 16, 2, 64, "float16", "xxh3_128", 7)
    assert layout.page_bytes == tiny_cache(torch.float16)[0].numel() * 2


def test_layout_round_trips_through_its_proto() -> None:
    layout = KVLayout.from_kv_cache(tiny_cache(), "sha256", 1)
    assert KVLayout.from_proto(layout.to_proto()) == layout


def test_mismatch_names_every_differing_field_with_both_values() -> None:
    local = KVLayout.from_kv_cache(tiny_cache(), "xxh3_128", 0)
    remote = dataclasses.replace(local, dtype="float16", hash_seed=9)
    with pytest.raises(LayoutMismatchError) as error:
        check_compatible(local, remote)
    message = str(error.value)
    assert "dtype: local='float32' remote='float16'" in message
    assert "hash_seed: local=0 remote=9" in message
    assert "num_layers" not in message


def test_a_kv_cache_of_the_wrong_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache must be"):
        KVLayout.from_kv_cache(torch.zeros(3, 4, 16), "xxh3_128", 0)
