"""LoRA adapters as workers report them and requests name them: by name, path and weights."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRAAdapterRef:
    """A registered adapter: the name requests use, the PEFT folder it was read from, and
    the digest of its config and tensors (``model/lora/peft_adapter.py``), which keys its
    blocks. A worker that lacks the adapter reads it from ``path`` (when it may)."""

    name: str
    path: str
    digest: str


@dataclass(slots=True)
class LoRAAdapterReport:
    """A worker's adapters: those requests may name, those in memory (names), and a counter
    that grows with every load and unload of the worker instance ``instance_id``, so a
    reader keeps the newest of two reports."""

    instance_id: str = ""
    registered: list[LoRAAdapterRef] = field(default_factory=list)
    resident: list[str] = field(default_factory=list)
    generation: int = 0
