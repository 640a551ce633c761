"""The built-in ``tiny`` model is the same everywhere, and its tokenizer round-trips."""

from __future__ import annotations

import hashlib
import multiprocessing

import torch

from pdserve.cache import FullAttentionSpec, KVCacheGroupSpec, num_blocks_for_memory
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import load_model
from pdserve.tokenizer.tokenizer import ByteTokenizer


def tiny_state_hash() -> str:
    model, _, _ = load_model("tiny")
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_tiny_weights_are_identical_in_a_fresh_process():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        other = pool.apply(tiny_state_hash)
    assert other == tiny_state_hash()


def test_tiny_is_a_gqa_llama_with_byte_tokenizer():
    model, config, tokenizer = load_model("tiny")
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        4,
        256,
        4,
        2,
    )
    assert config.vocab_size == tokenizer.vocab_size == 512
    assert config.eos_token_ids == [tokenizer.eos_token_id]
    assert model.model.embed_tokens.weight.shape == (512, 256)


def test_byte_tokenizer_round_trips_text_and_drops_specials():
    tokenizer = ByteTokenizer()
    text = "Hello, wörld! 你好 🙂"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id]) == text
    assert tokenizer.decode(ids[:-1]).endswith(
        "\ufffd"
    )  # a cut character is replaced, not an error


def test_tiny_greedy_generation_is_not_one_repeated_token():
    model, config, tokenizer = load_model("tiny")
    runner = ModelRunner(model, config, num_blocks=8, block_size=16)
    prompt = tokenizer.encode("The quick brown fox")
    blocks = [5, 2, 7]
    chunk = ScheduledChunk("r", prompt, 0, blocks, sample=True)
    output = []
    for _ in range(24):
        token = int(runner.execute([chunk]).argmax())
        output.append(token)
        chunk = ScheduledChunk("r", [token], len(prompt) + len(output) - 1, blocks, sample=True)
    assert len(set(output)) > 8


def test_kv_cache_layout_and_sizing_agree_with_the_ledger():
    model, config, _ = load_model("tiny")
    runner = ModelRunner(model, config, num_blocks=10, block_size=16, dtype=torch.float32)
    assert runner.kv_cache.shape == (10, 4, 2, 16, 2, 64)
    page_bytes = runner.kv_cache[0].numel() * runner.kv_cache.element_size()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(config.num_layers)], spec)]
    assert page_bytes == 4 * 2 * 16 * 2 * 64 * 4
    assert num_blocks_for_memory(10 * page_bytes, groups) == 10
