"""Loading a model: the built-in ``tiny``, or a local Hugging Face directory.

A directory needs ``config.json``, its weights as ``*.safetensors`` (sharded with
``model.safetensors.index.json``, or any number of files found by globbing) and
``tokenizer.json``; ``generation_config.json`` is read for end-of-sequence ids when
present. Nothing is ever downloaded: a name that is not ``tiny`` and not a
directory is an error.

The model is built on the ``meta`` device and the checkpoint tensors are assigned
into it, so a large model is never initialised with random weights first.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pdserve.engine.model_config import DTYPES, ModelConfig, resolve_dtype
from pdserve.engine.models import build_model
from pdserve.engine.tiny_model import build_tiny_model, tiny_model_config
from pdserve.tokenizer.loading import load_tokenizer
from pdserve.tokenizer.model_source import hf_eos_token_ids, resolve_model
from pdserve.tokenizer.tokenizer import Tokenizer
from safetensors import safe_open
from torch import nn

# Checkpoint entries that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    name_or_path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> tuple[nn.Module, ModelConfig, Tokenizer]:
    """``(model, model_config, tokenizer)`` for ``"tiny"`` or a local HF directory; model in eval mode."""
    torch_dtype = resolve_dtype(dtype)
    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        config = tiny_model_config()
        config.dtype = _dtype_name(torch_dtype)
        return build_tiny_model(torch_dtype, device), config, load_tokenizer(source)
    config = load_model_config(source.path)
    config.dtype = _dtype_name(torch_dtype)
    model = load_weights(config, source.path, torch_dtype, device)
    return model, config, load_tokenizer(source)


def load_model_config(directory: str | Path) -> ModelConfig:
    """Parse ``config.json``, taking end-of-sequence ids from ``generation_config.json`` when it has them."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json; expected a Hugging Face model directory")
    config = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    config.eos_token_ids = hf_eos_token_ids(directory)
    return config


def load_weights(
    config: ModelConfig, directory: str | Path, dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """Build ``config``'s architecture and fill it from the directory's safetensors."""
    directory = Path(directory)
    with torch.device("meta"):
        model = build_model(config)
    state: dict[str, torch.Tensor] = {}
    for shard in _weight_files(directory):
        with safe_open(str(shard), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    state[name] = reader.get_tensor(name).to(device=device, dtype=dtype)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"weights in {directory} do not match {config.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.to(device).eval()


def _weight_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        files = [directory / name for name in shard_names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index_path} names {file.name}, which is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    return files


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)
