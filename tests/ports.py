"""Free loopback ports, for servers a test starts on a fixed address.

A test often picks a port long before a server binds it (a module constant, an app's
``kv_transfer_port`` whose workers bind ``port + index``). A port from the kernel's
ephemeral range can be taken in between by any outgoing connection's local end (Ray's
workers make thousands), which failed a deploy with "Failed to bind". So the ports come from
below that range and above Ray's worker ports (10002-19999 by default), at random, so that
suites running side by side do not collide either.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_ABOVE_RAY_WORKER_PORTS = 20_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of ``count`` consecutive ports nothing listens on now at ``host``, outside
    the ephemeral range."""
    high = _ephemeral_low() - count
    for _ in range(200):
        base = random.randrange(_ABOVE_RAY_WORKER_PORTS, high)
        if all(_bindable(host, port) for port in range(base, base + count)):
            return base
    raise OSError(f"no {count} consecutive free ports at {host} in 20000-{high + count}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True
