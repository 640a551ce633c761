"""What one worker is: the deployer decides it, the worker's actor is built from it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_tier_config import KVTierConfig


@dataclass(slots=True)
class WorkerSpec:
    """What one worker is, decided by the deployer and handed to the worker's actor.

    The worker needs no deployment-wide config: its engine settings, its connector side (or
    none: a colocated worker, role ``both``) and the name it is served under are all here.
    Some values are only known inside the actor and are filled in there:

    - ``engine.engine_id`` gets the worker's instance id appended, so a restarted worker is
      a new KV peer;
    - ``engine.device == "auto"`` becomes ``cuda`` when the actor got a GPU, else ``cpu``;
    - ``advertise_node_address``: the connector's ``host`` is replaced by the address of
      the Ray node the worker runs on: a prefill worker's KV service binds and advertises
      it, and a NIXL worker's UCX data path uses that node's interface.

    ``kv_tier``: a KV tier below the worker's block pool (None: the pool is the only tier).
    ``cpus``: CPU ids the worker's process is pinned to (``os.sched_setaffinity``), so that
    prefill and decode workers on one node do not take each other's cores (None: unpinned).
    ``hung_step_s``: an engine step running longer than this fails the worker's health
    check, and Serve restarts it (the gateway's ``hung_step_s``).
    """

    worker_id: str
    engine: EngineConfig
    connector: KVConnectorConfig | None = None
    advertise_node_address: bool = False
    kv_tier: KVTierConfig | None = None
    cpus: tuple[int, ...] | None = None
    hung_step_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("a worker needs a non-empty worker_id")
        if self.cpus is not None and (not self.cpus or min(self.cpus) < 0):
            raise ValueError(f"cpus must name at least one CPU id >= 0, got {self.cpus}")

    @property
    def role(self) -> str:
        """``producer`` (prefill), ``consumer`` (decode) or ``both`` (colocated)."""
        return self.connector.role if self.connector is not None else "both"
