"""The ``pdserve`` command: up, down, status, generate, stats, demo.

    pdserve up --prefill 2 --decode 2 --model tiny --port 8000   # embedded cluster; blocks until Ctrl-C
    pdserve up --address auto ...                                 # on a `ray start --head` cluster; returns,
                                                                  # the Serve app stays up (detached)
    pdserve generate "Once upon a time" --max-tokens 32           # streams over HTTP
    pdserve stats                                                 # per-worker table
    pdserve status                                                # the app's deployments and replicas
    pdserve down --address auto                                   # deletes the app
    pdserve demo                                                  # up (1+1), a burst of shared-prefix prompts,
                                                                  # the outputs and the stats table, down
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import sys
import time

import httpx
from httpx_sse import connect_sse

from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.preflight import preflight_problems
from pdserve.stats.registry import WORKER_STATS
from pdserve.stats.views import format_table


_TIMEOUT_S = 120.0


def _get_json(url: str) -> dict:
    response = httpx.get(url, timeout=_TIMEOUT_S)
    response.raise_for_status()
    return response.json()


def _post_json(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=_TIMEOUT_S)
    response.raise_for_status()
    return response.json()


def _url(args) -> str:
    return args.url.rstrip("/")


def cmd_up(args) -> int:
    from pdserve.deploy.cluster import base_url, deploy, init_ray, remember_local_cluster

    config = PDServeConfig.from_cli(args)
    problems = preflight_problems(config)
    if problems:
        print("pdserve up: this config cannot start:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    init_ray(config.ray_address)
    seconds = deploy(config)
    if not config.ray_address:
        remember_local_cluster(config)
    print(f"pdserve: {config.num_prefill} prefill + {config.num_decode} decode workers of "
          f"{config.model_name!r} up in {seconds:.1f}s at {base_url(config)}/v1")
    if config.ray_address:
        return 0  # the app lives on in the cluster; `pdserve down` removes it
    print(f"try: pdserve generate 'Hello' --url {base_url(config)}   |   "
          f"pdserve stats --url {base_url(config)}")
    print("Ctrl-C (or SIGTERM) to stop")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _stop(config)
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop(config: PDServeConfig) -> None:
    """Removes the app: on a joined cluster only the app; an embedded cluster goes down whole."""
    import ray
    from ray import serve

    from pdserve.deploy.cluster import forget_local_cluster

    if config.ray_address:
        serve.delete(config.app_name)
    else:
        forget_local_cluster()
        ray.shutdown()


def _join(args) -> None:
    """Joins ``--address``, else the cluster a local ``pdserve up`` recorded, else ``auto``."""
    from pdserve.deploy.cluster import init_ray, local_cluster_address

    init_ray(args.address or local_cluster_address() or "auto")


def cmd_down(args) -> int:
    from ray import serve

    _join(args)
    serve.delete(args.app_name)
    print(f"pdserve: deleted app {args.app_name!r}")
    return 0


def cmd_status(args) -> int:
    from ray import serve

    _join(args)
    status = serve.status()
    for name, app in status.applications.items():
        print(f"{name}: {app.status}")
        for deployment_name, deployment in app.deployments.items():
            print(f"  {deployment_name:<12} {deployment.status}  {dict(deployment.replica_states)}")
    return 0


def cmd_generate(args) -> int:
    """Streams one completion to the terminal (SSE, read with ``httpx-sse``)."""
    body = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True}
    if args.seed is not None:
        body["seed"] = args.seed
    with httpx.Client(timeout=_TIMEOUT_S) as client, \
            connect_sse(client, "POST", f"{_url(args)}/v1/completions", json=body) as source:
        if source.response.status_code != 200:
            print(f"error {source.response.status_code}: {source.response.read().decode()}",
                  file=sys.stderr)
            return 1
        for event in source.iter_sse():
            if event.data == "[DONE]":
                break
            chunk = json.loads(event.data)
            if "error" in chunk:
                print(f"\nerror: {chunk['error']['message']}", file=sys.stderr)
                return 1
            print(chunk["choices"][0]["text"], end="", flush=True)
    print()
    return 0


def format_stats(stats: dict) -> str:
    """The per-worker table, columns from the stats registry, then the gateway's line."""
    table = format_table(WORKER_STATS, stats["workers"], {**stats["totals"], "worker_id": "total"},
                         leading=[("worker", "worker_id"), ("role", "role")])
    g = stats["gateway"]
    rejected = sum(g["rejected_by_status"].values())
    return (f"{table}\ngateway: {g['num_requests']} requests, {rejected} rejected, "
            f"{g['num_generation_tokens']} tokens; TTFT p50 {1000 * g['ttft_p50_s']:.1f} ms "
            f"p99 {1000 * g['ttft_p99_s']:.1f} ms; ITL p50 {1000 * g['itl_p50_s']:.1f} ms "
            f"p99 {1000 * g['itl_p99_s']:.1f} ms")


def cmd_stats(args) -> int:
    stats = _get_json(f"{_url(args)}/stats")
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


DEMO_PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. Question: ",
    "Translate the following sentence into French, keeping the tone: ",
]
DEMO_QUESTIONS = ["what is a KV cache?", "why split prefill and decode?", "how do leases work?",
                  "what is a block hash?"]


def cmd_demo(args) -> int:
    """Up, a warm-up request then a concurrent burst over two shared prefixes, the outputs
    and the stats table (prefix hits, blocks moved, dedup), down. Exit 0 when all answered."""
    from pdserve.deploy.cluster import base_url, deploy, init_ray

    config = PDServeConfig.from_cli(args)
    start = time.perf_counter()
    init_ray(config.ray_address, num_cpus=2)
    print(f"starting {config.num_prefill} prefill + {config.num_decode} decode workers ...")
    print(f"up in {deploy(config):.1f}s")
    url = base_url(config)
    prompts = [p + q for p in DEMO_PREFIXES for q in DEMO_QUESTIONS]

    def complete(prompt: str) -> str:
        body = {"model": config.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        return _post_json(f"{url}/v1/completions", body)["choices"][0]["text"]

    try:
        complete(prompts[0])  # warm one prefix, then the burst
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(complete, prompts))
        for prompt, output in zip(prompts, outputs):
            print(f"{prompt[-34:]!r:>38} -> {output!r}")
        time.sleep(0.5)  # let the routers' event polls settle
        print(format_stats(_get_json(f"{url}/stats")))
    finally:
        _stop(config)
    print(f"demo done in {time.perf_counter() - start:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdserve.deploy.cluster import configure_ray_env

    configure_ray_env()
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func in (("up", cmd_up), ("demo", cmd_demo)):
        sub = commands.add_parser(name)
        PDServeConfig.add_cli_flags(sub)
        sub.set_defaults(func=func)
        if name == "demo":
            sub.set_defaults(num_prefill=1, num_decode=1, port=8000)
    for name, func in (("down", cmd_down), ("status", cmd_status)):
        sub = commands.add_parser(name)
        sub.add_argument("--address", help="Ray address (default: the local `pdserve up`, else auto)")
        sub.add_argument("--app-name", default="pdserve")
        sub.set_defaults(func=func)
    gen = commands.add_parser("generate")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tiny")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    stats = commands.add_parser("stats")
    stats.add_argument("--json", action="store_true")
    for sub in (gen, stats):
        sub.add_argument("--url", default="http://127.0.0.1:8000")
    gen.set_defaults(func=cmd_generate)
    stats.set_defaults(func=cmd_stats)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
