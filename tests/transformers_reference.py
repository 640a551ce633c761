"""transformers' own load of a GGUF file, the reference of the parity tests, kept in pytest's
cache.

transformers converts a GGUF in pure Python: for smollm2 (100 MB, Q4_1) ≈ 40 s on 2 cores for
the model (it parses the metadata twice and builds a tensor name map per module) and ≈ 8 s
for the tokenizer. The conversion depends only on the file and on the versions of
transformers, gguf and torch, so its result is saved (``save_pretrained``) in pytest's cache
folder under a key made of those, and later runs load the saved copy: the same weights and
the same tokenizer, run by transformers' own forward, ``generate`` and ``encode``. A new key
replaces the old entry of the same file (each GGUF, smollm2's and gemma3's, keeps its own);
``pytest --cache-clear`` or ``make clean`` starts over.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import transformers


def reference_model(config: pytest.Config, gguf: Path) -> transformers.PreTrainedModel:
    """transformers' causal LM from ``gguf``, in float32, in eval mode."""

    def convert() -> transformers.PreTrainedModel:
        return transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )

    def save(model: transformers.PreTrainedModel, folder: Path) -> None:
        # save_pretrained refuses a model loaded from a GGUF (it counts as quantized); its
        # dequantized float32 weights and its config, less the GGUF origin, are all a plain
        # float32 reload needs.
        folder.mkdir()
        plain = copy.deepcopy(model.config)
        del plain.quantization_config
        plain.save_pretrained(folder)
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))

    def load(folder: Path) -> transformers.PreTrainedModel:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    return _cached(config, gguf, "model", convert, save, load).eval()


def reference_tokenizer(config: pytest.Config, gguf: Path) -> transformers.PreTrainedTokenizerBase:
    """transformers' tokenizer (and chat template) from ``gguf``'s metadata."""

    def convert() -> transformers.PreTrainedTokenizerBase:
        return transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def save(tokenizer: transformers.PreTrainedTokenizerBase, folder: Path) -> None:
        tokenizer.save_pretrained(folder)

    return _cached(
        config, gguf, "tokenizer", convert, save, transformers.AutoTokenizer.from_pretrained
    )


def _key(gguf: Path) -> str:
    with gguf.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()[:16]
    versions = "-".join(version(name) for name in ("transformers", "gguf", "torch"))
    return f"{gguf.stem}-{digest}-{versions}"


def _cached(
    config: pytest.Config,
    gguf: Path,
    kind: str,
    convert: Callable[[], Any],
    save: Callable[[Any, Path], None],
    load: Callable[[Path], Any],
) -> Any:
    cache = getattr(config, "cache", None)
    if cache is None:  # run with -p no:cacheprovider: nowhere to keep it
        return convert()
    folder = cache.mkdir(f"transformers-reference-{kind}")
    key = _key(gguf)
    entry = folder / key
    if entry.is_dir():
        return load(entry)
    converted = convert()
    partial = folder / f"{key}.partial-{os.getpid()}"
    save(converted, partial)
    for old in folder.iterdir():
        if old.name.startswith(f"{gguf.stem}-") and not old.name.startswith(key):
            shutil.rmtree(old, ignore_errors=True)
    try:
        partial.rename(entry)  # whole or absent, also when two runs convert at once
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return converted
