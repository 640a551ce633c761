import subprocess
import sys

import numpy as np
import pytest

from pdserve.cache import BlockHasher, ExtraKeys, MultiModalFeature, hash_block_tokens, none_hash
from tests.cache.cache_fakes import FakeRequest, make_hasher

TOKENS = list(range(100, 140))  # 10 blocks of 4


def chained_reference(hasher, tokens, block_size, lora_id=None, cache_salt=None):
    """Block by block through `hash_block_tokens`: the definition the fast path must match."""
    hashes, parent = [], hasher.none_hash
    for index in range(len(tokens) // block_size):
        extra = ExtraKeys(lora_id, cache_salt if index == 0 else None)
        parent = hash_block_tokens(
            parent, tokens[index * block_size : (index + 1) * block_size], extra, hasher.algorithm
        )
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("algorithm,size", [("xxh3_128", 16), ("sha256", 32)])
def test_fast_path_equals_block_by_block_definition(algorithm, size):
    hasher = BlockHasher(algorithm, seed=7)
    fast = hasher.hash_request_blocks(TOKENS + [1, 2], 4, lora_id="adapter-3", cache_salt="t")
    assert fast == chained_reference(hasher, TOKENS, 4, lora_id="adapter-3", cache_salt="t")
    assert len(fast) == 10 and all(len(h) == size for h in fast)


def test_incremental_hashing_equals_one_shot_and_skips_partial_blocks():
    hasher = BlockHasher()
    known: list[bytes] = []
    for end in [*range(0, len(TOKENS), 3), len(TOKENS)]:
        known += hasher.hash_request_blocks(TOKENS[:end], 4, known)
        assert len(known) == end // 4
    assert known == hasher.hash_request_blocks(np.array(TOKENS, dtype=np.int32), 4)


def test_request_block_hasher_follows_appended_tokens():
    request = FakeRequest("r", TOKENS[:6], make_hasher())
    assert len(request.block_hashes) == 1
    for token in TOKENS[6:]:
        request.append_token(token)
    assert request.block_hashes == BlockHasher().hash_request_blocks(TOKENS, 4)


def test_cache_salt_changes_every_block_lora_changes_every_block():
    hasher = BlockHasher()
    plain = hasher.hash_request_blocks(TOKENS, 4)
    salted = hasher.hash_request_blocks(TOKENS, 4, cache_salt="tenant-a")
    other_salt = hasher.hash_request_blocks(TOKENS, 4, cache_salt="tenant-b")
    lora = hasher.hash_request_blocks(TOKENS, 4, lora_id="adapter-1")
    for variant in (salted, other_salt, lora):
        assert not set(variant) & set(plain)
    assert not set(salted) & set(other_salt)


def test_extra_keys_are_unambiguous():
    parent = none_hash()
    assert hash_block_tokens(parent, [1, 2], ExtraKeys(cache_salt="1")) != hash_block_tokens(
        parent, [1, 2], ExtraKeys(lora_id="adapter-1")
    )
    assert hash_block_tokens(
        parent, [1, 2], ExtraKeys(mm_identifiers=("ab", "c"))
    ) != hash_block_tokens(parent, [1, 2], ExtraKeys(mm_identifiers=("a", "bc")))
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(parent, [1, 2, 0])


def test_multimodal_identifiers_change_only_the_blocks_they_overlap():
    hasher = BlockHasher()
    plain = hasher.hash_request_blocks(TOKENS, 4)
    image = hasher.hash_request_blocks(TOKENS, 4, mm_features=[MultiModalFeature("img-1", 9, 2)])
    assert image[:2] == plain[:2] and not set(image[2:]) & set(plain)


def test_seed_decides_none_hash_and_int_and_str_seeds_differ():
    assert BlockHasher(seed=1).none_hash == BlockHasher(seed=1).none_hash
    assert BlockHasher(seed=1).none_hash != BlockHasher(seed=2).none_hash
    assert BlockHasher(seed=0).none_hash != BlockHasher(seed="0").none_hash
    with pytest.raises(ValueError, match="unknown block hash algorithm"):
        BlockHasher("md5")


def _hashes_in_subprocess(seed: str) -> list[str]:
    code = (
        "from pdserve.cache import BlockHasher\n"
        f"print(' '.join(h.hex() for h in BlockHasher(seed={seed!r}).hash_request_blocks(list(range(100, 140)), 4)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_hashes_agree_across_processes_with_the_same_seed():
    here = [h.hex() for h in BlockHasher(seed="cluster-1").hash_request_blocks(TOKENS, 4)]
    assert _hashes_in_subprocess("cluster-1") == here
    assert not set(_hashes_in_subprocess("cluster-2")) & set(here)
