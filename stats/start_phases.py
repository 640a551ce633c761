"""A worker's start, phase by phase: where its seconds go before it serves.

Every scale step, restart and fault path pays a worker's start, so it is measured where the
work happens and reported with the worker's stats (``start_seconds``, per phase):

    EngineHost.__init__                      with StartPhases.recording() as phases:
      LLMEngine.__init__                       with start_phase("model_build"):
        load_model                                 with start_phase("weights"): ...
      ...                                      with start_phase("kv_pool"): ...

Phases nest, and each phase's time is its own: ``model_build`` does not count the
``weights`` read inside it. Outside a recording (an offline engine, a test) ``start_phase``
does nothing but read a context variable.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar


class StartPhases:
    """Seconds per named phase, in the order the phases first ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._nested: list[float] = []  # per open phase: the time its inner phases took

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        self._nested.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            own = elapsed - self._nested.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + own
            if self._nested:
                self._nested[-1] += elapsed

    def add(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (the imports before the constructor ran)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @classmethod
    @contextlib.contextmanager
    def recording(cls) -> Iterator[StartPhases]:
        """Collects the ``start_phase`` blocks run inside it, in this thread."""
        phases = cls()
        token = _recording.set(phases)
        try:
            yield phases
        finally:
            _recording.reset(token)


_recording: ContextVar[StartPhases | None] = ContextVar("start_phases", default=None)


def start_phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Times the block as phase ``name`` of the start being recorded, if one is."""
    phases = _recording.get()
    return phases.phase(name) if phases is not None else contextlib.nullcontext()
