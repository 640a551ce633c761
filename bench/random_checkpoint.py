"""A random Hugging Face model saved as a checkpoint the engine loads, for the benchmarks that
time shapes rather than answers (a step's time does not depend on the weights' values)."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import transformers


def save_random_checkpoint(model: transformers.PreTrainedModel, directory: Path) -> str:
    """Saves ``model`` in float32 with a tokenizer of one word per id (``w0`` .. ``wN``: the
    benchmarks send token ids, never text) to ``directory``; returns its path."""
    model.float().save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(model.config.vocab_size)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)
