"""The loader reads local HF directories and says clearly what is wrong with a bad one."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
import transformers

from pdserve.model.loader import load_model


def save_llama(directory, **overrides) -> transformers.LlamaForCausalLM:
    shape = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=3,
    )
    config = transformers.LlamaConfig(**(shape | overrides))
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0")
    )
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return model


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="neither a built-in model .* nor a local directory or .gguf file"
    ):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        load_model(str(tmp_path))


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        load_model("tiny", dtype="float8")


def test_sharded_checkpoint_loads_in_bfloat16_with_eos_from_generation_config(tmp_path):
    reference = save_llama(tmp_path)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    model, config, tokenizer = load_model(str(tmp_path), dtype="bfloat16")
    assert config.eos_token_ids == [5, 6] and tokenizer.eos_token_id == 5
    assert config.dtype == "bfloat16"
    assert model.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        model.lm_head.weight.float(), reference.lm_head.weight.bfloat16().float()
    )
    assert tokenizer.encode("w7 w9") == [7, 9] and tokenizer.decode([7, 9]) == "w7 w9"


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    save_llama(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_model(str(tmp_path))
