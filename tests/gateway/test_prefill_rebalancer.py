"""Which waiting prefill calls the rebalancer moves, and when it holds back.

Pure gateway logic against a real ``Router``: loads are the router's (``begin``), the
withdrawal is a coroutine that answers as the worker would (the worker's own rule is
tests/worker/test_withdraw.py).
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cache import BlockHasher
from pdserve.gateway.prefill_rebalancer import PrefillRebalancer, WaitingPrefill
from pdserve.gateway.router import Router

HASHER = BlockHasher("xxh3_128", 0)


def hashes(number: int) -> list:
    return HASHER.hash_request_blocks([number + 1] * 64, 16)


class Withdrawals:
    """Records each withdrawal asked; answers ``taken_back`` once ``answer`` is set."""

    def __init__(self, taken_back: bool = True) -> None:
        self.asked: list[tuple[str, str]] = []
        self.taken_back = taken_back
        self.answer = asyncio.Event()

    async def __call__(self, worker_id: str, request_id: str, call_serial: int) -> bool:
        self.asked.append((worker_id, request_id))
        await self.answer.wait()
        return self.taken_back


def queue(rebalancer: PrefillRebalancer, worker_id: str, numbers: range) -> None:
    for number in numbers:
        rebalancer.router.begin(worker_id)
        rebalancer.waiting(worker_id, WaitingPrefill(f"r{number}", number, hashes(number), None))


def test_the_newest_calls_move_until_the_router_would_keep_them() -> None:
    async def scenario() -> None:
        router = Router(["p0", "p1", "p2"], [])
        withdraw = Withdrawals()
        rebalancer = PrefillRebalancer(router, withdraw)
        queue(rebalancer, "p0", range(8))  # p0: 8 in flight, p1 and p2 idle
        assert rebalancer.rebalance() == 5
        await asyncio.sleep(0)  # the withdrawals start
        # Each decided move counts at once: 8 → 3 on p0, 0 → 3 and 0 → 2 on the others.
        assert [request for _, request in withdraw.asked] == ["r7", "r6", "r5", "r4", "r3"]
        assert rebalancer.rebalance() == 0, "a round decided while the last one's moves fly"
        withdraw.answer.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # Taken back: each stays a move in flight until its stream ends (``answered``).
        assert rebalancer.rebalance() == 0
        for number in range(3, 8):
            rebalancer.answered("p0", f"r{number}")
        assert rebalancer.num_waiting == 3

    asyncio.run(scenario())


def test_a_call_the_worker_refuses_stays_and_moves_no_more() -> None:
    async def scenario() -> None:
        router = Router(["p0", "p1"], [])
        withdraw = Withdrawals(taken_back=False)
        withdraw.answer.set()
        rebalancer = PrefillRebalancer(router, withdraw)
        queue(rebalancer, "p0", range(4))
        assert rebalancer.rebalance() == 2  # r3 and r2 (4 against 0, then 3 against 1)
        await asyncio.sleep(0)  # the withdrawals start
        await asyncio.sleep(0)
        assert rebalancer.num_waiting == 2  # refused (started): they answer where they are
        # The router's loads are still 4 against 0: the next round asks for the others,
        # never again for those refused.
        assert rebalancer.rebalance() == 2
        await asyncio.sleep(0)
        assert [request for _, request in withdraw.asked] == ["r3", "r2", "r1", "r0"]

    asyncio.run(scenario())


def test_a_retired_worker_gives_every_unstarted_call_to_the_workers_kept() -> None:
    async def scenario() -> None:
        router = Router(["p0", "p1", "p2"], [])
        withdraw = Withdrawals()
        rebalancer = PrefillRebalancer(router, withdraw)
        queue(rebalancer, "p2", range(3))
        queue(rebalancer, "p0", range(3, 4))
        router.remove_worker("p2")  # a scale step down retired it
        # Balanced by load among those kept (1 against 0), yet p2's calls all go.
        assert rebalancer.rebalance() == 3
        await asyncio.sleep(0)
        assert [request for _, request in withdraw.asked] == ["r2", "r1", "r0"]

    asyncio.run(scenario())


def test_a_worker_out_of_routing_keeps_its_calls() -> None:
    async def scenario() -> None:
        router = Router(["p0", "p1"], [])
        rebalancer = PrefillRebalancer(router, Withdrawals())
        queue(rebalancer, "p0", range(4))
        router.set_available("p0", False)  # hung: its calls are the stream watch's
        assert rebalancer.rebalance() == 0

    asyncio.run(scenario())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=12), min_size=2, max_size=6))
def test_moves_never_leave_the_loads_further_apart(loads: list[int]) -> None:
    """Whatever the queues, once a round's moves are routed again the busiest worker is no
    busier, the idlest no idler, and the spread no wider (nor wider than one where a move
    only swaps which worker has the extra call)."""

    async def scenario() -> None:
        workers = [f"p{i}" for i in range(len(loads))]
        router = Router(workers, [])
        withdraw = Withdrawals()
        rebalancer = PrefillRebalancer(router, withdraw)
        serial = 0
        for worker_id, load in zip(workers, loads, strict=True):
            queue(rebalancer, worker_id, range(serial, serial + load))
            serial += load
        rebalancer.rebalance()
        await asyncio.sleep(0)  # the withdrawals start
        for worker_id, request_id in withdraw.asked:  # as the orchestrator routes them again
            router.end(worker_id)
            router.begin(router.pick_prefill(hashes(int(request_id[1:]))).worker_id)
        after = router.prefill_loads()
        assert max(after.values()) <= max(loads)
        assert min(after.values()) >= min(loads)
        assert max(after.values()) - min(after.values()) <= max(max(loads) - min(loads), 1)
        if max(loads) - min(loads) >= 2:
            assert withdraw.asked, "a skew of two or more moved nothing"

    asyncio.run(scenario())
