"""Torch C++ extensions built once per machine, by a build that cannot hang anything.

Why not torch's ``cpp_extension.load`` alone: it guards a build with a lock *file* and waits
for it without bound. A build killed mid-way (Ctrl-C in ``make setup``, an OOM kill at a
first engine start, a CI run cut off) leaves the file, and every later start on the machine
waits for ever, silently. And its ``build.ninja`` records the source's path, so two checkouts
of one source rebuild in turn (≈ 30 s each). Here:

- the build runs in a **child process** holding an OS lock (``flock``) on ``flock`` in the
  build's folder: the kernel drops that lock when its holder dies, however it dies, so a
  killed build blocks nothing; under the lock, a torch ``lock`` file can only be a killed
  build's leftover and is removed (a log line says so);
- the parent waits for the child at most ``timeout_s`` (a build of another process included),
  then kills its process group and says why: the caller serves without the extension;
- the source is **copied into the build's folder**, named by a digest of everything the
  build depends on, so ninja records the same path in every checkout: one source, one build
  per machine;
- a ``built`` marker is written last: present, the module is loaded at once (no child, no
  lock); absent, the child builds (or finds another's build done once it has the lock).

Cache layout (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``, as torch's)::

    <root>/<name>_<digest>/
        flock                the build lock (flock, holder's pid inside, for the log)
        <name>_<digest>.cpp  the source, copied
        build.ninja, *.o     torch's build
        <name>_<digest>.so   the module
        built                written last: the module is whole

    start ── built? ── yes ──▶ import the .so
               │ no
               ▼
             child (own session, ≤ timeout_s): flock → built? → drop a stale torch lock →
             torch load() → write built  ──▶ parent imports the .so
               │ failed or timed out: the group is killed, ExtensionUnavailable(reason)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

# A cold build of the paged decode kernel takes ≈ 20 s here, ≈ 60 s with the other core busy.
DEFAULT_TIMEOUT_S = 300.0
_BUILT_MARKER = "built"
_LOCK_NAME = "flock"
_TORCH_LOCK_NAME = "lock"  # torch's FileBaton in the build directory


class ExtensionUnavailable(RuntimeError):
    """The extension could not be built or loaded here; the message says why."""


@dataclass(frozen=True, slots=True)
class ExtensionBuild:
    """One build: its ``name`` is its prefix and a digest of what it is built from (the
    source, the flags, this CPU, the Python and torch versions: a build made for another is
    never loaded), its folder is in ``root``."""

    name: str
    source_text: str
    cflags: list[str]
    root: str

    @classmethod
    def of(cls, prefix: str, source: Path, cflags: list[str]) -> ExtensionBuild:
        source_text = source.read_text()
        built_from = "\n".join(
            [_cpu_description(), sys.version, torch.__version__, source_text, *cflags]
        )
        digest = hashlib.sha256(built_from.encode()).hexdigest()[:12]
        return cls(f"{prefix}_{digest}", source_text, cflags, str(cache_root()))

    @property
    def directory(self) -> Path:
        return Path(self.root) / self.name

    @property
    def module_path(self) -> Path:
        return self.directory / f"{self.name}.so"


def cache_root() -> Path:
    """Where builds are kept: torch's extension folder, shared by every checkout and venv."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "torch_extensions"


def load_extension(
    prefix: str, source: Path, cflags: list[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> ModuleType:
    """The extension built from ``source``: loaded from the cache, else built by a child
    within ``timeout_s``; raises ``ExtensionUnavailable`` naming the cause otherwise."""
    build = ExtensionBuild.of(prefix, source, cflags)
    if not (build.directory / _BUILT_MARKER).exists():
        _build_in_child(build, timeout_s)
    return _import(build)


class LazyExtension:
    """An extension loaded at its first use in a process (built then if it must be), or,
    where it cannot be, ``None`` for good after one warning that says why and what serves
    instead: the callers keep their torch path. Every call asks, so once settled no lock is
    taken."""

    def __init__(
        self,
        what: str,
        prefix: str,
        source: Path,
        cflags: list[str],
        instead: str,
        log: logging.Logger,
        unsupported: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``what``: its name in the warning ("the paged decode kernel"); ``instead``: what
        serves without it; ``unsupported``: why this machine cannot run it, if it cannot
        (asked before building)."""
        self.what, self.prefix, self.source, self.cflags = what, prefix, source, cflags
        self.instead, self.log, self.unsupported = instead, log, unsupported
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._failed = False

    def get(self) -> ModuleType | None:
        """The module, or None where it cannot be built or loaded here."""
        if self._module is not None or self._failed:
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                reason = self.unsupported()
                if reason is None:
                    try:
                        self._module = load_extension(self.prefix, self.source, self.cflags)
                    except ExtensionUnavailable as error:
                        reason = f"is not available ({error})"
                if reason is not None:
                    self._failed = True
                    self.log.warning("%s %s; %s", self.what, reason, self.instead)
        return self._module

    def build_now(self) -> None:
        """A kernel module run as a script (``make setup``): builds or loads it now, not at
        its first use, and says so (without a compiler the warning says what serves)."""
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        if self.get() is not None:
            self.log.info("%s: built for this CPU", self.what)


def _build_in_child(build: ExtensionBuild, timeout_s: float) -> None:
    started = time.monotonic()
    child = subprocess.Popen(
        # -P: the script's folder (model/) is not put on sys.path; only torch is imported.
        [sys.executable, "-P", __file__, json.dumps(asdict(build))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its compiler and ninja with it: killed as one group
    )
    try:
        _, said = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        _, said = child.communicate()
        raise ExtensionUnavailable(
            f"{build.name} was not built within {timeout_s:.0f} s ({_last_line(said)})"
        ) from None
    if child.returncode != 0:
        raise ExtensionUnavailable(f"{build.name} failed to build: {_last_line(said)}")
    for line in said.splitlines():
        logger.info("%s", line)
    logger.info("%s: ready after %.1f s", build.name, time.monotonic() - started)


def _import(build: ExtensionBuild) -> ModuleType:
    """The built module (it links against libtorch, which this module has loaded)."""
    spec = importlib.util.spec_from_file_location(build.name, build.module_path)
    if spec is None or spec.loader is None:
        raise ExtensionUnavailable(f"{build.module_path} is not a loadable module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ExtensionUnavailable(f"{build.module_path} does not load: {error}") from error
    return module


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "it said nothing"


def _cpu_description() -> str:
    """This CPU's model and instruction-set flags (the build is ``-march=native``)."""
    try:
        described = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    return "\n".join(
        sorted({line for line in described.splitlines() if line.startswith(("flags", "model"))})
    )


def _first_cause(build_output: str) -> str:
    """The line of a failed build's output that says why (the compiler's first error, or a
    missing compiler), not ninja's closing "build stopped"."""
    lines = [line.strip() for line in build_output.splitlines()[1:] if line.strip()]
    for line in lines:
        if any(word in line.lower() for word in ("error", "not found", "no such file")):
            return line
    return lines[0] if lines else build_output.strip()


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _hold_build_lock(directory: Path) -> None:
    """Takes the build lock, held until this process exits however it exits (its descriptor
    is never closed); says whose build it waits for meanwhile."""
    descriptor = os.open(directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "?"
        _say(f"waiting for the build held by process {holder}")
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, str(os.getpid()).encode(), 0)


def _build(build: ExtensionBuild) -> None:
    """The child's work: under the lock, build unless another process has meanwhile."""
    build.directory.mkdir(parents=True, exist_ok=True)
    _hold_build_lock(build.directory)
    if (build.directory / _BUILT_MARKER).exists():
        return
    stale = build.directory / _TORCH_LOCK_NAME
    if stale.exists():  # nobody else holds the flock: a killed build's leftover
        stale.unlink()
        _say(f"removed {stale}, left by a build that was killed")
    source = build.directory / f"{build.name}.cpp"
    source.write_text(build.source_text)
    # Imported here, in the child that builds: it pulls setuptools in, 55 ms of every
    # worker's start where the extension is already built.
    from torch.utils.cpp_extension import load

    try:
        load(
            name=build.name,
            sources=[str(source)],
            extra_cflags=list(build.cflags),
            build_directory=str(build.directory),
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - any failure: said in one line, for the parent
        _say(_first_cause(str(error)))
        sys.exit(1)
    (build.directory / _BUILT_MARKER).write_text(build.name)
    _say(f"{build.name}: built")


if __name__ == "__main__":  # the child of _build_in_child
    _build(ExtensionBuild(**json.loads(sys.argv[1])))
