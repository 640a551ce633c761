"""A small GGUF file written with the ``gguf`` package, for the checks before a deploy: its
architecture and its weight type are the test's to choose (no download, no real weights)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Quant

from pdserve.tokenizer.tokenizer import bytes_to_unicode

HIDDEN, NUM_HEADS, NUM_KV_HEADS = 64, 4, 2
# A byte-level vocabulary with one merge and an end token: what the GGUF tokenizer reads.
TOKENS = [*bytes_to_unicode().values(), "Ġt", "<|end|>"]


def write_small_gguf(
    path: Path, architecture: str = "llama", weight_type: Quant = Quant.F32
) -> Path:
    """A one-layer model's metadata under ``architecture``'s keys, and its embedding stored
    as ``weight_type`` (all a check before loading reads of the tensors)."""
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 1) + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(len(TOKENS) - 1)
    embedding = np.random.default_rng(0).uniform(-1, 1, (len(TOKENS), HIDDEN)).astype(np.float32)
    if weight_type == Quant.F32:
        writer.add_tensor("token_embd.weight", embedding)
    else:
        quantized = gguf.quants.quantize(embedding, weight_type)
        writer.add_tensor("token_embd.weight", quantized, raw_dtype=weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
