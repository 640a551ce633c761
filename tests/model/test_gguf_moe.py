"""A Qwen3-MoE GGUF (llama.cpp's ``qwen3moe``: each layer's experts stacked in one tensor per
projection, the router as ``ffn_gate_inp``) written here from a small random transformers
model loads into the model transformers computes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.loader import check_model, load_model
from tests.model.test_gguf_loader import gguf_tensors, random_model, write_gguf

NUM_EXPERTS, TOP_K, EXPERT_WIDTH, HEAD_DIM = 4, 2, 32, 32


def qwen3moe_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """The dense part under llama.cpp's names (``gguf_tensors``), then each layer's router and
    experts as ``convert_hf_to_gguf.py`` stacks them: ``[experts, out, in]`` per projection
    (transformers 5 holds gate and up fused, ``[experts, 2 · width, hidden]``)."""
    tensors = gguf_tensors(model)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    for layer in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        gate_up = state[f"{prefix}.experts.gate_up_proj"]
        tensors[f"blk.{layer}.ffn_gate_inp.weight"] = state[f"{prefix}.gate.weight"]
        tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate_up[:, :EXPERT_WIDTH]
        tensors[f"blk.{layer}.ffn_up_exps.weight"] = gate_up[:, EXPERT_WIDTH:]
        tensors[f"blk.{layer}.ffn_down_exps.weight"] = state[f"{prefix}.experts.down_proj"]
    return tensors


class _MoEWriter(gguf.GGUFWriter):
    """``write_gguf``'s writer, with the expert keys llama.cpp's qwen3moe reads."""

    def write_header_to_file(self, *args: object, **kwargs: object) -> None:
        self.add_expert_count(NUM_EXPERTS)
        self.add_expert_used_count(TOP_K)
        self.add_expert_feed_forward_length(EXPERT_WIDTH)
        super().write_header_to_file(*args, **kwargs)  # type: ignore[arg-type]  # passed on


def test_qwen3moe_gguf_splits_its_stacked_experts_and_logits_equal_transformers(
    tmp_path, monkeypatch
):
    reference = random_model(
        transformers.Qwen3MoeConfig,
        tie_word_embeddings=False,
        head_dim=HEAD_DIM,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_WIDTH,
        norm_topk_prob=True,
    )
    path = tmp_path / "qwen3moe.gguf"
    monkeypatch.setattr(gguf, "GGUFWriter", _MoEWriter)
    write_gguf(path, qwen3moe_tensors(reference), architecture="qwen3moe", key_length=HEAD_DIM)
    model, loaded, _ = load_model(str(path))
    assert loaded.architecture == "Qwen3MoeForCausalLM" and loaded.moe is not None
    assert (loaded.moe.num_experts, loaded.moe.top_k, loaded.moe.sparse_layers) == (4, 2, (0, 1))
    assert check_model(str(path)).moe == loaded.moe  # the preflight reads the same experts
    runner = ModelRunner(model, loaded, num_blocks=8, block_size=4)
    prompt = list(range(40, 61))
    logits = runner.execute([ScheduledChunk("a", prompt, 0, [6, 1, 4, 0, 7, 2], sample=True)])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


class _DeepSeekWriter(gguf.GGUFWriter):
    """``write_gguf``'s writer, with the latent-attention and expert keys of llama.cpp's
    ``deepseek2`` (V2's softmax router, one leading dense layer, one shared expert)."""

    q_lora_rank = 0

    def write_header_to_file(self, *args: object, **kwargs: object) -> None:
        arch = "deepseek2"
        self.add_uint32(f"{arch}.rope.dimension_count", ROPE_DIM)
        self.add_uint32(f"{arch}.attention.kv_lora_rank", KV_LORA_RANK)
        if self.q_lora_rank:
            self.add_uint32(f"{arch}.attention.q_lora_rank", self.q_lora_rank)
        self.add_uint32(f"{arch}.leading_dense_block_count", 1)
        self.add_expert_count(NUM_EXPERTS)
        self.add_expert_used_count(TOP_K)
        self.add_expert_feed_forward_length(EXPERT_WIDTH)
        self.add_uint32(f"{arch}.expert_shared_count", 1)
        self.add_float32(f"{arch}.expert_weights_scale", 1.0)
        self.add_uint32(f"{arch}.expert_gating_func", 1)  # softmax: V2
        super().write_header_to_file(*args, **kwargs)  # type: ignore[arg-type]  # passed on


ROPE_DIM, NOPE_DIM, KV_LORA_RANK = 8, 16, 32


def deepseek2_tensors(model: transformers.PreTrainedModel) -> dict[str, np.ndarray]:
    """llama.cpp's names for DeepSeek-V2: latent attention, one dense layer, then experts
    stacked as ``qwen3moe_tensors`` stacks them, the router and the shared expert."""
    tensors = gguf_tensors(model)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    attention = {
        "attn_q_a": "q_a_proj.weight",
        "attn_q_a_norm": "q_a_layernorm.weight",
        "attn_q_b": "q_b_proj.weight",
        "attn_kv_a_mqa": "kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm": "kv_a_layernorm.weight",
        "attn_kv_b": "kv_b_proj.weight",
    }
    for layer in range(model.config.num_hidden_layers):
        for gguf_name, hf_name in attention.items():
            if f"model.layers.{layer}.self_attn.{hf_name}" in state:
                tensors[f"blk.{layer}.{gguf_name}.weight"] = state[
                    f"model.layers.{layer}.self_attn.{hf_name}"
                ]
        prefix = f"model.layers.{layer}.mlp"
        if f"{prefix}.gate.weight" not in state:
            continue
        gate_up = state[f"{prefix}.experts.gate_up_proj"]
        tensors[f"blk.{layer}.ffn_gate_inp.weight"] = state[f"{prefix}.gate.weight"]
        tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate_up[:, :EXPERT_WIDTH]
        tensors[f"blk.{layer}.ffn_up_exps.weight"] = gate_up[:, EXPERT_WIDTH:]
        tensors[f"blk.{layer}.ffn_down_exps.weight"] = state[f"{prefix}.experts.down_proj"]
        for projection in ("gate", "up", "down"):
            tensors[f"blk.{layer}.ffn_{projection}_shexp.weight"] = state[
                f"{prefix}.shared_experts.{projection}_proj.weight"
            ]
    return tensors


@pytest.mark.parametrize("q_lora_rank", [0, 24], ids=["q_proj", "q_lora"])
def test_deepseek2_gguf_latent_attention_and_experts_logits_equal_transformers(
    tmp_path, monkeypatch, q_lora_rank
):
    reference = random_model(
        transformers.DeepseekV2Config,
        tie_word_embeddings=False,
        q_lora_rank=q_lora_rank or None,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=NOPE_DIM,
        qk_rope_head_dim=ROPE_DIM,
        v_head_dim=NOPE_DIM + ROPE_DIM,  # write_gguf writes one key and value length
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_WIDTH,
        n_shared_experts=1,
        first_k_dense_replace=1,
    )
    path = tmp_path / "deepseek2.gguf"
    monkeypatch.setattr(_DeepSeekWriter, "q_lora_rank", q_lora_rank)
    monkeypatch.setattr(gguf, "GGUFWriter", _DeepSeekWriter)
    write_gguf(
        path, deepseek2_tensors(reference), architecture="deepseek2", key_length=NOPE_DIM + ROPE_DIM
    )
    model, loaded, _ = load_model(str(path))
    assert loaded.architecture == "DeepseekV2ForCausalLM" and loaded.mla is not None
    assert loaded.moe is not None and loaded.moe.sparse_layers == (1,)
    assert check_model(str(path)).mla == loaded.mla
    runner = ModelRunner(model, loaded, num_blocks=8, block_size=4)
    prompt = list(range(40, 61))
    logits = runner.execute([ScheduledChunk("a", prompt, 0, [6, 1, 4, 0, 7, 2], sample=True)])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
