"""A model's tokenizer, read from its files without loading weights (or torch).

This is what the gateway calls: ``load_tokenizer(model)`` for any ``--model`` value, then
``tokenizer.chat_template.render(messages)`` for a chat request and
``tokenizer.encode(prompt, add_special_tokens=False)`` on the rendered prompt (the
template writes any BOS itself); ``tokenizer.eos_token_ids`` are the ids that end a reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.checkpoint.gguf_file import gguf_metadata, open_gguf
from pdserve.checkpoint.model_source import ModelSource, hf_eos_token_ids, resolve_model
from pdserve.tokenizer.chat_template import ChatTemplate
from pdserve.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pdserve.tokenizer.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def load_tokenizer(model: str | ModelSource) -> Tokenizer:
    """The tokenizer of ``model`` (a ``--model`` value or an already resolved source)."""
    source = resolve_model(model) if isinstance(model, str) else model
    source = source.stand_in  # a simulated model speaks its real model's tokens
    if source.kind == "tiny":
        return ByteTokenizer()
    if source.kind == "gguf":
        return tokenizer_from_gguf(gguf_metadata(open_gguf(source.file_path())))
    return _hf_dir_tokenizer(source.file_path())


def _hf_dir_tokenizer(directory: Path) -> HFTokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no tokenizer.json (a fast-tokenizer file is required)"
        )
    eos_token_ids = hf_eos_token_ids(directory)
    if not eos_token_ids:
        raise ValueError(
            f"{directory}: neither config.json nor generation_config.json names an eos_token_id"
        )
    return HFTokenizer.from_file(str(path), eos_token_ids, _hf_chat_template(directory))


def _hf_chat_template(directory: Path) -> ChatTemplate | None:
    """``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (a string), if any."""
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_path = directory / "chat_template.jinja"
    source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
    if not isinstance(source, str):
        return None
    return ChatTemplate(
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )


def _token_text(token: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
