"""A prefill-side KV peer in its own process, driven from the test over a pipe.

The child builds a KV tensor of seeded random bytes (``seeded_kv_cache`` rebuilds the same
tensor in the test process, so expected bytes need no shipping), a ``LeaseTable`` and a
transfer server, then answers commands: grant a lease, take freeable requests, report
expiries. The test can also kill it outright.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pdserve.kvconnector.transport.base import KVTransferClient
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.kvconnector.transport.nixl_transport import NixlTransferClient, nixl_available
from tests.child_processes import child_context

TRANSPORTS = [
    "grpc",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            not nixl_available(), reason="nixl is not installed (pip install 'pdserve[nixl]')"
        ),
    ),
]

TINY_SHAPE = dict(num_layers=4, block_size=16, num_kv_heads=2, head_size=64)


@dataclass(frozen=True)
class PeerSpec:
    transport: str = "grpc"  # "grpc" or "nixl"
    num_blocks: int = 64
    dtype: str = "float32"
    seed: int = 1234
    shape: dict[str, int] = field(default_factory=lambda: dict(TINY_SHAPE))
    hash_algorithm: str = "xxh3_128"
    hash_seed: int = 0
    secret: str | None = None
    lease_ttl_s: float = 30.0
    corrupt_block: int | None = None  # flip a byte of this block after its checksum
    stall_after_first_message: bool = False
    delay_per_message_s: float = 0.0  # a slow link: every message waits this long


def seeded_kv_cache(
    spec: PeerSpec, num_blocks: int | None = None, seed: int | None = None
) -> torch.Tensor:
    shape = spec.shape
    dims = (
        num_blocks or spec.num_blocks,
        shape["num_layers"],
        2,
        shape["block_size"],
        shape["num_kv_heads"],
        shape["head_size"],
    )
    itemsize = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    generator = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    raw = torch.randint(
        0,
        256,
        (dims[0], int(torch.tensor(dims[1:]).prod()) * itemsize),
        dtype=torch.uint8,
        generator=generator,
    )
    return raw.view(getattr(torch, spec.dtype)).reshape(dims).contiguous()


def _serve(spec: PeerSpec, conn: Any) -> None:
    import threading
    import time

    from pdserve.kvconnector.checksum import block_checksums
    from pdserve.kvconnector.pd.lease import LeaseTable
    from pdserve.kvconnector.transport.layout import KVLayout

    torch.set_num_threads(1)
    kv_cache = seeded_kv_cache(spec)
    layout = KVLayout.from_kv_cache(kv_cache, spec.hash_algorithm, spec.hash_seed)
    leases = LeaseTable(default_ttl_s=spec.lease_ttl_s)

    stalled = threading.Event()  # a read reached the stall: it is in flight now

    def fault_injector(block_ids: list[int], packed: bytearray) -> None:
        if spec.corrupt_block in block_ids:
            packed[block_ids.index(spec.corrupt_block) * layout.page_bytes + 7] ^= 0xFF
        if spec.stall_after_first_message:
            stalled.set()
            time.sleep(3600)
        time.sleep(spec.delay_per_message_s)

    injecting = (
        spec.corrupt_block is not None
        or spec.stall_after_first_message
        or spec.delay_per_message_s > 0
    )
    kwargs = dict(
        engine_id="prefill-0",
        secret=spec.secret,
        max_message_bytes=256 << 10,
        fault_injector=fault_injector if injecting else None,
    )
    if spec.transport == "nixl":
        from pdserve.kvconnector.transport.nixl_transport import NixlTransferServer

        server = NixlTransferServer(kv_cache, leases, layout, **kwargs)
    else:
        from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer

        server = GrpcTransferServer(kv_cache, leases, layout, **kwargs)
    conn.send(server.address)
    while True:
        command, *args = conn.recv()
        if command == "grant":
            request_id, block_ids, ttl_s = args
            checksums = block_checksums(kv_cache, block_ids)
            if spec.corrupt_block in block_ids and spec.transport == "nixl":
                kv_cache.view(-1, layout.page_bytes // kv_cache.element_size())[
                    spec.corrupt_block, 0
                ] += 1  # the page changes after its checksum
            lease = leases.grant(request_id, block_ids, [], checksums, ttl_s)
            conn.send((lease.lease_id, checksums))
        elif command == "take_freeable":
            conn.send(leases.take_freeable())
        elif command == "num_expired":
            conn.send(leases.num_expired)
        elif command == "stalled":
            conn.send(stalled.is_set())
        elif command == "stop":
            server.stop(0)
            conn.send(None)
            return


class PeerProcess:
    """Handle on the child: ``address``, ``grant``, ``take_freeable``, ``kill``."""

    def __init__(self, spec: PeerSpec) -> None:
        context = child_context()
        self.spec = spec
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(spec, child_conn), daemon=True)
        self.process.start()
        if not self._conn.poll(60):
            self.kill()
            raise TimeoutError("KV peer process did not start within 60 s")
        self.address: str = self._conn.recv()

    def _ask(self, *command: Any) -> Any:
        self._conn.send(command)
        if not self._conn.poll(30):
            raise TimeoutError(f"KV peer did not answer {command[0]}")
        return self._conn.recv()

    def grant(
        self, block_ids: list[int], request_id: str = "req-0", ttl_s: float | None = None
    ) -> tuple[str, list[int]]:
        return self._ask("grant", request_id, block_ids, ttl_s)

    def take_freeable(self) -> list[str]:
        return self._ask("take_freeable")

    def is_stalled(self) -> bool:
        """True once a read reached ``stall_after_first_message``'s stall (gRPC)."""
        return self._ask("stalled")

    def num_expired(self) -> int:
        return self._ask("num_expired")

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._ask("stop")
            except (TimeoutError, OSError, EOFError):
                pass
        self.kill()


def make_client(
    spec: PeerSpec,
    local: torch.Tensor,
    secret: str | None = None,
    timeout_s: float = 10.0,
    hash_seed: int | None = None,
    streams: int = 1,
) -> KVTransferClient:
    """A transfer client of ``spec``'s transport over the local KV tensor ``local`` (gRPC:
    striping large pulls over ``streams`` connections)."""
    layout = KVLayout.from_kv_cache(
        local, spec.hash_algorithm, spec.hash_seed if hash_seed is None else hash_seed
    )
    if spec.transport == "nixl":
        return NixlTransferClient(
            local, layout, engine_id="decode-0", secret=secret, timeout_s=timeout_s
        )
    return GrpcTransferClient(
        local, layout, engine_id="decode-0", secret=secret, timeout_s=timeout_s, streams=streams
    )
