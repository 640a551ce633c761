"""``/ready`` and the prewarm behind it, without Ray: the gateway's ``Readiness`` against
workers that stand in for the real ones behind the same ``WorkerPool`` surface (``call``),
so a handshake can be made to fail or a worker to restart on purpose. The real apps'
``/ready`` is checked in test_service_1p1d.py, test_service_e2e.py and
test_smollm2_service.py (gRPC and NIXL, 1 + 1 and 2 + 2)."""

from __future__ import annotations

import asyncio

from pdserve.gateway.readiness import Readiness
from pdserve.gateway.router import Router
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.prewarm_result import PrewarmResult


class Worker:
    def __init__(self, worker_id: str, address: str = "") -> None:
        self.worker_id = worker_id
        self.address = address
        self.instance = "i0"
        self.reachable: set[str] = set()  # decode side: prefill addresses it can reach
        self.mismatched: dict[str, str] = {}  # and those whose layout differs, with the message
        self.handshakes: list[str] = []

    async def kv_transfer_address(self) -> str:
        return self.address

    async def connect_prefill_workers(self, addresses: list[str]) -> PrewarmResult:
        self.handshakes += addresses
        return PrewarmResult(
            [a for a in addresses if a in self.reachable],
            {a: self.mismatched[a] for a in addresses if a in self.mismatched},
        )


class Pool:
    def __init__(self) -> None:
        self.prefill = {w: Worker(w, f"127.0.0.1:{7100 + i}") for i, w in enumerate(["p0", "p1"])}
        self.decode = {"d0": Worker("d0")}
        self.all = {**self.prefill, **self.decode}

    async def call(self, worker_id: str, method: str, *args):
        return await getattr(self.all[worker_id], method)(*args)


def poll(router: Router, pool: Pool) -> None:
    """What the event poll does: the router hears each worker's current instance."""
    for worker in pool.all.values():
        router.apply(KVEventBatch(worker.worker_id, worker.instance, 0, 0))


def test_not_ready_until_every_decode_worker_has_handshaken_with_every_prefill_worker():
    async def scenario() -> None:
        pool = Pool()
        router = Router(list(pool.prefill), list(pool.decode))
        readiness = Readiness(pool, router, timeout_s=1.0)
        assert readiness.report()["ready"] is False  # nobody has answered yet
        poll(router, pool)
        pool.decode["d0"].reachable = {"127.0.0.1:7100"}  # p1 refuses the handshake
        await readiness.prewarm()
        report = readiness.report()
        assert not report["ready"] and report["missing_handshakes"] == ["d0->p1"]
        pool.decode["d0"].reachable.add("127.0.0.1:7101")
        await readiness.prewarm()
        assert readiness.report()["ready"] is True
        assert pool.decode["d0"].handshakes == [
            "127.0.0.1:7100",
            "127.0.0.1:7101",
            "127.0.0.1:7101",
        ]
        # A prefill worker restarts on the same address: a new engine, so a new handshake.
        pool.prefill["p0"].instance = "i1"
        poll(router, pool)
        assert readiness.report()["missing_handshakes"] == ["d0->p0"]
        await readiness.prewarm()
        assert readiness.report()["ready"] is True
        assert pool.decode["d0"].handshakes[-1] == "127.0.0.1:7100"

    asyncio.run(scenario())


def test_a_colocated_app_is_ready_once_its_workers_answer():
    async def scenario() -> None:
        pool = Pool()
        pool.decode, pool.all = {}, dict(pool.prefill)
        router = Router(list(pool.prefill), [])
        readiness = Readiness(pool, router, timeout_s=1.0)
        assert readiness.report()["roles_without_an_answering_worker"] == ["prefill"]
        poll(router, pool)
        await readiness.prewarm()
        assert readiness.report()["ready"] is True

    asyncio.run(scenario())


def test_a_refused_pair_keeps_ready_false_names_both_values_and_is_not_retried():
    """p1 runs another model: d0's handshake is refused with both sides' values. /ready stays
    false and says why, the pair is not asked again every round, and it is once p1 restarts."""
    reason = "KV layouts differ (model: local='Qwen3ForCausalLM:aa' remote='LlamaForCausalLM:bb')"

    async def scenario() -> None:
        pool = Pool()
        router = Router(list(pool.prefill), list(pool.decode))
        readiness = Readiness(pool, router, timeout_s=1.0)
        poll(router, pool)
        pool.decode["d0"].reachable = {"127.0.0.1:7100"}
        pool.decode["d0"].mismatched = {"127.0.0.1:7101": reason}
        await readiness.prewarm()
        await readiness.prewarm()
        report = readiness.report()
        assert not report["ready"] and report["missing_handshakes"] == ["d0->p1"]
        assert report["refused_handshakes"] == {"d0->p1": reason}
        assert pool.decode["d0"].handshakes == ["127.0.0.1:7100", "127.0.0.1:7101"]
        # p1 comes back with the right model: a new instance, asked again, and ready.
        pool.prefill["p1"].instance = "i1"
        pool.decode["d0"].mismatched = {}
        pool.decode["d0"].reachable.add("127.0.0.1:7101")
        poll(router, pool)
        await readiness.prewarm()
        report = readiness.report()
        assert report["ready"] and report["refused_handshakes"] == {}

    asyncio.run(scenario())
