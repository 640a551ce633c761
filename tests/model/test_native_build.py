"""Extension builds cannot hang anything (``model/native_build.py``): a build killed mid-way
leaves nothing that blocks the next, a build held elsewhere is waited for at most the
timeout, one source builds once per machine whatever its path, and a build that fails says
why. Each test builds a small pybind11 module (≈ 8 s) into its own cache folder."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pdserve.model import native_build

SOURCE = textwrap.dedent(
    """
    #include <pybind11/pybind11.h>
    int add(int a, int b) { return a + b; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
    """
)
FLAGS = ["-O1"]


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    path = tmp_path / "checkout-a" / "adder.cpp"
    path.parent.mkdir()
    path.write_text(SOURCE)
    return path


def _build_folder(source: Path) -> Path:
    return native_build.ExtensionBuild.of("adder", source, FLAGS).directory


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds} s")
        time.sleep(0.1)


def test_a_build_killed_midway_blocks_no_later_build(source: Path, caplog) -> None:
    """The issue's reproduction: a build is killed (its whole process group, as Ctrl-C or an
    OOM kill does) while torch's lock file is held. torch alone then waits on that file for
    ever; here the next build removes it, says so, and builds."""
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from pdserve.model import native_build; "
            "native_build.load_extension('adder', Path(sys.argv[1]), ['-O1'])",
            str(source),
        ],
        env=os.environ.copy(),
        start_new_session=True,
    )
    folder = _build_folder(source)
    torch_lock = folder / "lock"
    try:
        _wait_for(torch_lock.exists, 60, "the first build took torch's lock")
        builder = int((folder / "flock").read_text())
    finally:
        os.killpg(starter.pid, signal.SIGKILL)
    os.killpg(builder, signal.SIGKILL)  # the child builds in a session of its own
    starter.wait()
    _wait_for(lambda: not Path(f"/proc/{builder}").exists(), 10, "the builder died")
    assert torch_lock.exists() and not (folder / "built").exists()

    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        module = native_build.load_extension("adder", source, FLAGS, timeout_s=120)
    assert module.add(2, 3) == 5
    assert any("left by a build that was killed" in r.getMessage() for r in caplog.records)


def test_one_source_in_two_checkouts_is_built_once(source: Path, tmp_path: Path) -> None:
    """The build's folder is named by what it is built from, and the source is copied into
    it: a second checkout of the same source loads the first's build, compiling nothing."""
    assert native_build.load_extension("adder", source, FLAGS).add(1, 1) == 2
    built = _build_folder(source) / (_build_folder(source).name + ".so")
    first_build = built.stat().st_mtime_ns
    other = tmp_path / "checkout-b" / "adder.cpp"
    other.parent.mkdir()
    other.write_text(SOURCE)

    assert native_build.load_extension("adder", other, FLAGS).add(2, 2) == 4
    assert built.stat().st_mtime_ns == first_build
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [_build_folder(source).name]


def test_a_build_held_by_another_process_is_waited_for_at_most_the_timeout(
    source: Path,
) -> None:
    folder = _build_folder(source)
    folder.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; d = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(d, fcntl.LOCK_EX); os.write(d, str(os.getpid()).encode()); "
            "print('held', flush=True); time.sleep(600)",
            str(folder / "flock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(native_build.ExtensionUnavailable) as refusal:
            native_build.load_extension("adder", source, FLAGS, timeout_s=10)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert f"waiting for the build held by process {holder.pid}" in str(refusal.value)
    assert "within 10 s" in str(refusal.value) and waited < 30


def test_a_build_without_a_compiler_says_why(source: Path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(native_build.ExtensionUnavailable, match="failed to build"):
        native_build.load_extension("adder", source, FLAGS, timeout_s=120)
    assert not (_build_folder(source) / "built").exists()
