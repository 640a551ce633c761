"""The workers a gateway talks to, by id, through their Serve deployment handles."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentResponseGenerator


class NoModelInfo(Exception):
    """No prefill worker described the model in time."""


class WorkerPool:
    """One single-replica Serve deployment per worker (see ``deploy/app.py`` for why)."""

    def __init__(self, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.all = {**prefill, **decode}

    def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> DeploymentResponseGenerator[GenerationChunk]:
        """The worker's chunks for ``request``; cancelling the stream aborts it there."""
        return self.all[worker_id].options(stream=True).generate.remote(request)

    async def call(self, worker_id: str, method: str, *args: Any) -> Any:
        return await getattr(self.all[worker_id], method).remote(*args)

    async def first_model_info(self, timeout_s: float) -> ModelInfo:
        """The ``ModelInfo`` of whichever prefill worker answers first (they all serve one
        model), so one dead or slow worker delays neither start-up nor health checks.
        Raises ``NoModelInfo`` when none answers within ``timeout_s``."""
        asks = [asyncio.ensure_future(self.call(w, "model_info")) for w in self.prefill]
        errors: list[str] = []
        try:
            for next_answer in asyncio.as_completed(asks, timeout=timeout_s):
                try:
                    return await next_answer
                except Exception as error:  # noqa: BLE001 — that worker is down; ask the next
                    errors.append(repr(error))
        except TimeoutError:
            errors.append(f"no answer within {timeout_s} s")
        finally:
            for ask in asks:
                ask.cancel()
        raise NoModelInfo(
            f"no prefill worker of {sorted(self.prefill)} described the model: " + "; ".join(errors)
        )
