"""The LoRA adapters an engine serves, and the few it holds in memory.

    registered   name → LoRAAdapterRef (path, digest): what a request may name. Filled by
                 ``lora_modules``, the admin's loads, and a request that brings the path of
                 an adapter this engine lacks (``load_on_demand``: a decode worker that
                 joined after the load, a restarted one).
    resident     digest → LoRAAdapter, at most ``max_loras``, least recently used first.

A request for a registered adapter that is not resident reads it again from its path; room
is made by evicting the least recently used resident adapter that no request runs (none
idle: the request is refused, as the engine cannot run more than ``max_loras`` at once).
Residents are keyed by weights, not names: an adapter unloaded while requests run it stays
in memory until they end, and its name may meanwhile be registered again over other files
without either request seeing the other's weights.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from torch import nn

from pdserve.messages.lora_adapters import LoRAAdapterRef, LoRAAdapterReport
from pdserve.model.lora import lora_kernel
from pdserve.model.lora.peft_adapter import LoRAAdapter


class LoRARegistry:
    """An engine's adapters (module doc); every method runs on the engine's thread."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        load_on_demand: bool,
        digests_in_use: Callable[[], set[str]],
    ) -> None:
        """``digests_in_use``: the adapters the engine's live requests run (never evicted)."""
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.load_on_demand = load_on_demand
        self.digests_in_use = digests_in_use
        self.registered: dict[str, LoRAAdapterRef] = {}
        self.resident: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.generation = 0
        self.requests_by_name: Counter[str] = Counter()  # requests that named each adapter

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter in folder ``path``, read and checked against the model (no state
        changes: safe off the engine thread). The first read on a CPU also builds (or loads)
        the kernel its steps run there, so that no step waits for the compiler."""
        adapter = LoRAAdapter.load(name, path, self.model, self.max_rank)
        parts = next(iter(adapter.sites.values()), ())
        if parts and parts[0].a.is_cpu:
            lora_kernel.build()
        return adapter

    def load(self, name: str, path: str) -> LoRAAdapterRef:
        """Reads and registers the adapter in ``path`` as ``name``."""
        self._refuse_registered(name)
        return self.register(self.read(name, path), path)

    def register(self, adapter: LoRAAdapter, path: str) -> LoRAAdapterRef:
        """Registers an adapter already read; resident when there is room (else it is read
        again at its first request). A name registered already is refused: unload it first."""
        self._refuse_registered(adapter.name)
        ref = LoRAAdapterRef(adapter.name, path, adapter.digest)
        self.registered[adapter.name] = ref
        self.generation += 1
        if adapter.digest in self.resident:  # the same files, still held for its requests
            self.resident.move_to_end(adapter.digest)
        elif self._room_for_one():
            self.resident[adapter.digest] = adapter
        return ref

    def unload(self, name: str) -> bool:
        """Unregisters ``name`` (False: it was not registered); its weights leave memory
        now, or at an eviction once the requests running them end."""
        ref = self.registered.pop(name, None)
        if ref is None:
            return False
        self.generation += 1
        if ref.digest not in self.digests_in_use():
            self.resident.pop(ref.digest, None)
        return True

    def for_request(self, name: str, path: str | None = None) -> LoRAAdapter:
        """The adapter a new request runs, resident and most recently used; read from its
        registered path, or from ``path`` where the engine lacks it and may load on demand.
        Raises ``ValueError`` naming the adapter where it cannot (and changes nothing)."""
        ref = self.registered.get(name)
        if ref is not None and ref.digest in self.resident:
            self.resident.move_to_end(ref.digest)  # the order is not reported: no new generation
            self.requests_by_name[name] += 1
            return self.resident[ref.digest]
        if ref is not None:
            folder = ref.path
        elif path is not None and self.load_on_demand:
            folder = path
        else:
            why = "" if path is None else " (and this worker does not load adapters on demand)"
            raise ValueError(
                f"unknown LoRA adapter {name!r}; this worker serves {self.names()}{why}"
            )
        adapter = self.read(name, folder)
        if adapter.digest not in self.resident and not self._room_for_one():
            raise ValueError(
                f"LoRA adapter {name!r} cannot be loaded now: all {self.max_loras} adapters "
                f"in memory (max_loras) run requests; retry when one of them ends"
            )
        # Registered anew, or over what its files hold now (they may have changed on disk).
        self.registered[name] = LoRAAdapterRef(name, folder, adapter.digest)
        self.resident[adapter.digest] = adapter
        self.generation += 1
        self.requests_by_name[name] += 1
        return adapter

    def names(self) -> list[str]:
        return sorted(self.registered)

    def report(self, instance_id: str) -> LoRAAdapterReport:
        """What a gateway routes by; a new object each time (read it on the engine thread)."""
        resident_names = [a.name for a in self.resident.values()]
        return LoRAAdapterReport(
            instance_id, list(self.registered.values()), resident_names, self.generation
        )

    def _refuse_registered(self, name: str) -> None:
        if name in self.registered:
            raise ValueError(f"LoRA adapter {name!r} is loaded already; unload it first")

    def _room_for_one(self) -> bool:
        """Makes room for one more resident adapter by evicting the least recently used
        idle one; False when every resident adapter runs requests."""
        if len(self.resident) < self.max_loras:
            return True
        in_use = self.digests_in_use()
        idle = next((digest for digest in self.resident if digest not in in_use), None)
        if idle is None:
            return False
        del self.resident[idle]
        return True
