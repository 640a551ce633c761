"""Timing profiles of the simulated engine (``--model sim:<profile>``): how long a real
model's forward takes for a step, so that a service of simulated workers behaves in time
like one of real ones, with no weights and no arithmetic.

A profile stands for a real model (``stands_for``: its tokenizer, its vocabulary, its KV
layout, which sizes each worker's KV capacity) and models the forward of a step as

    seconds = step_s + token_s * tokens + log_token_s * ln(tokens) + kv_token_s * KV tokens

over the tokens a step computes, where its KV tokens read are the sum over its tokens of
their positions + 1 (a decode row reads its whole context; a prompt chunk's causal attention
reads a triangle); a hand-off moves the real pages' bytes at ``transfer_bytes_per_s``.
The logarithm is batching's economy: sixteen decode rows cost about three times one, not
sixteen (without it, fitted on a mixed workload, a prompt's forward was off by a median
21 %; with it, 8 %). Profiles are fitted by least squares from timed forwards of the real
model (``bench/fit_sim_profile.py`` writes them here, one JSON file each, saying where and
how they were measured).

A CPU profile holds for the machine it was fitted on: the same ``tiny`` decode step took
0.75 ms on the 2-core AMD machine ``tiny-cpu`` was first fitted on and 1.7 ms on a 2-core
Intel Xeon two days later. ``sim:<path>.json`` names a profile file of one's own, so a
profile fitted on the machine at hand (``bench/fit_sim_profile.py --out``) serves without
touching the shipped ones.

Time dilation (``EngineConfig.sim_time_scale``): a simulated cluster shares one host's
cores, and what every worker, the gateway and the proxy spend on the host per token and per
request is real time no profile counts. On a few cores, at dozens of workers, that cost
queues and inflates every latency. Slowing the simulated clock k times (every forward and
hand-off k times as long), with arrivals k times as sparse and the latency targets and the
autoscaler's windows k times as long, leaves the simulated cluster's behaviour the same and
divides the host's share of each latency, and its load, by k (a ``cpu`` profile's forward,
host work like the rest, spends its undilated time on a core and waits out the rest): the
network emulators' time dilation (DieCast, NSDI 2008), and the mirror of Dynamo's mocker
``speedup_ratio``. What stays on the real clock is the worker's start-up, so a dilated
scale-up lands k times sooner in simulated time than it would undilated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Literal, get_args

SIM_PREFIX = "sim:"
PROFILE_DIR = Path(__file__).with_name("sim_profiles")
ProfiledDevice = Literal["cpu", "cuda"]
PROFILED_DEVICES: tuple[str, ...] = get_args(ProfiledDevice)


@dataclass(frozen=True, slots=True)
class SimProfile:
    """One profile (module doc)."""

    name: str
    stands_for: str
    """The real model's ``--model`` name (its tokenizer, vocabulary and KV layout)."""
    device: ProfiledDevice
    """Where the real model's forwards were timed. A ``cpu`` profile's forward spends the
    time on a host core, as its real one would (``model/sim_model.py``); a ``cuda`` one's
    waits, its host idle."""
    step_s: float
    token_s: float
    log_token_s: float
    kv_token_s: float
    transfer_bytes_per_s: float
    """The hand-off's rate for the real model's pages (``model/sim_transfer.py``)."""
    measured: str
    """Where and how the coefficients were measured."""

    def __post_init__(self) -> None:
        if self.device not in PROFILED_DEVICES:
            raise ValueError(
                f"simulated model '{SIM_PREFIX}{self.name}': device must be one of "
                f"{', '.join(PROFILED_DEVICES)}, got {self.device!r}"
            )

    def forward_seconds(self, num_tokens: int, num_kv_tokens: int) -> float:
        return (
            self.step_s
            + self.token_s * num_tokens
            + self.log_token_s * math.log(num_tokens)
            + self.kv_token_s * num_kv_tokens
        )

    def slowed(self, time_scale: float) -> SimProfile:
        """This profile with every duration ``time_scale`` times as long: its forwards and
        its hand-offs (``EngineConfig.sim_time_scale``, module doc)."""
        if time_scale == 1.0:
            return self
        return replace(
            self,
            step_s=self.step_s * time_scale,
            token_s=self.token_s * time_scale,
            log_token_s=self.log_token_s * time_scale,
            kv_token_s=self.kv_token_s * time_scale,
            transfer_bytes_per_s=self.transfer_bytes_per_s / time_scale,
        )

    @classmethod
    def load(cls, name: str) -> SimProfile:
        """The profile ``name``: a file of ``PROFILE_DIR``, or ``<path>.json`` a file of
        one's own (module doc); ``FileNotFoundError`` naming those of ``PROFILE_DIR``."""
        path = Path(name) if name.endswith(".json") else PROFILE_DIR / f"{name}.json"
        if not path.is_file():
            known = ", ".join(repr(f"{SIM_PREFIX}{n}") for n in profile_names())
            raise FileNotFoundError(
                f"simulated model '{SIM_PREFIX}{name}' has no profile; the profiles are "
                f"{known}, or sim:<path>.json for a profile file"
            )
        given = json.loads(path.read_text())
        wanted = [field.name for field in fields(cls) if field.name != "name"]
        if not isinstance(given, dict) or sorted(given) != sorted(wanted):
            raise ValueError(
                f"simulated model '{SIM_PREFIX}{name}': {path} must hold one JSON object of "
                f"the fields {', '.join(wanted)}; it holds "
                f"{', '.join(given) if isinstance(given, dict) else type(given).__name__}"
            )
        return cls(name=path.stem, **given)


def profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.json"))
