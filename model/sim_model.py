"""The simulated engine's model (``--model sim:<profile>``): a forward that takes the time
the profiled real model's would, computes nothing, and names deterministic tokens.

Everything else of the engine is the real one: the runner (its step metadata, its Python
overhead), the scheduler, the KV ledger and its prefix cache, the connector and the
hand-off, the router and the gateway. So a simulated service answers in the time a real one
would, and where its requests went (routing, cache hits, transfers) is what the real one's
counters would say, on one machine, at any number of workers:

    real model                         simulated (``SimulatedCausalLM``)
    weights                            none
    forward                            takes ``profile.forward_seconds(tokens, KV read)``:
                                       a ``cpu`` profile's spends it on a host core, a
                                       ``cuda`` one's sleeps
    next token                         (token * 1103515245 + position * 12345 + 1) mod vocab,
                                       the stand-in's end-of-sequence ids skipped
    KV pages                           placeholders: one layer of one head of 8 values, the
                                       real model's layout fingerprinted as its own
    KV capacity                        the real model's for the same memory budget

Why a CPU profile's forward spends CPU: its real forward occupies a core (one torch thread)
that the host's other workers, the gateway and Ray also need. A simulated forward that slept
would leave the core to them, and a service of simulated workers sharing a few cores would
answer sooner than the real one (the inter-token gap 0.68x the real one's at 1 + 1 on two
cores, ``bench/bench_sim_vs_real.py``). It hashes a buffer (``hashlib`` lets the GIL go, as
a torch kernel does, so the worker's other threads run beside it) until its thread has spent
the profile's seconds, so the core it takes and the preemption it suffers are the real
forward's. Under a dilated clock (``sim_time_scale`` k) it spends the undilated seconds and
waits out the rest of k times them: the host's share of a forward, as of everything else on
the host, is 1/k.

The logits are one-hot (a 30-nat margin), so greedy and seeded sampling both pick the named
token: a prompt's tokens fix its whole reply, on any worker, before or after a hand-off.
"""

from __future__ import annotations

import dataclasses
import hashlib
from time import perf_counter, sleep, thread_time

import torch
from torch import nn

from pdserve.checkpoint.sim_profiles import SimProfile
from pdserve.model.model_config import ModelConfig

_LOGIT = 30.0
_PLACEHOLDER_HEAD_DIM = 8
# What a forward of a CPU profile hashes at a time: large enough that hashlib releases the
# GIL (2 KiB and up), small enough (about 10 us) that the forward ends on time.
_SPENT_BUFFER = bytes(16 << 10)


class SimulatedCausalLM(nn.Module):
    """The model of a simulated engine (module doc)."""

    def __init__(self, profile: SimProfile, stands_for: ModelConfig, time_scale: float) -> None:
        super().__init__()
        self.profile = profile
        self.dilated = profile.slowed(time_scale)
        """The profile on the engine's clock (``EngineConfig.sim_time_scale``): how long a
        forward takes."""
        self.stands_for = stands_for
        self.vocab_size = stands_for.vocab_size
        self._end_ids = torch.tensor(sorted(set(stands_for.eos_token_ids)), dtype=torch.long)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: object,
        metadata: object,
    ) -> torch.Tensor:
        """Takes the profiled forward of these tokens (module doc); the "hidden state" of
        each is its token id and position, which ``compute_logits`` turns into the next
        token."""
        began = perf_counter()
        num_tokens = input_ids.shape[0]
        num_kv_tokens = int(positions.sum()) + num_tokens  # positions + 1 each
        hidden = torch.stack((input_ids.long(), positions.long()), dim=1)
        if self.profile.device == "cpu":
            spend_cpu(self.profile.forward_seconds(num_tokens, num_kv_tokens))
        seconds = self.dilated.forward_seconds(num_tokens, num_kv_tokens)
        sleep(max(0.0, began + seconds - perf_counter()))
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = next_tokens(hidden[:, 0], hidden[:, 1], self.vocab_size, self._end_ids)
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), tokens] = _LOGIT
        return logits


def spend_cpu(seconds: float) -> None:
    """Occupies a core until this thread has run for ``seconds`` (module doc)."""
    until = thread_time() + seconds
    while thread_time() < until:
        hashlib.sha256(_SPENT_BUFFER)


def next_tokens(
    tokens: torch.Tensor, positions: torch.Tensor, vocab_size: int, end_ids: torch.Tensor
) -> torch.Tensor:
    """The token a simulated model names after ``tokens`` at ``positions`` (module doc)."""
    named = (tokens * 1103515245 + positions * 12345 + 1) % vocab_size
    ends = torch.isin(named, end_ids)
    return torch.where(ends, (named + 1) % vocab_size, named)


def placeholder_config(stands_for: ModelConfig, profile: SimProfile) -> ModelConfig:
    """The KV layout a simulated engine allocates: one layer of one KV head of 8 values a
    token, full attention, fingerprinted by the profile (a simulated worker pairs only with
    another of the same profile)."""
    return dataclasses.replace(
        stands_for,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=_PLACEHOLDER_HEAD_DIM,
        sliding_window=None,
        full_attention_layers=(),
        mla=None,
        moe=None,
        rope_scaling=None,
        quantization="none",
        weights_digest=f"sim:{profile.name}:{stands_for.weights_digest}",
    )


def capacity_config(model: nn.Module, model_config: ModelConfig) -> ModelConfig:
    """The config whose pages an engine's KV memory budget counts: a simulated model's real
    one (its placeholder pages would make the pool hundreds of times too large)."""
    return model.stands_for if isinstance(model, SimulatedCausalLM) else model_config
