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


def write_sparse_gguf(
    path: Path,
    *,
    num_layers: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    weight_type: Quant,
    num_kv_heads: int = 8,
) -> Path:
    """A Llama GGUF of the given shape whose tensor bytes are a hole in a sparse file: all
    a check before loading reads is the metadata and the tensor infos, so a 7B-shaped file
    costs no disk. ``weight_type`` for the 2-D weights, F32 for the norms."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(hidden // 128)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS + [f"<extra_{i}>" for i in range(vocab - len(TOKENS))])
    writer.add_token_types([1] * (len(TOKENS) - 1) + [3] + [4] * (vocab - len(TOKENS)))
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(len(TOKENS) - 1)
    kv = num_kv_heads * 128
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for layer in range(num_layers):
        for name, shape in {
            "attn_norm.weight": (hidden,),
            "ffn_norm.weight": (hidden,),
            "attn_q.weight": (hidden, hidden),
            "attn_k.weight": (kv, hidden),
            "attn_v.weight": (kv, hidden),
            "attn_output.weight": (hidden, hidden),
            "ffn_gate.weight": (intermediate, hidden),
            "ffn_up.weight": (intermediate, hidden),
            "ffn_down.weight": (hidden, intermediate),
        }.items():
            shapes[f"blk.{layer}.{name}"] = shape
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[weight_type]
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            nbytes = shape[0] * shape[1] // block_elements * block_bytes
            byte_shape = (shape[0], shape[1] // block_elements * block_bytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    alignment = 32
    data_bytes = sum(
        -(-info.nbytes // alignment) * alignment for info in writer.tensors[0].values()
    )
    with path.open("r+b") as file:
        file.seek(0, 2)
        start = -(-file.tell() // alignment) * alignment
        file.truncate(start + data_bytes)
    return path


def fill_q4_k_blocks(path: Path, seed: int = 0) -> Path:
    """Fills a Q4_K ``write_sparse_gguf`` file's tensors, so that its pages are real bytes,
    not a hole: the norms' weights ones, and every Q4_K tensor random blocks, each with its
    scale ``d`` and minimum ``dmin`` small fp16 values (the residual stream stays finite
    over 32 layers) and its 6-bit sub-block scales and nibbles random. One 4 MiB pattern
    of blocks repeats: a step's time and the memory do not depend on the values."""
    block_bytes = gguf.GGML_QUANT_SIZES[Quant.Q4_K][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (4 << 20) // block_bytes * block_bytes, dtype=np.uint8)
    blocks = blocks.reshape(-1, block_bytes)
    scales = rng.uniform(1e-4, 4e-4, (len(blocks), 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8)  # d, dmin: the block's first two fp16 fields
    pattern = blocks.tobytes()
    reader = gguf.GGUFReader(str(path))
    tensors = [(t.tensor_type, t.data_offset, int(t.n_bytes)) for t in reader.tensors]
    del reader  # its memory map closes before the file is written
    with path.open("r+b") as file:
        for tensor_type, offset, nbytes in tensors:
            file.seek(offset)
            if tensor_type == Quant.F32:  # the norms' weights: ones
                file.write(np.ones(nbytes // 4, dtype=np.float32).tobytes())
                continue
            for start in range(0, nbytes, len(pattern)):
                file.write(pattern[: min(len(pattern), nbytes - start)])
    return path
