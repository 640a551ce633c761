"""KV tier benchmark: a pool too small for the working set, with and without a tier, side by side.

Four long system prompts take turns (system i % 4 + a short question per request); the
pool holds about two of them, so its LRU evicts each one just before it is needed again and
a pool-only engine computes every prompt in full. With a tier the evicted prefixes load
back. One run prints, per configuration: prefix hit rate (pool + tier tokens over prompt
tokens), prefill tokens computed, TTFT p50/p99, tier loads, and whether the tokens equal the
pool-only engine's, token for token (greedy).

Run: python bench/bench_offload.py [--requests 40] [--system-tokens 512]   (about 30 s)
The disk tier writes under a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.kv_tier_config import KVTierConfig
from pdserve.stats.latency import percentile

BLOCK_SIZE = 16
NUM_SYSTEMS = 4
QUESTION_TOKENS = 16
MAX_TOKENS = 8


def workload(num_requests: int, system_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(1, 500) for _ in range(system_tokens)] for _ in range(NUM_SYSTEMS)]
    return [
        systems[i % NUM_SYSTEMS] + [rng.randrange(1, 500) for _ in range(QUESTION_TOKENS)]
        for i in range(num_requests)
    ]


def run(name: str, tier: KVTierConfig | None, prompts: list[list[int]], num_blocks: int) -> dict:
    connector = TierConnector(tier, "bench") if tier else None
    engine = LLMEngine.from_pretrained(
        "tiny",
        connector=connector,
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=2048,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:32]], params)  # warm-up (not counted)
    before = engine.stats()
    ttfts, outputs = [], []
    for prompt in prompts:  # one at a time: TTFT is the prompt's own prefill (or load)
        (out,) = engine.generate([prompt], params)
        ttfts.append(out.first_token_time - out.arrival_time)
        outputs.append(out.output_token_ids)
    stats = engine.stats()
    engine.shutdown()
    num_prompt_tokens = sum(len(p) for p in prompts)
    decode_tokens = len(prompts) * (MAX_TOKENS - 1)
    tier_hits = sum(t.hit_tokens for t in stats.tiers)
    pool_hits = stats.prefix_cache_hits - before.prefix_cache_hits
    return dict(
        name=name,
        outputs=outputs,
        hit_rate=(pool_hits + tier_hits) / num_prompt_tokens,
        computed=stats.num_scheduled_tokens - before.num_scheduled_tokens - decode_tokens,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        loads=sum(t.blocks_loaded for t in stats.tiers),
        failures=sum(t.load_failures + t.store_failures for t in stats.tiers),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--system-tokens", type=int, default=512)
    args = parser.parse_args()
    prompts = workload(args.requests, args.system_tokens)
    blocks_per_request = (args.system_tokens + QUESTION_TOKENS + MAX_TOKENS) // BLOCK_SIZE + 1
    num_blocks = 2 * blocks_per_request + 1  # about two of the four prompts fit
    page_bytes = 64 * 1024  # the tiny model's page
    working_set = NUM_SYSTEMS * blocks_per_request * page_bytes
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-offload-") as disk_dir:
        results = [
            run("pool only", None, prompts, num_blocks),
            run("+ cpu tier", KVTierConfig(cpu_bytes=2 * working_set), prompts, num_blocks),
            run(
                "+ disk tier",
                KVTierConfig(disk_path=disk_dir, disk_bytes=2 * working_set),
                prompts,
                num_blocks,
            ),
            run(
                "+ cpu 1/4 over disk",
                KVTierConfig(
                    cpu_bytes=working_set // 4, disk_path=disk_dir, disk_bytes=2 * working_set
                ),
                prompts,
                num_blocks,
            ),
        ]
    print(
        f"tiny model, pool {num_blocks} blocks of {BLOCK_SIZE}; {len(prompts)} requests over "
        f"{NUM_SYSTEMS} system prompts of {args.system_tokens} tokens (+{QUESTION_TOKENS}), "
        f"{MAX_TOKENS} tokens each, one at a time"
    )
    header = (
        f"{'config':<22}{'hit rate':>9}{'prefill computed':>18}{'TTFT p50 ms':>13}"
        f"{'TTFT p99 ms':>13}{'tier loads':>12}{'failures':>10}{'tokens equal':>14}"
    )
    print(header)
    baseline = results[0]["outputs"]
    for r in results:
        print(
            f"{r['name']:<22}{100 * r['hit_rate']:>8.1f}%{r['computed']:>18}"
            f"{1000 * r['ttft_p50']:>13.1f}{1000 * r['ttft_p99']:>13.1f}{r['loads']:>12}"
            f"{r['failures']:>10}{str(r['outputs'] == baseline):>14}"
        )


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
