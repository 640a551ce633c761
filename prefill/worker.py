"""``PrefillWorker``: computes prompts, samples the first token, leases the KV for decode."""

from __future__ import annotations

from pdserve.deploy.config import PDServeConfig
from pdserve.prefill.engine_host import EngineHost


class PrefillWorker(EngineHost):
    """A Ray actor hosting a producer-side engine.

    The gateway sends it each request with ``max_tokens=1`` and ``remote_decode=True``; its
    connector leases the prompt's blocks when the request finishes by length, and the last
    chunk carries the ``KVTransferParams`` the decode worker pulls with. In a colocated
    deployment (no decode workers) it runs whole requests with role ``both``.
    """

    def __init__(self, config: PDServeConfig | dict, worker_id: str) -> None:
        colocated = config["num_decode"] == 0 if isinstance(config, dict) else config.colocated
        self.role = "both" if colocated else "producer"
        super().__init__(config, worker_id)
