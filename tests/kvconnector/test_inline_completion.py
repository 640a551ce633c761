"""Which hand-offs a prefill worker completes on its event loop: a small lease on a CPU cache,
never one on a device cache (copying device pages to the host waits for the forward running
there, and would freeze every stream of the worker).

No GPU here: a ``meta``-device tensor of the same shape stands in for a CUDA cache; only its
device is read, no byte of it.
"""

from __future__ import annotations

import torch

from pdserve.kvconnector.pd.pd_connector import INLINE_COMPLETION_BYTES, PDConnector
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.kv_transfer_params import KVTransferParams

PAGE_SHAPE = (4, 2, 16, 4, 64)  # layers, K/V, tokens, kv heads, head size: 64 KiB fp32


def producer_with(kv_cache: torch.Tensor) -> PDConnector:
    connector = PDConnector(
        KVConnectorConfig(role="producer", allow_insecure=True),
        engine_id="prefill-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    connector._kv_cache = kv_cache  # what register_kv_caches keeps, without its server
    return connector


def lease_of(connector: PDConnector, num_blocks: int, checksummed: int = 0) -> KVTransferParams:
    """A hand-off of ``num_blocks`` blocks, the first ``checksummed`` of them checksummed
    already (by an earlier offer of a chunk-wise hand-off)."""
    ids = list(range(1, num_blocks + 1))
    lease = connector.leases.grant("r", ids, [], checksums=None)
    connector.leases.attach_checksums(lease.lease_id, dict.fromkeys(ids[:checksummed], 7))
    return KVTransferParams(
        "prefill-0", "127.0.0.1:1", lease.lease_id, ids, [], [], 16 * num_blocks, 1, 1, 0.0
    )


def test_small_leases_on_a_cpu_cache_complete_inline_and_none_on_a_device_cache():
    page_bytes = torch.empty(PAGE_SHAPE).nbytes
    fits = INLINE_COMPLETION_BYTES // page_bytes
    cpu = producer_with(torch.zeros(64, *PAGE_SHAPE))
    assert cpu.completes_inline(lease_of(cpu, fits))
    assert not cpu.completes_inline(lease_of(cpu, fits + 1))
    # After offers, only the blocks still to checksum count.
    assert cpu.completes_inline(lease_of(cpu, fits + 8, checksummed=8))
    device = producer_with(torch.empty(64, *PAGE_SHAPE, device="meta"))
    assert not device.completes_inline(lease_of(device, 1))
