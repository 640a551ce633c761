"""``PrefillWorker``: computes prompts, samples the first token, leases the KV for decode."""

from __future__ import annotations

from pdserve.messages.worker_spec import WorkerSpec
from pdserve.worker.engine_host import EngineHost


class PrefillWorker(EngineHost):
    """A Ray actor hosting a producer-side engine.

    The gateway sends it each request with ``max_tokens=1`` and ``remote_decode=True``; its
    connector (``PDConnector``, producer side) leases the prompt's blocks when the request
    finishes by length, and the last chunk carries the ``KVTransferParams`` the decode
    worker pulls with. Its KV transfer service listens where decode workers can reach it:
    the configured host, else the address of the Ray node it runs on
    (``advertise_node_address``). In a colocated deployment (no decode workers) its spec has
    no connector and it runs whole requests with role ``both``. A ``kv_tier`` in its spec
    adds the tier connector (alone when colocated).
    """

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role not in ("producer", "both"):
            raise ValueError(
                f"a PrefillWorker runs the producer side (or both), "
                f"but {spec.worker_id!r} has role {spec.role!r}"
            )
        super().__init__(spec)

    def kv_transfer_address(self) -> str | None:
        """Where decode workers pull this worker's leased blocks (None: colocated)."""
        connector = self.pd_connector
        return connector.address if connector is not None else None
