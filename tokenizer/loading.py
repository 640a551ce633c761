"""A model's tokenizer, read from its files without loading weights (or torch)."""

from __future__ import annotations

from pdserve.tokenizer.model_source import ModelSource, hf_eos_token_ids, resolve_model
from pdserve.tokenizer.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def load_tokenizer(model: str | ModelSource) -> Tokenizer:
    """The tokenizer of ``model`` (a ``--model`` value or an already resolved source)."""
    source = resolve_model(model) if isinstance(model, str) else model
    if source.kind == "tiny":
        return ByteTokenizer()
    path = source.path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{source.path} has no tokenizer.json (a fast-tokenizer file is required)")
    eos_token_ids = hf_eos_token_ids(source.path)
    if not eos_token_ids:
        raise ValueError(f"{source.path}: neither config.json nor generation_config.json names "
                         f"an eos_token_id")
    return HFTokenizer.from_file(str(path), eos_token_ids[0])
