"""Can the connected Ray cluster host this app? Checked before deploying, not discovered by
waiting.

Every part of an app (the gateway, each worker) asks Ray for resources: CPUs, GPUs and the
custom resources of its role (``prefill_resources``, ...; a node offers them with
``ray start --resources '{"prefill_node": 1}'``). Serve waits forever for a replica that no
node can host, so ``pdserve up`` refuses such an app first, naming the part, what it asks for
and what each node offers:

    demand  prefill-0: {CPU: 0, node_b: 1}
    nodes   127.0.0.5 {CPU: 2, head: 1}   127.0.0.3 {CPU: 2, node_c: 1}   → PlacementError

Two necessary conditions are checked: each part fits on one alive node's totals, and the
parts together do not ask more of a resource than the cluster has. Both hold whenever Ray can
place the app; a packing that passes them and still does not fit (rare with whole custom
resources) is left to Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class PlacementError(ValueError):
    """No node, or not the whole cluster, can host a part of the app."""


def resource_demand(actor_options: Mapping[str, Any]) -> dict[str, float]:
    """What one replica asks Ray for, under Ray's own resource names."""
    demand = {
        "CPU": float(actor_options.get("num_cpus", 0) or 0),
        "GPU": float(actor_options.get("num_gpus", 0) or 0),
    }
    demand.update(actor_options.get("resources", {}))
    return {name: amount for name, amount in demand.items() if amount > 0}


def check_placement(
    demands: Mapping[str, Mapping[str, float]], nodes: Sequence[Mapping[str, Any]]
) -> None:
    """Raises ``PlacementError`` when a part cannot be placed; ``demands`` by part name,
    ``nodes`` as ``ray.nodes()`` lists them."""
    alive = [node for node in nodes if node.get("Alive")]
    offers = {node["NodeManagerAddress"]: node.get("Resources", {}) for node in alive}
    shown = "; ".join(f"{address} {_short(offer)}" for address, offer in offers.items())
    for part, demand in demands.items():
        if not any(_fits(demand, offer) for offer in offers.values()):
            raise PlacementError(
                f"no node can host {part}: it asks for {_short(demand)}, the alive nodes offer "
                f"{shown or 'nothing'}. Start a node with the missing resources (ray start "
                f"--resources '{{\"NAME\": 1}}') or change the app's *_resources"
            )
    for name in {name for demand in demands.values() for name in demand}:
        wanted = sum(demand.get(name, 0.0) for demand in demands.values())
        available = sum(offer.get(name, 0.0) for offer in offers.values())
        if wanted > available:
            users = sorted(part for part, demand in demands.items() if name in demand)
            raise PlacementError(
                f"the app asks for {wanted:g} {name} in all ({', '.join(users)}), the cluster "
                f"has {available:g}: {shown}"
            )


def _fits(demand: Mapping[str, float], offer: Mapping[str, float]) -> bool:
    return all(offer.get(name, 0.0) >= amount for name, amount in demand.items())


def _short(resources: Mapping[str, float]) -> str:
    """Resources without Ray's bookkeeping entries (memory, node:IP, ...)."""
    kept = {
        name: amount
        for name, amount in sorted(resources.items())
        if not name.startswith("node:") and name not in ("memory", "object_store_memory")
    }
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in kept.items()) + "}"
