"""A worker's KV events, read by the gateway's router by sequence number."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cache import HeldBlocks, KVCacheEvent
from pdserve.messages.lora_adapters import LoRAAdapterReport


@dataclass(slots=True)
class KVEventBatch:
    """A worker's KV events from sequence number ``first_seq`` up to ``next_seq``.

    ``instance_id`` changes whenever the worker (re)starts: the router then drops everything
    it knew about the old instance. When the worker's bounded log no longer reaches back to
    the asked sequence number, ``snapshot`` carries every block hash the worker holds (per KV cache group) and
    ``events`` start after it.
    """

    worker_id: str
    instance_id: str
    first_seq: int
    next_seq: int
    events: list[KVCacheEvent] = field(default_factory=list)
    snapshot: HeldBlocks | None = None
    engine_step_s: float = 0.0
    """How long the worker's engine had been inside its current step when it answered (0
    between steps): the poll's heartbeat, which tells a busy worker from a hung one."""
    lora: LoRAAdapterReport = field(default_factory=LoRAAdapterReport)
    """The worker's LoRA adapters: which the gateway serves and routes by."""
