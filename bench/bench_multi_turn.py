"""A conversation's later turns: does running them where their history's KV is pay?

One local Ray cluster, 1 prefill + 1 decode worker (``tiny``), an agent-like conversation of
``--turns`` turns: each turn's prompt is the whole history (a system prompt, then each turn's
tool result of ``--tool-tokens`` tokens and the model's answer of ``--answer-tokens``), sent as
token ids so the history is exactly what the workers computed. The same conversations run
with ``decode_reuse_min_tokens`` at 0 (off: the prefill worker holds the history's prompts
but not the answers, which only the decode worker computed, so it recomputes each answer)
and at ``--reuse`` (a turn runs whole on the decode worker that holds its history, which
computes only the new tool result), interleaved over ``--reps`` repetitions, a fresh
conversation each run (no cache carries over).

Per turn, medians: prompt tokens computed (prefill's and decode's together, from the reply's
``kv_provenance``) and TTFT at the gateway; ratios off / on. Aims (issue 29): turn >= 2
computes only its new message; TTFT >= 1.5x lower than without reuse.

Run: python bench/bench_multi_turn.py   (≈ 2 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import random
import statistics

from pdserve.deploy.cluster import base_url, configure_ray_env, deploy, init_ray
from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient

COMPUTED = ("prefill_computed", "decode_prefilled", "decode_recomputed")


def converse(client: ServiceClient, seed: int, args: argparse.Namespace) -> list[dict]:
    """One conversation; per turn, the tokens computed and the TTFT."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(n)]

    history = tokens(args.system_tokens)
    turns = []
    for _ in range(args.turns):
        history += tokens(args.tool_tokens)
        body = client.post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": history,
                "max_tokens": args.answer_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        answer = [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]
        provenance = body["kv_provenance"]
        sources = provenance["prompt_tokens_by_source"]
        turns.append(
            {
                "computed": sum(sources[s] for s in COMPUTED),
                "ttft_s": provenance["ttft_s"],
                # Run whole on the decode worker: its stream is the only one.
                "on_decode": provenance["decode"] is None,
            }
        )
        history += answer
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--tool-tokens", type=int, default=1000)
    parser.add_argument("--answer-tokens", type=int, default=200)
    parser.add_argument("--reuse", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--port", type=int, default=8052)
    args = parser.parse_args()
    configure_ray_env()
    init_ray(None, num_cpus=2)
    results: dict[int, list[list[dict]]] = {0: [], args.reuse: []}
    seed = 0
    for rep in range(args.reps):
        for reuse in (0, args.reuse) if rep % 2 == 0 else (args.reuse, 0):
            # One app; a redeploy that changes only the gateway keeps the workers.
            config = PDServeConfig(
                model="tiny",
                num_prefill=1,
                num_decode=1,
                port=args.port,
                app_name="multiturn",
                route_prefix="/multiturn",
                num_kv_blocks=4096,
                decode_reuse_min_tokens=reuse,
            )
            deploy(config)
            client = ServiceClient(base_url(config))
            seed += 1
            results[reuse].append(converse(client, seed, args))
            client.close()
    print(
        f"{args.turns} turns: a {args.system_tokens}-token system prompt, then per turn a "
        f"{args.tool_tokens}-token tool result and a {args.answer_tokens}-token answer; 1+1, "
        f"tiny; medians of {args.reps}"
    )
    print(
        f"{'turn':>4} {'computed off':>12} {'computed on':>11} {'TTFT off ms':>11} "
        f"{'TTFT on ms':>10} {'off/on':>6} {'on decode':>9}"
    )
    for turn in range(args.turns):

        def median(reuse: int, key: str, turn: int = turn) -> float:
            return statistics.median(run[turn][key] for run in results[reuse])

        off, on = median(0, "ttft_s"), median(args.reuse, "ttft_s")
        on_decode = sum(run[turn]["on_decode"] for run in results[args.reuse])
        print(
            f"{turn + 1:>4} {median(0, 'computed'):>12.0f} {median(args.reuse, 'computed'):>11.0f} "
            f"{1e3 * off:>11.1f} {1e3 * on:>10.1f} {off / on:>6.2f} "
            f"{on_decode:>4}/{len(results[args.reuse])}"
        )


if __name__ == "__main__":
    main()
