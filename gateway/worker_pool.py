"""The workers a gateway talks to, by id, through their Serve deployment handles."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.messages.generation import GenerationChunk, ModelInfo, WorkerRequest

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentResponseGenerator


class NoModelInfo(Exception):
    """No prefill worker described the model in time."""


@dataclass(frozen=True, slots=True)
class PoolChange:
    """What ``WorkerPool.reshape`` changed: the ids that joined each role, and those that
    left routing (retired, or gone)."""

    added_prefill: list[str]
    added_decode: list[str]
    removed: list[str]


class WorkerPool:
    """One single-replica Serve deployment per worker (see ``deploy/app.py`` for why).

    ``prefill`` and ``decode`` are the workers routed to and polled. ``retiring`` are those a
    scale-down is removing: nothing new goes to them, but the calls of requests already
    there (a stream's end, an abort, a decode worker's pull) still reach them, until the next
    ``reshape`` drops them."""

    def __init__(
        self,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        retiring: dict[str, Any] | None = None,
    ) -> None:
        self.prefill = dict(prefill)
        self.decode = dict(decode)
        self.retiring = dict(retiring or {})
        self._roles = dict.fromkeys(prefill, "prefill") | dict.fromkeys(decode, "decode")

    @property
    def all(self) -> dict[str, Any]:
        """Every routed worker's handle, prefill first."""
        return {**self.prefill, **self.decode}

    def role(self, worker_id: str) -> str:
        """The role of any worker this pool has routed to, "prefill" or "decode" (a retired
        one's too: a request routed there before the step may still ask)."""
        return self._roles[worker_id]

    def reshape(
        self,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        retiring: dict[str, Any],
    ) -> PoolChange:
        """Takes the worker set of a scale step (handles by id). A worker kept keeps its
        handle; a retired one stays reachable (``retiring``) but leaves routing."""
        before = set(self.all)
        change = PoolChange(
            added_prefill=sorted(set(prefill) - before),
            added_decode=sorted(set(decode) - before),
            removed=sorted(before - set(prefill) - set(decode)),
        )
        self.prefill, self.decode, self.retiring = dict(prefill), dict(decode), dict(retiring)
        self._roles |= dict.fromkeys(prefill, "prefill") | dict.fromkeys(decode, "decode")
        return change

    def handle(self, worker_id: str) -> Any:
        """The handle of a routed or retiring worker (``KeyError``: one the pool dropped)."""
        for group in (self.prefill, self.decode, self.retiring):
            if worker_id in group:
                return group[worker_id]
        raise KeyError(f"no worker {worker_id!r} in this gateway's pool")

    def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> DeploymentResponseGenerator[GenerationChunk]:
        """The worker's chunks for ``request``; cancelling the stream aborts it there."""
        return self.handle(worker_id).options(stream=True).generate.remote(request)

    async def call(self, worker_id: str, method: str, *args: Any) -> Any:
        return await getattr(self.handle(worker_id), method).remote(*args)

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
