"""``PrefillWorker``: computes prompts, samples the first token, leases the KV for decode."""

from __future__ import annotations

from pdserve.engine.engine_host import EngineHost
from pdserve.engine.messages import WorkerSpec


class PrefillWorker(EngineHost):
    """A Ray actor hosting a producer-side engine.

    The gateway sends it each request with ``max_tokens=1`` and ``remote_decode=True``; its
    connector leases the prompt's blocks when the request finishes by length, and the last
    chunk carries the ``KVTransferParams`` the decode worker pulls with. In a colocated
    deployment (no decode workers) its spec has no connector and it runs whole requests
    with role ``both``.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.role not in ("producer", "both"):
            raise ValueError(f"a PrefillWorker runs the producer side (or both), "
                             f"but {spec.worker_id!r} has role {spec.role!r}")
        super().__init__(spec)
