"""What ``pdserve up`` checks before it deploys: a config that cannot start fails at once,
with the fix named, instead of Serve restarting replicas that fail in their constructors
until the deploy gives up.

    nixl transport   the nixl package imports here (the workers need it)
    ports            nothing listens on the HTTP, gRPC and KV transfer ports (an embedded
                     cluster runs on this machine; a joined cluster's ports are elsewhere)
    model            a built-in name or a local path that exists (nothing is downloaded)
"""

from __future__ import annotations

import importlib
import socket

from pdserve.checkpoint.model_source import resolve_model
from pdserve.deploy.config import PDServeConfig


def preflight_problems(config: PDServeConfig) -> list[str]:
    """Every reason ``config`` cannot start on this machine, each naming its fix."""
    problems = []
    if config.transport == "nixl" and not config.colocated:
        try:
            importlib.import_module("nixl._api")
        except ImportError as error:
            problems.append(
                f"--transport nixl needs the nixl package, which does not import "
                f"here ({error}): pip install 'pdserve[nixl]', or use "
                f"--transport grpc"
            )
    models = [("--model", config.model), ("--speculative-model", config.speculative_model)]
    for flag, name in models:
        try:
            if name is not None:
                resolve_model(name)
        except (FileNotFoundError, ValueError) as error:
            problems.append(f"{flag} {name!r}: {error}")
    if not config.ray_address:
        problems += [
            f"{what} {host}:{port} is in use: stop what listens there, or choose "
            f"another with {flag}"
            for what, host, port, flag in _ports(config)
            if not _is_free(host, port)
        ]
    return problems


def _ports(config: PDServeConfig) -> list[tuple[str, str, int, str]]:
    """(what, host, port, flag) of each fixed port the app will listen on."""
    ports = [("the HTTP port", config.host, config.port, "--port")]
    if config.grpc_port:
        ports.append(("the gRPC port", config.host, config.grpc_port, "--grpc-port"))
    if config.kv_transfer_port and not config.colocated:
        host = config.kv_transfer_host or "127.0.0.1"
        ports += [
            (
                f"prefill-{i}'s KV transfer port",
                host,
                config.kv_transfer_port + i,
                "--kv-transfer-port",
            )
            for i in range(config.num_prefill)
        ]
    return [entry for entry in ports if entry[2]]


def _is_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. The probe binds the way the
    servers do (uvicorn and gRPC set ``SO_REUSEADDR``): a port whose last server stopped a
    moment ago still has its connections in TIME_WAIT, which refuses a plain bind for about
    a minute but not a server's; a port something listens on refuses both."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
