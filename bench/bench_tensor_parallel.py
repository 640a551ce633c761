"""Prefill time of a 2k-token prompt at tensor-parallel degree 1 against degree 2, side by
side in one process (each degree's engine alive throughout, the runs interleaved).

The model is ``bench_mla.py``'s GQA one (random, saved by transformers: hidden 1024, 16 query
heads sharing 4 KV heads of 64, 8 layers), so each rank of TP=2 holds 8 query heads, 2 KV
heads and half of every MLP. Each rank runs one torch thread. A figure, not an aim: on a
2-core box the two ranks share the machine with the client, and a step's collectives (two
all-reduces per layer over loopback gloo, one gather of the logits) are paid on CPU; on
GPUs the same split halves each rank's weights and FLOPs.

Run: python bench/bench_tensor_parallel.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench_mla import MODELS, WIDTH, save

from pdserve.engine import LLMEngine, SamplingParams

PROMPT_TOKENS = 2048
ROUNDS = 4
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def engine(model: str, tensor_parallel_size: int) -> LLMEngine:
    """An engine that prefills the whole prompt in one step, with no prefix cache to hit."""
    return LLMEngine.from_pretrained(
        model,
        block_size=16,
        num_kv_blocks=PROMPT_TOKENS // 16 + 8,
        max_num_batched_tokens=PROMPT_TOKENS,
        long_prefill_token_threshold=0,
        enable_prefix_caching=False,
        tensor_parallel_size=tensor_parallel_size,
    )


def prefill_s(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    started = time.perf_counter()
    (output,) = engine.generate([prompt], PARAMS)
    return time.perf_counter() - started, output.output_token_ids[0]


def main() -> None:
    config_class, overrides = MODELS["gqa"]
    with tempfile.TemporaryDirectory() as directory:
        model = save(Path(directory), config_class, overrides)
        engines = {degree: engine(model, degree) for degree in (1, 2)}
        rng = random.Random(0)
        times: dict[int, list[float]] = {1: [], 2: []}
        try:
            for round_index in range(ROUNDS + 1):  # round 0 warms both up
                prompt = [rng.randrange(2, WIDTH["vocab_size"]) for _ in range(PROMPT_TOKENS)]
                tokens = {}
                for degree, each in engines.items():
                    seconds, tokens[degree] = prefill_s(each, prompt)
                    if round_index:
                        times[degree].append(seconds)
                assert tokens[1] == tokens[2], f"TP=2 sampled {tokens[2]}, TP=1 {tokens[1]}"
        finally:
            for each in engines.values():
                each.shutdown()
    one, two = (statistics.median(times[degree]) for degree in (1, 2))
    print(f"prefill of {PROMPT_TOKENS} tokens, median of {ROUNDS} (same first token at both):")
    print(f"  TP=1  {1000 * one:8.1f} ms")
    print(f"  TP=2  {1000 * two:8.1f} ms   TP=1 / TP=2 = {one / two:.2f}x")
    print(f"  on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
