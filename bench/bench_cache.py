"""pdserve.cache benchmark: the ledger against vLLM 0.33.0's, side by side, and block hashing.

1. One seeded serving trace (`ledger_trace.py`: 2,000 requests over 8 shared system
   prompts, chunked prefill at 2,048 tokens per step, a pool of 8,192 blocks of 16,
   preemptions when it runs out) replayed against pdserve's `KVCacheManager` and, when
   installed, vLLM 0.33.0's own (`vllm_ledger.py`), with the same scheduler calls, in
   this process, interleaved. Prints both times, the ratio, and each side's digest of
   every admit (with its hit length), preempt and finish decision: equal digests mean
   identical decisions. `--profile` adds a cProfile summary of pdserve's replay.
2. Hashing a 32k-token prompt into 2,048 chained block hashes: `BlockHasher` from an
   int32 array and from a list, beside a raw xxh3 loop and vLLM's default
   (sha256 over pickle of (parent, tuple(tokens), extra)) measured in the same run.

vLLM side: `make bench-vllm-env` once (installs vllm 0.33.0 --no-deps and its pinned
import-time packages into build/vllm-bench-env, never into the project's venv). Without
it the bench prints pdserve's figures and says vLLM is not installed.

Run: python bench/bench_cache.py [--repeat 3] [--requests 2000] [--profile]   (about 1 min)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import pickle
import pstats
import statistics
import time
from typing import Any

import numpy as np
import xxhash
from ledger_trace import LedgerDriver, ReplayResult, TraceRequest, TraceShape, make_trace, replay
from vllm_ledger import load_vllm

from pdserve.cache import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LedgerRequest,
    RequestBlockHasher,
)

BLOCK_SIZE = 16


class PdserveDriver:
    """pdserve's `KVCacheManager` over one full-attention group, `LedgerRequest`s."""

    name = "pdserve"

    def __init__(self, shape: TraceShape) -> None:
        spec = FullAttentionSpec(shape.block_size, 8, 128, "bfloat16")
        config = KVCacheConfig(shape.num_blocks, [KVCacheGroupSpec(["layers.0"], spec)])
        self.manager = KVCacheManager(config, shape.max_model_len)
        self._hasher = RequestBlockHasher(BlockHasher(seed=0), shape.block_size)

    def new_request(self, trace_request: TraceRequest) -> LedgerRequest:
        return LedgerRequest(trace_request.request_id, trace_request.prompt_token_ids, self._hasher)

    append_token = staticmethod(LedgerRequest.append_token)

    def get_computed_blocks(self, request: LedgerRequest) -> tuple[Any, int]:
        return self.manager.get_computed_blocks(request)


def timed_replay(driver_class: type, trace: list[TraceRequest], shape: TraceShape) -> ReplayResult:
    driver: LedgerDriver = driver_class(shape)
    gc.collect()
    return replay(driver, trace, shape)


def side_by_side(shape: TraceShape, repeat: int) -> None:
    trace = make_trace(shape)
    vllm_driver, vllm_note = load_vllm()
    drivers: list[type] = [PdserveDriver] + ([vllm_driver] if vllm_driver is not None else [])
    results: dict[str, list[ReplayResult]] = {driver.name: [] for driver in drivers}
    for _ in range(repeat):  # interleaved, so a noisy neighbour hits both sides alike
        for driver in drivers:
            results[driver.name].append(timed_replay(driver, trace, shape))
    print(
        f"ledger trace: {shape.num_requests:,} requests, {shape.num_system_prompts} shared system prompts, "
        f"{shape.num_blocks:,} blocks of {shape.block_size}, {shape.max_num_batched_tokens:,} tokens/step, "
        f"best of {repeat} interleaved runs"
    )
    for name, runs in results.items():
        run = runs[0]
        best = min(r.seconds for r in runs)
        print(
            f"  {name:14s} {best:6.3f} s best, {statistics.median(r.seconds for r in runs):6.3f} s median   "
            f"{run.num_allocate_calls:,} allocate_slots calls, {run.num_admissions:,} admissions, "
            f"{run.num_preemptions} preemptions, hit rate {run.hit_rate:.4f}, digest {run.digest}"
        )
    if vllm_driver is None:
        print(f"  (no side-by-side: {vllm_note})")
        return
    ours, theirs = results[PdserveDriver.name], results[vllm_driver.name]
    ratio = min(r.seconds for r in theirs) / min(r.seconds for r in ours)
    same = {r.digest for r in ours} == {r.digest for r in theirs} and len(
        {r.digest for r in ours}
    ) == 1
    print(
        f"  pdserve runs in {1 / ratio:.2f}x of {vllm_note}'s time: {ratio:.2f}x faster; "
        f"decisions {'IDENTICAL (digests equal)' if same else 'DIFFER (digests differ)'}"
    )


def profile_pdserve(shape: TraceShape, top: int = 15) -> None:
    trace = make_trace(shape)
    driver = PdserveDriver(shape)
    profiler = cProfile.Profile()
    profiler.enable()
    replay(driver, trace, shape)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print(f"profile of pdserve's replay (top {top} by own time)")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def best_ms(fn, repeat: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3, statistics.median(times) * 1e3


def hashing_figures(num_tokens: int = 32768):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 32000, num_tokens).astype("<i4")
    as_list = array.tolist()
    hasher = BlockHasher(seed=0)
    sha_hasher = BlockHasher("sha256", seed=0)
    num_blocks = num_tokens // BLOCK_SIZE
    digest = xxhash.xxh3_128_digest

    def raw_xxh3():
        tokens = memoryview(array.tobytes())
        parent, out, step = hasher.none_hash, [], 4 * BLOCK_SIZE
        for offset in range(0, len(tokens), step):
            parent = digest(parent + tokens[offset : offset + step])
            out.append(parent)
        return out

    def vllm_sha256_pickle():
        parent, out = hasher.none_hash, []
        for index in range(num_blocks):
            block = tuple(as_list[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
            parent = hashlib.sha256(
                pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)
            ).digest()
            out.append(parent)
        return out

    assert len(hasher.hash_request_blocks(array, BLOCK_SIZE)) == num_blocks
    return {
        "BlockHasher xxh3_128, int32 array": best_ms(
            lambda: hasher.hash_request_blocks(array, BLOCK_SIZE)
        ),
        "BlockHasher xxh3_128, list[int]": best_ms(
            lambda: hasher.hash_request_blocks(as_list, BLOCK_SIZE)
        ),
        "BlockHasher sha256, int32 array": best_ms(
            lambda: sha_hasher.hash_request_blocks(array, BLOCK_SIZE)
        ),
        "raw xxh3_128 loop (no extras)": best_ms(raw_xxh3),
        "vLLM default sha256(pickle)": best_ms(vllm_sha256_pickle, repeat=10),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per ledger")
    parser.add_argument("--requests", type=int, default=TraceShape().num_requests)
    parser.add_argument("--profile", action="store_true", help="also profile pdserve's replay")
    parser.add_argument("--skip-hashing", action="store_true")
    args = parser.parse_args()
    shape = TraceShape(num_requests=args.requests)
    side_by_side(shape, args.repeat)
    if args.profile:
        print()
        profile_pdserve(shape)
    if args.skip_hashing:
        return
    print()
    figures = hashing_figures()
    base = figures["raw xxh3_128 loop (no extras)"][0]
    vllm = figures["vLLM default sha256(pickle)"][0]
    print("hashing a 32,768-token prompt into 2,048 chained block hashes (best / median ms)")
    for name, (best, median) in figures.items():
        print(
            f"  {name:36s} {best:7.3f} / {median:7.3f} ms   x{best / base:5.2f} of raw   "
            f"{vllm / best:5.1f}x faster than vLLM default"
        )


if __name__ == "__main__":
    main()
