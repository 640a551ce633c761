"""Fits a simulated engine's timing profile (``checkpoint/sim_profiles.py``) to a real
model's forwards on this machine, and writes it where ``--model sim:<name>`` finds it.

The real engine serves a mixed workload (prompts of 16 to 512 tokens, batches of 1 to 16,
prefill chunks beside decode rows) while every forward of its model (``forward`` and
``compute_logits``, what the simulated model stands in for) is timed with its tokens and
the KV tokens it reads; least squares then gives

    seconds = step_s + token_s * tokens + log_token_s * ln(tokens) + kv_token_s * kv_tokens

and the fit's error over the timed forwards is printed (median and 90th percentile of the
relative error). The runner's own overhead is not in the profile: the simulated engine runs
the real runner.

Run: python bench/fit_sim_profile.py --model tiny --name tiny-cpu   (≈ 1 minute)
     python bench/fit_sim_profile.py --model smollm2 --name smollm2-cpu   (≈ 3 minutes)
     python bench/fit_sim_profile.py --model tiny --out my-cpu.json   (serve sim:my-cpu.json)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.checkpoint.sim_profiles import PROFILE_DIR
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams

GRPC_PULL_MIB_PER_S = 900.0
"""The hand-off's rate a fitted profile gets unless told: the gRPC transport's pull rate on
these 2-core machines (``bench/bench_transfer.py``: 750-1,390 MiB/s)."""

WORKLOAD = [
    (1, 16, 0),
    (1, 512, 0),
    (4, 128, 0),
    (8, 64, 0),
    (16, 16, 0),
    (16, 128, 0),
    (4, 512, 0),
    (1, 384, 384),
    (4, 448, 384),
    (1, 640, 384),
    (8, 400, 384),
]
"""(requests, prompt tokens, tokens of a shared prefix) of each round; every request decodes
24 tokens. The prefix is the pass's own: its first round computes it, the later ones hit it
and compute only their own tokens over it (a service's common case: a shared system prompt,
a conversation's earlier turns), so the fit sees tokens and KV read vary apart."""


def timed_forwards(engine: LLMEngine, pass_index: int) -> list[tuple[int, int, float]]:
    """(tokens, KV tokens read, seconds) of every forward while ``engine`` serves the
    workload; ``pass_index`` makes every prompt new, so no pass hits an earlier one's."""
    model = engine.runner.model
    forward, logits = model.forward, model.compute_logits
    samples: list[tuple[int, int, float]] = []
    began: list[float] = []

    def timed_forward(input_ids, positions, kv_cache, metadata):
        began.append(time.perf_counter())
        samples.append((input_ids.shape[0], int(positions.sum()) + positions.shape[0], 0.0))
        return forward(input_ids, positions, kv_cache, metadata)

    def timed_logits(hidden):
        out = logits(hidden)
        if out.is_cuda:  # the kernels launched, not done: wait for them
            torch.cuda.synchronize(out.device)
        tokens, kv_tokens, _ = samples[-1]
        samples[-1] = (tokens, kv_tokens, time.perf_counter() - began[-1])
        return out

    model.forward, model.compute_logits = timed_forward, timed_logits
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    vocab = min(engine.model_config.vocab_size, 4000)

    def tokens(seed: int, length: int) -> list[int]:
        return np.random.default_rng(seed).integers(1, vocab, length).tolist()

    for round_index, (requests, length, shared) in enumerate(WORKLOAD):
        prefix = tokens(pass_index * 104729, shared)
        prompts = [
            prefix + tokens(pass_index * 104729 + round_index * 131 + i + 1, length - shared)
            for i in range(requests)
        ]
        engine.generate(prompts, params)
    model.forward, model.compute_logits = forward, logits
    return samples


def fit(samples: list[tuple[int, int, float]]) -> tuple[list[float], str]:
    """The least-squares coefficients and a line on how well they fit."""
    rows = np.array([[1.0, tokens, np.log(tokens), kv] for tokens, kv, _ in samples])
    seconds = np.array([s for _, _, s in samples])
    # Relative errors, not seconds: a prompt's long forwards would outweigh the decode steps
    # that make up most of a service's time.
    weights = 1.0 / seconds
    coefficients, *_ = np.linalg.lstsq(rows * weights[:, None], seconds * weights, rcond=None)
    coefficients = np.maximum(coefficients, 0.0)  # no negative cost (noise on a small term)
    errors = np.abs(rows @ coefficients - seconds) / seconds
    summary = (
        f"{len(samples)} forwards, relative error median {100 * np.median(errors):.1f} %, "
        f"p90 {100 * np.percentile(errors, 90):.1f} %"
    )
    return [float(c) for c in coefficients], summary


def fitted_profile(model: str, torch_threads: int, machine: str, transfer_mib_per_s: float) -> dict:
    """The profile (a ``checkpoint/sim_profiles/`` file's fields) of ``model`` fitted on this
    machine now."""
    engine = LLMEngine.from_pretrained(
        model, num_kv_blocks=1024, max_num_seqs=16, torch_threads=torch_threads
    )
    timed_forwards(engine, 0)  # warm-up: first-use costs out of the fit
    (step_s, token_s, log_token_s, kv_token_s), summary = fit(timed_forwards(engine, 1))
    measured = (
        f"{time.strftime('%Y-%m-%d')}, {machine}, {torch_threads} torch thread(s), "
        f"bench/fit_sim_profile.py over {model}: {summary}; transfer_bytes_per_s: "
        f"--transfer-mib-per-s {transfer_mib_per_s:g}"
    )
    return {
        "stands_for": model,
        "device": engine.runner.device.type,
        "step_s": step_s,
        "token_s": token_s,
        "log_token_s": log_token_s,
        "kv_token_s": kv_token_s,
        "transfer_bytes_per_s": transfer_mib_per_s * 2**20,
        "measured": measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the real model to profile")
    parser.add_argument("--name", help="the profile's name (sim:<name>), a shipped one")
    parser.add_argument("--out", type=Path, help="or a file of one's own (sim:<out>)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--machine", default=platform.machine(), help="as the profile says")
    parser.add_argument(
        "--transfer-mib-per-s",
        type=float,
        default=GRPC_PULL_MIB_PER_S,
        help="the hand-off's rate (bench/bench_transfer.py measures the transports')",
    )
    args = parser.parse_args()
    if (args.name is None) == (args.out is None):
        parser.error("give one of --name and --out")
    path = args.out or PROFILE_DIR / f"{args.name}.json"
    profile = fitted_profile(args.model, args.torch_threads, args.machine, args.transfer_mib_per_s)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"{path}: {json.dumps(profile)}")


if __name__ == "__main__":
    main()
