"""GGUF files written here with ``gguf.GGUFWriter`` load into the model transformers computes,
for each weight type; a corrupt, truncated or unsupported file is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Quant

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import load_model
from pdserve.tokenizer.tokenizer import bytes_to_unicode

NUM_HEADS, NUM_KV_HEADS = 4, 2
EOS_TOKEN = "<|end|>"


def random_model(
    config_class: type = transformers.LlamaConfig, **overrides: object
) -> transformers.PreTrainedModel:
    """A small random model of ``config_class`` (Llama unless told), GGUF-sized."""
    config = config_class(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: each head's halves interleaved."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names; a Llama's Q and K permuted as its converter
    does (Qwen2 and Qwen3 rotate halves, NeoX-style, and are stored as they are)."""
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    permuted = isinstance(model, transformers.LlamaForCausalLM)
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    ours = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    for layer in range(model.config.num_hidden_layers):
        for gguf_name, hf_name in ours.items():
            for kind in ("weight", "bias"):
                hf_key = f"model.layers.{layer}.{hf_name}.{kind}"
                if hf_key in state:
                    tensors[f"blk.{layer}.{gguf_name}.{kind}"] = state[hf_key]
        if permuted:
            q, k = f"blk.{layer}.attn_q.weight", f"blk.{layer}.attn_k.weight"
            tensors[q] = llama_cpp_permute(tensors[q], NUM_HEADS)
            tensors[k] = llama_cpp_permute(tensors[k], NUM_KV_HEADS)
    return tensors


def write_gguf(
    path,
    tensors: dict[str, np.ndarray],
    quant: Quant = Quant.F32,
    architecture: str = "llama",
    tokenizer_model: str = "gpt2",
    key_length: int | None = None,
) -> None:
    """A complete small GGUF: llama metadata, a byte-level vocabulary with one merge (" t") and a control EOS,
    2-D weights stored as ``quant`` (norms stay F32, as llama.cpp keeps them)."""
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    if key_length is not None:  # a head_dim apart from hidden / heads (Qwen3)
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    tokens = [*bytes_to_unicode().values(), "Ġt", EOS_TOKEN]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(257)
    for name, array in tensors.items():
        if array.ndim == 1 or quant == Quant.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def reference() -> transformers.LlamaForCausalLM:
    return random_model()


def test_float32_gguf_logits_equal_transformers(tmp_path, reference):
    path = tmp_path / "llama.gguf"
    write_gguf(path, gguf_tensors(reference))
    model, config, tokenizer = load_model(str(path))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert not config.tie_word_embeddings and config.eos_token_ids == [257] == list(
        tokenizer.eos_token_ids
    )
    assert (
        tokenizer.encode(" tea" + EOS_TOKEN) == [256, 101, 97, 257]
        and tokenizer.decode([256, 101, 257]) == " te"
    )
    runner = ModelRunner(model, config, num_blocks=8, block_size=4)
    prompt = list(range(40, 61))
    logits = runner.execute([ScheduledChunk("a", prompt, 0, [6, 1, 4, 0, 7, 2], sample=True)])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "config_class, architecture, head_dim",
    [
        pytest.param(transformers.Qwen2Config, "qwen2", None, id="qwen2-biases"),
        pytest.param(transformers.Qwen3Config, "qwen3", 32, id="qwen3-qk-norms"),
    ],
)
def test_qwen_ggufs_load_unpermuted_and_logits_equal_transformers(
    tmp_path, config_class, architecture, head_dim
):
    """llama.cpp stores Qwen2/Qwen3 Q and K rows as transformers does (NeoX RoPE), with
    Qwen2's q/k/v biases and Qwen3's per-head q/k norms under their GGUF names."""
    extra = {} if head_dim is None else {"head_dim": head_dim}
    reference = random_model(config_class, tie_word_embeddings=False, **extra)
    path = tmp_path / f"{architecture}.gguf"
    tensors = gguf_tensors(reference)
    assert any(
        name.endswith("attn_q.bias" if head_dim is None else "attn_q_norm.weight")
        for name in tensors
    )
    write_gguf(path, tensors, architecture=architecture, key_length=head_dim)
    model, loaded, _ = load_model(str(path))
    assert loaded.architecture == config_class.__name__.replace("Config", "ForCausalLM")
    assert (loaded.attention_bias, loaded.qk_norm) == (head_dim is None, head_dim is not None)
    runner = ModelRunner(model, loaded, num_blocks=8, block_size=4)
    prompt = list(range(40, 61))
    logits = runner.execute([ScheduledChunk("a", prompt, 0, [6, 1, 4, 0, 7, 2], sample=True)])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


# Worst error of one weight for each type on these weights (|w| <= 1): about one quantization step
# of a 32-weight block (a wrong layout, scale or un-permutation errs by the weights' own size).
QUANT_TOLERANCE = {
    Quant.F16: 5e-4,
    Quant.BF16: 4e-3,
    Quant.Q8_0: 8e-3,
    Quant.Q5_0: 6e-2,
    Quant.Q5_1: 3e-2,
    Quant.Q4_0: 0.12,
    Quant.Q4_1: 6e-2,
}


@pytest.mark.parametrize("quant", list(QUANT_TOLERANCE), ids=lambda quant: quant.name)
def test_quantized_weights_dequantize_to_the_original_within_the_types_step(
    tmp_path, reference, quant
):
    path = tmp_path / f"llama-{quant.name}.gguf"
    write_gguf(path, gguf_tensors(reference), quant)
    model, _, _ = load_model(str(path))
    ours = model.state_dict()
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(
            ours[name], expected, atol=QUANT_TOLERANCE[quant], rtol=0, msg=name
        )


def test_truncated_gguf_is_a_clear_error(tmp_path, reference):
    path = tmp_path / "whole.gguf"
    write_gguf(path, gguf_tensors(reference))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="truncated.gguf is not a valid GGUF file"):
        load_model(str(truncated))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="corrupt.gguf is not a valid GGUF file"):
        load_model(str(path))


def test_unsupported_quantization_is_a_clear_error(tmp_path, reference):
    path = tmp_path / "mxfp4.gguf"
    write_gguf(path, gguf_tensors(reference), Quant.MXFP4)
    with pytest.raises(
        ValueError, match="quantized as MXFP4, which is not supported; supported: BF16, F16, F32"
    ):
        load_model(str(path))


def test_unsupported_architecture_is_a_clear_error(tmp_path, reference):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, gguf_tensors(reference), architecture="gpt2")
    with pytest.raises(
        ValueError, match="GGUF architecture 'gpt2' is not supported; supported: llama"
    ):
        load_model(str(path))


def test_unsupported_tokenizer_model_is_a_clear_error(tmp_path, reference):
    path = tmp_path / "unigram.gguf"
    write_gguf(path, gguf_tensors(reference), tokenizer_model="t5")
    with pytest.raises(ValueError, match="GGUF tokenizer model 't5' is not supported"):
        load_model(str(path))
