"""Loading and unloading LoRA adapters on every worker of both roles, all or none.

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
        every worker reads the folder and registers it ──▶ all answered with one digest:
                                                           the service serves it
        any refusal, silence or other digest ──▶ the workers that took it unload it again,
                                                 and the answer names who refused and why
    POST /v1/unload_lora_adapter  {"lora_name": ...}
        every worker unregisters it (its running requests end on its weights); 404 when
        no worker had it

A prefill and a decode worker must read the same weights: the hand-off names the digest and
a decode worker refuses another (``engine/llm_engine.py: check_handoff_adapter``). So a load
that one worker refuses (a rank above its ``max_lora_rank``, a file it cannot read) or reads
differently (another node's copy of the folder) leaves the service as it was. The answers go
to the router at once, so the next request may name the adapter; the other gateway
replicas learn of it with their next poll of the workers' KV events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from ray.exceptions import RayTaskError

from pdserve.gateway.api.openai_schema import APIError
from pdserve.gateway.router import Router
from pdserve.gateway.worker_pool import WorkerPool
from pdserve.messages.lora_adapters import LoRAAdapterRef, LoRAAdapterReport

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # an adapter's files may sit on a slow volume


def parse_adapter_body(body: object, needs_path: bool) -> tuple[str, str]:
    """``(lora_name, lora_path)`` of a load or unload body (vLLM's fields), refused with
    400 naming the field that is missing or not a non-empty string."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    fields = ("lora_name", "lora_path") if needs_path else ("lora_name",)
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise APIError(400, f"'{name}' must be a non-empty string", param=name)
    return body["lora_name"], body.get("lora_path", "")


async def load_everywhere(
    workers: WorkerPool, router: Router, base_model: str, name: str, path: str
) -> LoRAAdapterRef:
    """Loads the adapter on every worker, or on none (module doc); 400 naming the
    workers that refused, and why."""
    if name == base_model:
        raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
    answers = await _ask_all(workers, workers.all, "load_lora_adapter", name, path)
    refusals = {w: a for w, a in answers.items() if isinstance(a, BaseException)}
    reports = {w: a for w, a in answers.items() if isinstance(a, LoRAAdapterReport)}
    digests = {w: _ref_in(report, name).digest for w, report in reports.items()}
    if not refusals and len(set(digests.values())) > 1:
        refusals = {
            w: ValueError(f"it read weights {digest[:12]}") for w, digest in digests.items()
        }
    if refusals:
        took = await _ask_all(workers, reports, "unload_lora_adapter", name)
        for worker_id, answer in took.items():
            if isinstance(answer, tuple):
                router.note_lora(worker_id, answer[1])
            else:  # its registration stands until it restarts: say so where it is seen
                logger.error("worker %s kept LoRA adapter %r: %r", worker_id, name, answer)
        reasons = "; ".join(f"{w}: {_reason(e)}" for w, e in sorted(refusals.items()))
        raise APIError(
            400,
            f"LoRA adapter {name!r} was not loaded, no worker serves it: {reasons}",
            param="lora_path",
        )
    for worker_id, report in reports.items():
        router.note_lora(worker_id, report)
    return _ref_in(next(iter(reports.values())), name)


async def unload_everywhere(workers: WorkerPool, router: Router, name: str) -> None:
    """Unregisters the adapter on every worker; 404 when none had it, 503 naming the
    workers that did not answer (the others have unloaded it)."""
    answers = await _ask_all(workers, workers.all, "unload_lora_adapter", name)
    held = False
    failed: dict[str, BaseException] = {}
    for worker_id, answer in answers.items():
        if isinstance(answer, BaseException):
            failed[worker_id] = answer
            continue
        held = held or answer[0]
        router.note_lora(worker_id, answer[1])
    if failed:
        reasons = "; ".join(f"{w}: {_reason(e)}" for w, e in sorted(failed.items()))
        raise APIError(
            503,
            f"LoRA adapter {name!r} was unloaded from every worker but these: {reasons}",
            type="server_error",
        )
    if not held:
        raise APIError(
            404, f"LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found"
        )


async def _ask_all(
    workers: WorkerPool, worker_ids: Iterable[str], method: str, *args: Any
) -> dict[str, Any]:
    """Each worker's answer to ``method(*args)``, or the exception it raised (a timeout
    after ``LOAD_TIMEOUT_S``), asked all at once."""
    ids = sorted(worker_ids)
    calls = [asyncio.wait_for(workers.call(w, method, *args), LOAD_TIMEOUT_S) for w in ids]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    return dict(zip(ids, answers))


def _ref_in(report: LoRAAdapterReport, name: str) -> LoRAAdapterRef:
    return next(ref for ref in report.registered if ref.name == name)


def _reason(error: BaseException) -> str:
    """The worker's own message where its code refused, else what became of the call."""
    if isinstance(error, RayTaskError) and error.cause is not None:
        return str(error.cause)
    if isinstance(error, TimeoutError):
        return f"no answer within {LOAD_TIMEOUT_S:g} s"
    return str(error) or repr(error)
