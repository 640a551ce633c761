"""``/ready``: can the service take traffic now, and the prewarm that makes it so.

``/health`` says the gateway process is alive. ``/ready`` says more: every role has a worker
that answered the gateway's event poll, and every decode worker has completed its KV-plane
handshake with every prefill worker it may pull from, so no user request pays a handshake.
The gateway drives those handshakes itself (the decode workers cannot know where the prefill
workers listen until someone tells them):

    for each prefill worker (current instance):  kv_transfer_address()  ─▶ address
    for each decode worker (current instance):   connect_prefill_workers([addresses])
                                                 ─▶ the addresses it handshook with, and
                                                    those that refused it (PrewarmResult)

A worker that restarts comes back under a new instance id (and, on a fixed port, at the
same address but a new engine): its pairs are done again on the next round. A refused pair
(another model, dtype, block size or layer count on the other side) is not retried until
one side restarts: ``/ready`` stays false and names the pair with both sides' values.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdserve.gateway.router import Router
from pdserve.gateway.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class Readiness:
    def __init__(self, workers: WorkerPool, router: Router, timeout_s: float) -> None:
        self.workers = workers
        self.router = router
        self.timeout_s = timeout_s
        # (prefill instance id, address) of each prefill worker whose address is known.
        self._addresses: dict[str, tuple[str, str]] = {}
        # decode worker → the (decode instance, prefill worker, its instance) that handshook.
        self._connected: dict[str, set[tuple[str, str, str]]] = {}
        # (decode worker, decode instance, prefill worker, its instance) → why it was refused.
        self._refused: dict[tuple[str, str, str, str], str] = {}
        self._round: asyncio.Lock = asyncio.Lock()

    async def prewarm(self) -> bool:
        """One round: learns new prefill addresses, connects decode workers to them; then
        says whether the service is ready (the event poll backs off only once it is)."""
        if self.workers.decode and not self._round.locked():
            async with self._round:
                await self._prewarm_round()
        return bool(self.report()["ready"])

    async def _prewarm_round(self) -> None:
        for prefill_id in self.workers.prefill:
            instance = self.router.instance_id(prefill_id)
            if instance is None or self._addresses.get(prefill_id, ("",))[0] == instance:
                continue
            address = await self._call(prefill_id, "kv_transfer_address")
            if address is not None:
                self._addresses[prefill_id] = (instance, address)
        for decode_id in self.workers.decode:
            await self._connect(decode_id)

    async def _connect(self, decode_id: str) -> None:
        decode_instance = self.router.instance_id(decode_id)
        if decode_instance is None:
            return
        done = self._connected.setdefault(decode_id, set())
        wanted = {
            address: (decode_instance, prefill_id, prefill_instance)
            for prefill_id, (prefill_instance, address) in self._addresses.items()
            if (decode_instance, prefill_id, prefill_instance) not in done
            and (decode_id, decode_instance, prefill_id, prefill_instance) not in self._refused
        }
        if not wanted:
            return
        result = await self._call(decode_id, "connect_prefill_workers", list(wanted))
        if result is None:
            return
        for address in result.connected:
            done.add(wanted[address])
        for address, reason in result.refused.items():
            self._refused[(decode_id, *wanted[address])] = reason
            logger.error("%s refuses %s: %s", decode_id, wanted[address][1], reason)

    async def _call(self, worker_id: str, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(
                self.workers.call(worker_id, method, *args), self.timeout_s
            )
        except Exception as error:  # noqa: BLE001 — not ready yet; the next round tries again
            logger.info("prewarm: %s.%s did not answer: %r", worker_id, method, error)
            return None

    def report(self) -> dict[str, Any]:
        """``ready`` and, when it is not, what is missing."""
        answered = {
            w
            for w in self.workers.all
            if self.router.instance_id(w) is not None and self.router.is_available(w)
        }
        roles_missing = [
            role
            for role, ids in (("prefill", self.workers.prefill), ("decode", self.workers.decode))
            if ids and not answered & set(ids)
        ]
        missing_handshakes = []
        refused = {}
        for decode_id in self.workers.decode:
            decode_instance = self.router.instance_id(decode_id)
            done = self._connected.get(decode_id, set())
            for prefill_id in self.workers.prefill:
                prefill_instance = self.router.instance_id(prefill_id)
                if (decode_instance, prefill_id, prefill_instance) not in done:
                    missing_handshakes.append(f"{decode_id}->{prefill_id}")
                reason = self._refused.get(
                    (decode_id, decode_instance or "", prefill_id, prefill_instance or "")
                )
                if reason is not None:
                    refused[f"{decode_id}->{prefill_id}"] = reason
        return {
            "ready": not roles_missing and not missing_handshakes,
            "roles_without_an_answering_worker": roles_missing,
            "missing_handshakes": missing_handshakes,
            "refused_handshakes": refused,
            "unavailable": sorted(set(self.workers.all) - answered),
        }
