"""How long a simulated worker's hand-off takes: the real model's pages at the profile's
bandwidth (``checkpoint/sim_profiles.py``), where the placeholder pages themselves move in
microseconds.

The decode side pulls the placeholder pages as it would real ones (the same transport,
leases, checksums and counters), then waits out the rest of the time the real pages' bytes
would have taken at ``transfer_bytes_per_s``; the prefill side decides whether a hand-off
carries its tail pages inline by the real pages' bytes, as it would with the real model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import sleep

from pdserve.checkpoint.model_source import resolve_model
from pdserve.messages.engine_config import EngineConfig
from pdserve.model.loader import check_model
from pdserve.model.model_config import resolve_dtype


@dataclass(frozen=True, slots=True)
class SimulatedTransfer:
    page_bytes: int
    """One block's KV bytes in the real model: every layer's K and V of its tokens."""
    bytes_per_s: float

    def wait_out(self, num_blocks: int, spent_s: float) -> float:
        """Sleeps what is left of ``num_blocks`` real pages' transfer after ``spent_s``;
        returns the transfer's simulated duration."""
        seconds = num_blocks * self.page_bytes / self.bytes_per_s
        sleep(max(0.0, seconds - spent_s))
        return max(seconds, spent_s)


def simulated_transfer(engine: EngineConfig) -> SimulatedTransfer | None:
    """The transfer time model of ``engine``'s simulated model; None for a real model."""
    profile = resolve_model(engine.model).profile
    if profile is None:
        return None
    real = check_model(profile.stands_for)
    token_bytes = (
        math.prod(real.kv_token_shape) * resolve_dtype(engine.resolved_kv_cache_dtype).itemsize
    )
    return SimulatedTransfer(
        real.num_layers * engine.block_size * token_bytes,
        profile.slowed(engine.sim_time_scale).transfer_bytes_per_s,
    )
