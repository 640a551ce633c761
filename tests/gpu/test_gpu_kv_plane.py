"""The KV plane over GPU memory: both transports take a CUDA KV tensor.

gRPC stages pages through a pinned host buffer on both sides; NIXL registers the tensor as
VRAM and READs into the decode worker's VRAM; checksums agree across devices. Real gRPC
servers and NIXL agents in this process, CUDA tensors on device 0.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.checksum import block_checksums
from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.kvconnector.transport.nixl_transport import (
    NixlTransferClient,
    NixlTransferServer,
    nixl_available,
)
from pdserve.messages.connector_config import KVConnectorConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"
)
SHAPE = (32, 2, 2, 16, 2, 64)  # blocks, layers, K/V, block size, kv heads, head size
CLIENTS = {
    "grpc": (GrpcTransferServer, GrpcTransferClient),
    "nixl": (NixlTransferServer, NixlTransferClient),
}
TRANSPORTS = [
    "grpc",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
    ),
]


def random_kv(device: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=generator).to(device).contiguous()


def test_checksums_of_the_same_bytes_agree_on_cuda_and_cpu() -> None:
    kv = random_kv("cpu")
    ids = [5, 0, 17, 3]
    assert block_checksums(kv.to("cuda"), ids) == block_checksums(kv, ids)


# gRPC stages through host memory, so every pairing is its own code path; NIXL is checked
# where it is deployed, VRAM to VRAM (a DRAM/VRAM mix is UCX's path, not one of ours).
DEVICE_CASES = [
    pytest.param("grpc", pair, id=f"grpc-{pair[0]}-to-{pair[1]}")
    for pair in [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]
]
DEVICE_CASES.append(
    pytest.param("nixl", ("cuda", "cuda"), id="nixl-cuda-to-cuda", marks=TRANSPORTS[1].marks)
)


@pytest.mark.parametrize("transport, devices", DEVICE_CASES)
def test_shuffled_pages_land_byte_exact_between_devices(transport, devices) -> None:
    source, destination = random_kv(devices[0]), torch.zeros(SHAPE, device=devices[1])
    layout = KVLayout.from_kv_cache(source, "xxh3_128", 0)
    leases = LeaseTable()
    server_type, client_type = CLIENTS[transport]
    server = server_type(source, leases, layout, engine_id="prefill", host="127.0.0.1")
    client = client_type(destination, layout, engine_id="decode", timeout_s=30.0)
    rng = random.Random(1)
    remote_ids, local_ids = rng.sample(range(SHAPE[0]), 12), rng.sample(range(SHAPE[0]), 12)
    lease = leases.grant("r0", remote_ids, [b"h"] * 12, block_checksums(source, remote_ids))
    try:
        peer = client.handshake(server.address)
        result = client.read_blocks(
            peer, lease.lease_id, remote_ids, local_ids, block_checksums(source, remote_ids)
        )
    finally:
        client.close()
        server.stop(0)
    assert sorted(result.ok_block_ids) == sorted(local_ids) and result.failed_block_ids == []
    assert torch.equal(destination[local_ids].cpu(), source[remote_ids].cpu())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disaggregated_engines_on_cuda_equal_colocated(transport) -> None:
    kwargs = dict(num_kv_blocks=64, device="cuda", hash_seed=0)
    colocated = LLMEngine.from_pretrained("tiny", **kwargs)
    producer = PDConnector(
        KVConnectorConfig(role="producer", transport=transport, allow_insecure=True),
        "prefill",
        "xxh3_128",
        0,
    )
    consumer = PDConnector(
        KVConnectorConfig(role="consumer", transport=transport), "decode", "xxh3_128", 0
    )
    prefill = LLMEngine.from_pretrained("tiny", connector=producer, engine_id="prefill", **kwargs)
    decode = LLMEngine.from_pretrained("tiny", connector=consumer, engine_id="decode", **kwargs)
    prompt = list(range(1, 70))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    prefill.add_request("g0", prompt, first, remote_decode=True)
    finished = None
    while finished is None:
        finished = next((o for o in prefill.step() if o.finished), None)
    # The worker's stream checksums a hand-off off the engine's thread; here, in line.
    handoff = producer.complete_transfer_params(finished.kv_transfer_params)
    decode.add_request("g0", prompt, params, kv_transfer_params=handoff)
    output = None
    while output is None:
        output = next((o for o in decode.step() if o.finished), None)
    assert output.output_token_ids == colocated.generate([prompt], params)[0].output_token_ids
    assert output.kv_provenance.num_pulled_tokens > 0
    assert decode.stats().num_recompute_fallbacks == 0
    for engine in (decode, prefill):
        engine.shutdown()
