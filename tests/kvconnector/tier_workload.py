"""The workload of the KV tier tests: four system prompts taking turns in a pool that holds
one of them, so every prompt is computed in full unless a tier brings the prefix back."""

from __future__ import annotations

import random

from pdserve.engine import SamplingParams

BLOCK_SIZE = 16
PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
NUM_SYSTEMS, SYSTEM_TOKENS, QUESTION_TOKENS, NUM_REQUESTS = 4, 96, 8, 12
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def workload() -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(1, 500) for _ in range(SYSTEM_TOKENS)] for _ in range(NUM_SYSTEMS)]
    return [
        systems[i % NUM_SYSTEMS] + [rng.randrange(1, 500) for _ in range(QUESTION_TOKENS)]
        for i in range(NUM_REQUESTS)
    ]
