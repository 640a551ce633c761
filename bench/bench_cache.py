"""pdserve.cache benchmark: the ledger under a synthetic serving trace, and block hashing.

1. A seeded trace: requests share a few system prompts, prefill in chunks, decode a
   few steps, finish (or are preempted when the pool runs out). Reports allocate_slots
   calls/s, the prefix hit rate and the peak pool usage.
2. Hashing a 32k-token prompt into 2,048 chained block hashes: `BlockHasher` from an
   int32 array and from a list, beside a raw xxh3 loop and vLLM's default
   (sha256 over pickle of (parent, tuple(tokens), extra)) measured in the same run.

Run: python bench/bench_cache.py   (about 10 s)
"""

from __future__ import annotations

import hashlib
import pickle
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from pdserve.cache import (
    LedgerRequest,
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RequestBlockHasher,
)

BLOCK_SIZE = 16


@dataclass(slots=True)
class TraceRequest(LedgerRequest):
    """A ledger request that stops after ``max_new_tokens`` decode steps."""

    max_new_tokens: int = 0


def run_trace(num_requests: int = 3000, num_blocks: int = 512, chunk: int = 256, max_running: int = 48):
    rng = random.Random(0)
    hasher = RequestBlockHasher(BlockHasher(seed=0), BLOCK_SIZE)
    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, "bfloat16")
    manager = KVCacheManager(KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l0"], spec)]), 8192)
    system_prompts = [[rng.randrange(32000) for _ in range(rng.choice([256, 512, 1024]))] for _ in range(8)]
    waiting = [
        TraceRequest(
            f"r{i}",
            rng.choice(system_prompts) + [rng.randrange(32000) for _ in range(rng.randint(16, 512))],
            hasher,
            max_new_tokens=rng.randint(4, 64),
        )
        for i in range(num_requests)
    ]
    waiting.reverse()
    running: list[TraceRequest] = []
    calls = preemptions = 0
    peak_usage = 0.0
    elapsed = 0.0
    while waiting or running:
        start = time.perf_counter()
        while waiting and len(running) < max_running:
            req = waiting[-1]
            hit, num_hit = manager.get_computed_blocks(req)
            num_new = min(chunk, req.num_tokens - num_hit)
            calls += 1
            if manager.allocate_slots(req, num_new, num_hit, hit) is None:
                break
            req.num_computed_tokens = num_hit + num_new
            running.append(waiting.pop())
        for req in list(running):
            if req.num_computed_tokens == req.num_tokens:
                if req.max_new_tokens == 0:
                    manager.free(req)
                    running.remove(req)
                    continue
                req.append_token(rng.randrange(32000))
                req.max_new_tokens -= 1
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
            calls += 1
            if manager.allocate_slots(req, num_new) is None:
                manager.free(req)
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                preemptions += 1
                running.remove(req)
                waiting.append(req)
                continue
            req.num_computed_tokens += num_new
        elapsed += time.perf_counter() - start
        peak_usage = max(peak_usage, manager.usage)
    stats = manager.make_prefix_cache_stats()
    assert stats is not None and manager.get_num_free_blocks() == num_blocks - 1
    return calls, elapsed, stats, peak_usage, preemptions


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
            parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
            out.append(parent)
        return out

    assert len(hasher.hash_request_blocks(array, BLOCK_SIZE)) == num_blocks
    return {
        "BlockHasher xxh3_128, int32 array": best_ms(lambda: hasher.hash_request_blocks(array, BLOCK_SIZE)),
        "BlockHasher xxh3_128, list[int]": best_ms(lambda: hasher.hash_request_blocks(as_list, BLOCK_SIZE)),
        "BlockHasher sha256, int32 array": best_ms(lambda: sha_hasher.hash_request_blocks(array, BLOCK_SIZE)),
        "raw xxh3_128 loop (no extras)": best_ms(raw_xxh3),
        "vLLM default sha256(pickle)": best_ms(vllm_sha256_pickle, repeat=10),
    }


def main() -> None:
    calls, elapsed, stats, peak_usage, preemptions = run_trace()
    print("ledger trace (3,000 requests, 8 shared system prompts, 511 usable blocks of 16, chunk 256)")
    print(f"  allocate_slots calls  {calls:,} in {elapsed:.2f} s (ledger + decode-token hashing) "
          f"= {calls / elapsed:,.0f} calls/s")
    print(f"  prefix hit rate       {stats.hit_rate:.1%} ({stats.hits:,} of {stats.queries:,} tokens; "
          f"preempted re-admissions {stats.preempted_hits:,} of {stats.preempted_queries:,})")
    print(f"  peak usage            {peak_usage:.1%}; preemptions {preemptions}; evicted blocks {stats.evicted_blocks:,}")
    print()
    figures = hashing_figures()
    base = figures["raw xxh3_128 loop (no extras)"][0]
    vllm = figures["vLLM default sha256(pickle)"][0]
    print("hashing a 32,768-token prompt into 2,048 chained block hashes (best / median ms)")
    for name, (best, median) in figures.items():
        print(f"  {name:36s} {best:7.3f} / {median:7.3f} ms   x{best / base:5.2f} of raw   "
              f"{vllm / best:5.1f}x faster than vLLM default")


if __name__ == "__main__":
    main()
