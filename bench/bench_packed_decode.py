"""Decode speed of ``smollm2`` with its weights packed (``--quantization auto``: Q4_1 layers,
the Q8_0 embedding tied to the LM head) against the same file dequantized to float32
(``none``), one torch thread each, engines side by side in one process, alternating.

Printed per batch size: generated tokens per second (median of ``--repeats``) and the
ratio packed / float32, and a 512-token prefill's time.

Measured (2026-12-05, this 2-core Sapphire Rapids box, one thread, 64 new tokens, 3 repeats,
other work on the second core)::

    batch  1: packed   43.3 tok/s  float32   20.4 tok/s  ratio 2.12x
    batch 16: packed  181.1 tok/s  float32   90.3 tok/s  ratio 2.00x
    512-token prefill: packed 83 ms  float32 196 ms  ratio 0.43x

llama.cpp ran this file at about 58 tok/s on one thread (issue 52): packed batch 1 is about
0.75x of it (0.35x before). Aims: batch 1 >= 1.0x llama.cpp (not met), batch 16 >= 3x
float32 (not met: 2.0x), prefill no slower (met: many rows are dequantized to bfloat16 and
multiplied on AMX).

Run: python bench/bench_packed_decode.py   (≈ 3 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams


def tokens_per_second(engine: LLMEngine, batch: int, new_tokens: int) -> float:
    prompts = [[1 + (7 * i + j) % 4000 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.generate(prompts, params)
    return batch * new_tokens / (time.perf_counter() - started)


def prefill_seconds(engine: LLMEngine, length: int) -> float:
    prompt = [1 + (13 * j) % 4000 for j in range(length)]
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    common = dict(
        num_kv_blocks=512,
        block_size=16,
        max_num_seqs=16,
        torch_threads=1,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=512,
    )
    engines = {
        name: LLMEngine.from_pretrained("smollm2", quantization=name, **common)
        for name in ("auto", "none")
    }
    print(f"smollm2, one thread, {args.new_tokens} new tokens, median of {args.repeats}")
    for batch in (1, 16):
        speeds: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                speeds[name].append(tokens_per_second(engine, batch, args.new_tokens))
        packed, dense = (statistics.median(speeds[name]) for name in ("auto", "none"))
        print(
            f"batch {batch:>2}: packed {packed:6.1f} tok/s  float32 {dense:6.1f} tok/s  "
            f"ratio {packed / dense:.2f}x"
        )
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            times[name].append(prefill_seconds(engine, 512))
    packed, dense = (statistics.median(times[name]) for name in ("auto", "none"))
    print(
        f"512-token prefill: packed {1e3 * packed:.0f} ms  float32 {1e3 * dense:.0f} ms  "
        f"ratio {packed / dense:.2f}x"
    )


if __name__ == "__main__":
    main()
