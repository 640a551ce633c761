"""The workers a gateway talks to, by id, through their Serve deployment handles."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdserve.messages.generation import GenerationChunk, WorkerRequest


class WorkerPool:
    """One single-replica Serve deployment per worker (see ``deploy/app.py`` for why)."""

    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.all = {**prefill, **decode}

    def stream(self, worker_id: str, request: WorkerRequest) -> AsyncIterator[GenerationChunk]:
        """The worker's chunks for ``request``; cancelling the stream aborts it there."""
        return self.all[worker_id].options(stream=True).generate.remote(request)

    async def call(self, worker_id: str, method: str, *args: Any) -> Any:
        return await getattr(self.all[worker_id], method).remote(*args)
