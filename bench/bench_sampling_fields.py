"""What vLLM's sampling fields cost a decode step: ``smollm2`` at batch 16, every request
with penalties (presence, frequency, repetition) and a ``logit_bias`` of 20 ids, against
the same requests without, one engine, runs alternating, one torch thread.

Printed: generated tokens per second of each (median of ``--repeats``) and their ratio
(aim from issue 53: the fields cost at most 5 %, a ratio >= 0.95).

Measured (2026-12-05, this 2-core box, one thread, 48 new tokens, 5 repeats)::

    batch 16: plain  142.2 tok/s  with the fields  138.1 tok/s  ratio 0.971

Met (2.9 %). The first version applied the penalties densely over ``[rows, vocab]``: 0.914
(11 ms a step); they now touch only the ids each request has seen (``token_counts.py``).

Run: python bench/bench_sampling_fields.py   (≈ 2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams

BATCH = 16


def tokens_per_second(engine: LLMEngine, params: SamplingParams) -> float:
    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(BATCH)]
    started = time.perf_counter()
    engine.generate(prompts, params)
    return BATCH * params.max_tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained("smollm2", num_kv_blocks=256, block_size=16)
    plain = SamplingParams(max_tokens=args.new_tokens, temperature=0.8, seed=1, ignore_eos=True)
    fields = dataclasses.replace(
        plain,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias=dict.fromkeys(range(100, 120), 1.0),
    )
    tokens_per_second(engine, plain)  # warm-up
    speeds: dict[str, list[float]] = {"plain": [], "fields": []}
    for _ in range(args.repeats):
        speeds["plain"].append(tokens_per_second(engine, plain))
        speeds["fields"].append(tokens_per_second(engine, fields))
    plain_speed, fields_speed = (statistics.median(speeds[k]) for k in ("plain", "fields"))
    print(
        f"batch {BATCH}: plain {plain_speed:6.1f} tok/s  with the fields {fields_speed:6.1f} tok/s"
        f"  ratio {fields_speed / plain_speed:.3f}"
    )


if __name__ == "__main__":
    main()
