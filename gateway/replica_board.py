"""Several gateway replicas answering as one service: a small shared board of their figures.

With ``num_replicas > 1`` Serve's proxy spreads requests over the gateway replicas; each keeps
its own router index (fed by the same KV events) and its own admission count, but a user
asks ``/stats``, ``/metrics`` or ``GET /v1/requests/{id}`` of the service, and any replica
may answer. So each replica pushes its gateway row and the requests it finished since its
last push to one ``ReplicaBoard`` actor per app, every ``PUSH_INTERVAL_S``, and answers
from the board's rows (its own fresh):

    replica A ──push(row, new records)──▶ ReplicaBoard ◀──push── replica B
    GET /stats on B:  totals(GATEWAY_STATS, [A's last row, B's row now])

Counters and histograms add up; the recent p50/p99 show the worst replica's. A replica that
stopped pushing (stopped, restarted) keeps its counters in the sum, as a restarted worker's
Prometheus series would, but its present-tense gauges count as 0 once its row is older
than ``STALE_AFTER_S``. With one replica none of this runs.

Losing the board loses nothing for good. Ray restarts it (``max_restarts``), or, killed for
good, the next call creates it again by name; each board has an ``incarnation`` id, and a
replica that sees a new one pushes its recent records again. Until every replica has pushed
to the new board, a replica answers with the rows it last read for the replicas the board
does not know yet (each reads the rows after every push, not only when asked for
``/stats``), so no counter of ``/stats`` goes backwards; a failed push keeps its records for
the next. A request's record, asked of another replica before its own has refilled the new
board, is 404 for up to a push interval.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from pdserve.stats.registry import GATEWAY_STATS, Kind
from pdserve.stats.views import totals

logger = logging.getLogger(__name__)

PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaBoard:
    """The gateway replicas' rows and recent request records, by replica id."""

    def __init__(self, num_recent_requests: int) -> None:
        self.incarnation = uuid.uuid4().hex  # a restarted board is a new one, and empty
        self._rows: dict[str, tuple[float, dict[str, Any]]] = {}
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._capacity = num_recent_requests
        # Service-wide admission (service_admission.py): replica → (declared when, places held)
        self._places: dict[str, tuple[float, int]] = {}

    def push(self, replica_id: str, row: dict[str, Any], records: list[dict[str, Any]]) -> str:
        """Keeps a replica's row and new records; returns this board's incarnation."""
        self._rows[replica_id] = (time.monotonic(), row)
        for record in records:  # oldest first: the newest end up last
            self._records[record["request_id"]] = record
            self._records.move_to_end(record["request_id"])
        while len(self._records) > self._capacity:
            self._records.popitem(last=False)
        return self.incarnation

    def lease(self, replica_id: str, held: int, wanted: int, limit: int) -> int:
        """Records that ``replica_id`` holds ``held`` of the service's ``limit`` in-flight
        places and grants it up to ``wanted`` more; returns how many it granted. A replica
        that has not declared for ``STALE_AFTER_S`` holds none."""
        now = time.monotonic()
        self._places[replica_id] = (now, held)
        taken = sum(
            places for declared, places in self._places.values() if now - declared <= STALE_AFTER_S
        )
        granted = max(0, min(wanted, limit - taken))
        self._places[replica_id] = (now, held + granted)
        return granted

    def rows(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each replica's last row and how many seconds ago it came."""
        now = time.monotonic()
        return {replica: (now - pushed, row) for replica, (pushed, row) in self._rows.items()}

    def record(self, request_id: str) -> dict[str, Any] | None:
        return self._records.get(request_id)

    def latest(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records of every replica, newest first."""
        return list(reversed(self._records.values()))[: max(limit, 0)]


def board_for(app_name: str, num_recent_requests: int) -> Any:
    """The app's board: created by the first replica that asks, found by the others.

    Detached, so that it outlives any one replica; ``deploy.cluster.delete_app`` ends it.
    Its actor handle is returned as ``Any``: Ray's ``ActorHandle`` types every method
    attribute as ``Never``, which would make the code after each call unreachable."""
    # @ray.remote made ReplicaBoard an ActorClass; mypy keeps a decorated class's own type.
    return ReplicaBoard.options(  # type: ignore[attr-defined]  # an ActorClass: see above
        name=board_name(app_name), namespace="pdserve", get_if_exists=True, lifetime="detached"
    ).remote(num_recent_requests)


def board_name(app_name: str) -> str:
    return f"pdserve-gateway-board-{app_name}"


def merged_gateway_row(rows: dict[str, tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """One gateway row for the service from every replica's (age in seconds, row)."""
    present = []
    for age, row in rows.values():
        if age > STALE_AFTER_S:  # gone or hung: its counts stay, its "now" does not
            row = {**row, **{s.name: 0 for s in GATEWAY_STATS if s.kind is Kind.GAUGE}}
        present.append(row)
    return totals(GATEWAY_STATS, present)


class ReplicaShare:
    """One replica's side: pushes its figures, and reads the service's back."""

    def __init__(self, app_name: str, replica_id: str, num_recent_requests: int) -> None:
        self.replica_id = replica_id
        self._app_name = app_name
        self._num_recent_requests = num_recent_requests
        self._board = board_for(app_name, num_recent_requests)
        self._incarnation: str | None = None
        self._unpushed: list[dict[str, Any]] = []
        self._last_rows: dict[str, tuple[float, dict[str, Any]]] = {}
        self._task: asyncio.Task | None = None

    def finished(self, record_json: dict[str, Any]) -> None:
        self._unpushed.append(record_json)

    def start(
        self,
        read_row: Callable[[], dict[str, Any]],
        read_recent: Callable[[], list[dict[str, Any]]],
        each_push: Callable[[], Awaitable[None]],
    ) -> None:
        """Pushes ``read_row()`` and the new records every ``PUSH_INTERVAL_S``;
        ``read_recent()`` (this replica's recent records, oldest first) refills a new board;
        ``each_push()`` runs after each push (the admission's declaration)."""
        self._read_row = read_row
        self._read_recent = read_recent
        self._each_push = each_push
        self._task = asyncio.get_running_loop().create_task(  # not any request's child
            self._push_forever(), context=contextvars.Context()
        )

    async def push(self) -> None:
        records, self._unpushed = self._unpushed, []
        try:
            incarnation = await self._call("push", self.replica_id, self._read_row(), records)
        except BaseException:
            self._unpushed[:0] = records  # kept for the next push
            raise
        if self._incarnation is not None and incarnation != self._incarnation:
            logger.warning("the gateway replicas' board restarted: refilling it")
            await self._call("push", self.replica_id, self._read_row(), self._read_recent())
        self._incarnation = incarnation

    async def _call(self, method: str, *args: Any) -> Any:
        """One board call; a board killed for good is created again by name, once."""
        try:
            return await getattr(self._board, method).remote(*args)
        except RayActorError:
            self._board = board_for(self._app_name, self._num_recent_requests)
            return await getattr(self._board, method).remote(*args)

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.push()
                await self._each_push()
                await self._read_rows()  # every replica remembers the others' last rows
            except Exception as error:  # noqa: BLE001 — the board restarting: the next push retries
                logger.warning(
                    "gateway replica %s could not push its figures: %r", self.replica_id, error
                )
            await asyncio.sleep(PUSH_INTERVAL_S)

    async def service_row(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The merged gateway row, and each replica's own (``replica_id``, requests, in flight)."""
        await self.push()  # this replica's figures as of now
        rows = await self._read_rows()
        replicas = [
            {
                "replica_id": replica,
                "num_requests": row["num_requests"],
                "num_requests_in_flight": row["num_requests_in_flight"],
                "seconds_since_push": round(age, 3),
            }
            for replica, (age, row) in sorted(rows.items())
        ]
        return merged_gateway_row(rows), replicas

    async def _read_rows(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """The board's rows, and for a replica a restarted board does not know yet, the row
        last read (read every push, so a replica that never answered ``/stats`` has them)."""
        rows = await self._call("rows")
        for replica, (age, row) in self._last_rows.items():
            rows.setdefault(replica, (age + PUSH_INTERVAL_S, row))
        self._last_rows = dict(rows)
        return rows

    async def lease(self, held: int, wanted: int, limit: int) -> int:
        """``ReplicaBoard.lease`` for this replica."""
        granted: int = await self._call("lease", self.replica_id, held, wanted, limit)
        return granted

    async def record(self, request_id: str) -> dict[str, Any] | None:
        return await self._call("record", request_id)

    async def latest(self, limit: int) -> list[dict[str, Any]]:
        await self.push()
        return await self._call("latest", limit)
