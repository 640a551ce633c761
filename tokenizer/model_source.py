"""What a ``--model`` value names: the built-in ``tiny`` model or a local Hugging Face directory.

One resolution for everything that opens a model's files (the engine's weight loader, the
gateway's tokenizer), so both accept and refuse the same names. Nothing is ever
downloaded: a name that is neither built in nor a local path is an error naming what to pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TINY_NAME = "tiny"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """``kind`` says how to read ``path``: ``tiny`` (generated, no files) or ``hf_dir``."""

    kind: Literal["tiny", "hf_dir"]
    path: Path | None = None


def resolve_model(name_or_path: str) -> ModelSource:
    """The source of ``name_or_path``; ``FileNotFoundError`` when it names nothing here."""
    if name_or_path == TINY_NAME:
        return ModelSource("tiny")
    directory = Path(name_or_path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither the built-in {TINY_NAME!r} nor a local directory; "
            "nothing is downloaded, pass the path of a Hugging Face model directory"
        )
    return ModelSource("hf_dir", directory)


def hf_eos_token_ids(directory: Path) -> list[int]:
    """End-of-sequence ids of an HF directory: ``generation_config.json`` when it names any,
    else ``config.json``'s (transformers' own precedence for ``generate``)."""
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
