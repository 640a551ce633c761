"""The multiprocessing context of the tests' peer processes (a KV peer, a prefill engine).

A spawned child starts a fresh interpreter and imports torch and the engine: ≈ 3 s on 2 cores,
paid by every test that starts a peer. Forked from a forkserver that imported them once, a
child starts in ≈ 0.1 s (≈ 0.5 s with a NIXL agent), and is still a process of its own: its
own memory, sockets and pid, killed as a real peer would be. The forkserver imports only
modules that start no thread and open no socket (gRPC and NIXL load in each child), so that
forking it is safe.

Tests that must see a fresh interpreter (the tiny model's weights, what an import loads) start
``sys.executable`` or a ``spawn`` context themselves.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

PRELOAD = ["torch", "pdserve.engine", "pdserve.kvconnector.pd.pd_connector"]


def child_context() -> BaseContext:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: on first use
    return context
