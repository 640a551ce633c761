"""Who may read a prefill worker's KV blocks, and which blocks: the KV plane's access rules.

    peer ──x-pdserve-secret──▶ every KvTransfer method   (else UNAUTHENTICATED)
    peer ──lease id, block ids──▶ ReadBlocks / HoldBlocks (ids ⊆ that lease, else refused)

A lease id is a bearer capability: 128 random bits (uuid4), scoped to one request's blocks,
ending on release or expiry. And ``cache_salt`` keeps tenants' prefix caches apart: the
same prompt under another salt hits nothing, on the prefill side and in the decode side's
dedup. Everything here runs in one process on loopback.
"""

from __future__ import annotations

import re
import uuid

import grpc
import pytest
import torch

from pdserve.cache import BlockHasher
from pdserve.deploy.config import KV_TRANSFER_SECRET_ENV, PDServeConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.pd.lease import LeaseTable
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.kvconnector.transport.base import SECRET_METADATA_KEY, TransferError
from pdserve.kvconnector.transport.grpc_client import GrpcTransferClient
from pdserve.kvconnector.transport.grpc_server import GrpcTransferServer
from pdserve.kvconnector.transport.layout import KVLayout
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.proto import kv_transfer_pb2 as pb

SECRET = "test-secret-0123456789abcdef"
BLOCK_SIZE = 16
ENGINE_KWARGS = dict(block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_batched_tokens=256)
GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)
PROMPT_A = list(range(3, 3 + 40))
PROMPT_B = list(range(100, 100 + 40))


def producer_engine(secret: str | None = SECRET) -> LLMEngine:
    connector = PDConnector(
        KVConnectorConfig(role="producer", secret=secret),
        engine_id="prefill-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    return LLMEngine.from_pretrained(
        "tiny", connector=connector, engine_id="prefill-0", **ENGINE_KWARGS
    )


def consumer_engine(secret: str | None = SECRET) -> LLMEngine:
    connector = PDConnector(
        KVConnectorConfig(role="consumer", secret=secret),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed=0,
    )
    return LLMEngine.from_pretrained(
        "tiny", connector=connector, engine_id="decode-0", **ENGINE_KWARGS
    )


def run(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, **kwargs: object
):
    engine.add_request(request_id, prompt, params, **kwargs)
    for _ in range(10_000):
        done = [o for o in engine.step() if o.request_id == request_id and o.finished]
        if done:
            if done[0].kv_transfer_params is not None:  # as the worker's stream does
                engine.connector.complete_transfer_params(done[0].kv_transfer_params)
            return done[0]
    raise AssertionError(f"{request_id} did not finish")


def client_for(engine: LLMEngine, secret: str | None) -> tuple[GrpcTransferClient, torch.Tensor]:
    local = torch.zeros_like(engine.runner.kv_cache)
    client = GrpcTransferClient(
        local,
        KVLayout.from_kv_cache(local, "xxh3_128", 0, engine.model_config.fingerprint),
        engine_id="decode-x",
        secret=secret,
        timeout_s=5.0,
    )
    return client, local


@pytest.fixture(scope="module")
def prefill() -> LLMEngine:
    engine = producer_engine()
    yield engine
    engine.connector.shutdown()


# ---------------------------------------------------------------- the deployment secret


def test_a_producer_without_a_secret_refuses_to_start_unless_explicitly_insecure():
    with pytest.raises(ValueError, match="without a deployment secret"):
        PDConnector(KVConnectorConfig(role="producer"), "prefill-0", "xxh3_128", 0)
    PDConnector(KVConnectorConfig(role="producer", allow_insecure=True), "prefill-0", "xxh3_128", 0)
    PDConnector(KVConnectorConfig(role="consumer"), "decode-0", "xxh3_128", 0)


def test_the_secret_never_appears_in_a_config_repr():
    config = PDServeConfig(kv_transfer_secret=SECRET, hash_seed=0)
    spec = config.worker_spec("producer", 0)
    assert SECRET not in repr(config) and SECRET not in repr(spec)
    assert SECRET not in repr(spec.connector) and spec.connector.secret == SECRET


def test_a_deployment_always_resolves_one_secret_for_all_its_workers(monkeypatch):
    monkeypatch.delenv(KV_TRANSFER_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="KV-transfer secret"):
        PDServeConfig(hash_seed=0).worker_spec("producer", 0)
    resolved = PDServeConfig(num_prefill=2, num_decode=2).resolve_deployment_secrets()
    secret = resolved.kv_transfer_secret
    assert secret and len(secret) >= 43  # token_urlsafe(32): 256 random bits
    assert secret != PDServeConfig().resolve_kv_transfer_secret().kv_transfer_secret
    specs = [resolved.worker_spec(role, i) for role in ("producer", "consumer") for i in (0, 1)]
    assert {spec.connector.secret for spec in specs} == {secret}
    assert PDServeConfig(num_decode=0).resolve_kv_transfer_secret().kv_transfer_secret is None

    monkeypatch.setenv(KV_TRANSFER_SECRET_ENV, "from-the-environment-0123")
    assert (
        PDServeConfig().resolve_kv_transfer_secret().kv_transfer_secret
        == "from-the-environment-0123"
    )
    assert (
        PDServeConfig(kv_transfer_secret=SECRET).resolve_kv_transfer_secret().kv_transfer_secret
        == SECRET
    )  # the configured one wins


def test_the_hash_seed_is_random_per_app_unless_configured_and_shared_by_every_worker():
    seeds = {PDServeConfig().resolve_deployment_secrets().hash_seed for _ in range(3)}
    assert len(seeds) == 3 and all(0 <= seed < 2**63 for seed in seeds)
    assert PDServeConfig(hash_seed=5).resolve_deployment_secrets().hash_seed == 5
    # sha256 resists collisions without a secret seed.
    assert PDServeConfig(hash_algorithm="sha256").resolve_deployment_secrets().hash_seed == 0
    resolved = PDServeConfig(num_prefill=2, num_decode=2).resolve_deployment_secrets()
    specs = [resolved.worker_spec(role, i) for role in ("producer", "consumer") for i in (0, 1)]
    assert {spec.engine.hash_seed for spec in specs} == {resolved.hash_seed}
    with pytest.raises(ValueError, match="hash seed"):
        PDServeConfig(kv_transfer_secret=SECRET).worker_spec("producer", 0)


def test_a_weak_or_mistyped_configured_secret_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="at least 16"):
        PDServeConfig(kv_transfer_secret="short")
    with pytest.raises(ValueError, match="must be a string"):
        PDServeConfig.model_validate({"kv_transfer_secret": 12345678901234567890})
    monkeypatch.setenv(KV_TRANSFER_SECRET_ENV, "short")
    with pytest.raises(ValueError, match=KV_TRANSFER_SECRET_ENV):
        PDServeConfig().resolve_kv_transfer_secret()


def test_a_numeric_secret_flag_stays_a_string():
    import argparse

    parser = argparse.ArgumentParser()
    PDServeConfig.add_cli_flags(parser)
    config = PDServeConfig.from_cli(parser.parse_args(["--kv-transfer-secret", "1" * 20]))
    assert config.kv_transfer_secret == "1" * 20


def _kv_transfer_methods():
    return list(pb.DESCRIPTOR.services_by_name["KvTransfer"].methods)


def _call(channel: grpc.Channel, method, metadata) -> grpc.StatusCode:
    """Calls one KvTransfer method with an empty request; returns the status it ended with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    request = b""  # an empty message of any type
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    call = kinds[(method.client_streaming, method.server_streaming)](
        path, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
    )
    argument = iter([request]) if method.client_streaming else request
    try:
        reply = call(argument, timeout=5.0, metadata=metadata)
        if method.server_streaming:
            list(reply)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_every_kv_transfer_method_refuses_a_missing_or_wrong_secret():
    kv_cache = torch.zeros(4, 1, 2, BLOCK_SIZE, 1, 8)
    leases = LeaseTable()
    lease = leases.grant("r", [1, 2], [], [0, 0])
    layout = KVLayout.from_kv_cache(kv_cache, "xxh3_128", 0)
    server = GrpcTransferServer(kv_cache, leases, layout, engine_id="p", secret=SECRET)
    methods = _kv_transfer_methods()
    assert {m.name for m in methods} >= {
        "Handshake",
        "ReadBlocks",
        "HoldBlocks",
        "RenewLease",
        "Release",
    }
    try:
        with grpc.insecure_channel(server.address) as channel:
            for method in methods:
                for metadata in [
                    (),
                    ((SECRET_METADATA_KEY, "wrong-" + SECRET),),
                    ((SECRET_METADATA_KEY, SECRET[:-1]),),
                ]:
                    assert _call(channel, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, (
                        method.name,
                        metadata,
                    )
                # With the secret the call gets past authorization (an empty lease id is unknown).
                assert _call(channel, method, ((SECRET_METADATA_KEY, SECRET),)) != (
                    grpc.StatusCode.UNAUTHENTICATED
                ), method.name
        assert leases.renew(lease.lease_id) > 0  # nothing the refused calls did touched it
    finally:
        server.stop(0)


# ---------------------------------------------------------------- leases are capabilities


def test_lease_ids_are_random_128_bit_tokens():
    leases = LeaseTable()
    ids = {leases.grant(f"g{i}", [], [], []).lease_id for i in range(64)}
    assert len(ids) == 64
    for lease_id in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", lease_id) and uuid.UUID(lease_id).version == 4


def test_a_peer_with_the_secret_reads_only_the_blocks_under_the_lease_it_was_given(prefill):
    first = run(
        prefill, "tenant-a-req", PROMPT_A, GREEDY_ONE, remote_decode=True, cache_salt="tenant-a"
    ).kv_transfer_params
    second = run(
        prefill, "tenant-b-req", PROMPT_B, GREEDY_ONE, remote_decode=True, cache_salt="tenant-b"
    ).kv_transfer_params
    assert not set(first.block_ids) & set(second.block_ids)
    n = len(first.block_ids)
    local_ids = list(range(1, n + 1))
    other, local = client_for(prefill, SECRET)  # a second decode peer: right secret, B's lease only
    try:
        peer = other.handshake(first.transfer_address)
        with pytest.raises(TransferError, match="PERMISSION_DENIED"):
            other.read_blocks(
                peer, second.lease_id, first.block_ids, local_ids, first.block_checksums
            )
        with pytest.raises(TransferError, match="PERMISSION_DENIED"):  # one foreign id is enough
            other.read_blocks(
                peer,
                second.lease_id,
                second.block_ids[:1] + first.block_ids[:1],
                [1, 2],
                second.block_checksums[:1] + first.block_checksums[:1],
            )
        with pytest.raises(TransferError, match="NOT_FOUND"):  # a guessed lease id
            other.read_blocks(
                peer, uuid.uuid4().hex, first.block_ids, local_ids, first.block_checksums
            )
        with pytest.raises(TransferError, match="NOT_FOUND"):
            other.renew(peer, uuid.uuid4().hex)
        # The holder of A's lease reads A's blocks, byte for byte.
        result = other.read_blocks(
            peer, first.lease_id, first.block_ids, local_ids, first.block_checksums
        )
        assert result.failed_block_ids == [] and len(result.ok_block_ids) == n
        assert torch.equal(local[local_ids], prefill.runner.kv_cache[first.block_ids])
        # Once released, the capability is gone.
        other.release(peer, first.lease_id)
        with pytest.raises(TransferError, match="FAILED_PRECONDITION|NOT_FOUND"):
            other.read_blocks(
                peer, first.lease_id, first.block_ids, local_ids, first.block_checksums
            )
        other.release(peer, second.lease_id)
    finally:
        other.close()
    for _ in range(3):
        prefill.step()
    assert prefill.connector.leases.take_freeable() == [] and len(prefill.connector.leases) == 0


def test_a_peer_without_the_secret_cannot_even_handshake(prefill):
    outsider, _ = client_for(prefill, None)
    try:
        with pytest.raises(TransferError, match="UNAUTHENTICATED"):
            outsider.handshake(prefill.connector.address)
    finally:
        outsider.close()


# ---------------------------------------------------------------- cache_salt


def test_no_prefix_hit_crosses_salts_and_the_same_salt_hits():
    engine = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    assert run(engine, "a1", PROMPT_A, GREEDY_ONE, cache_salt="tenant-a").num_cached_tokens == 0
    assert run(engine, "b1", PROMPT_A, GREEDY_ONE, cache_salt="tenant-b").num_cached_tokens == 0
    assert run(engine, "n1", PROMPT_A, GREEDY_ONE).num_cached_tokens == 0  # unsalted: its own
    hit = run(engine, "a2", PROMPT_A, GREEDY_ONE, cache_salt="tenant-a").num_cached_tokens
    assert hit == (len(PROMPT_A) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert run(engine, "b2", PROMPT_A, GREEDY_ONE, cache_salt="tenant-b").num_cached_tokens == hit


def test_salted_transfer_params_carry_salted_hashes_and_decode_dedup_respects_the_salt(prefill):
    decode = consumer_engine()
    colocated = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    hasher = BlockHasher("xxh3_128", 0)
    try:
        expected = run(colocated, "ref", PROMPT_B, params).output_token_ids
        outputs, dedup = {}, {}
        for index, salt in enumerate(["tenant-a", "tenant-b", "tenant-a"]):
            request_id = f"pd-{index}"
            prefilled = run(
                prefill,
                request_id,
                PROMPT_B,
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=1),
                remote_decode=True,
                cache_salt=salt,
            )
            transfer = prefilled.kv_transfer_params
            assert (
                transfer.block_hashes
                == hasher.hash_request_blocks(PROMPT_B, BLOCK_SIZE, cache_salt=salt)[
                    : len(PROMPT_B) // BLOCK_SIZE
                ]
            )
            before = decode.connector.stats.snapshot().num_dedup_skipped_blocks
            outputs[index] = run(
                decode, request_id, PROMPT_B, params, cache_salt=salt, kv_transfer_params=transfer
            )
            dedup[index] = decode.connector.stats.snapshot().num_dedup_skipped_blocks - before
            for _ in range(5):
                prefill.step()
        assert [outputs[i].output_token_ids for i in range(3)] == [expected] * 3
        # tenant-b's blocks are not tenant-a's, though their tokens are equal
        assert dedup == {0: 0, 1: 0, 2: len(PROMPT_B) // BLOCK_SIZE}

        # A decode request that lost its salt on the way gets no peer blocks cached under
        # the wrong (unsalted) hashes: it recomputes its prompt, and still answers right.
        received = decode.connector.stats.snapshot().num_blocks_received
        transfer = run(
            prefill,
            "pd-unsalted",
            PROMPT_B,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=1),
            remote_decode=True,
            cache_salt="tenant-c",
        ).kv_transfer_params
        unsalted = run(decode, "pd-unsalted", PROMPT_B, params, kv_transfer_params=transfer)
        assert unsalted.output_token_ids == expected
        assert decode.connector.stats.snapshot().num_blocks_received == received
    finally:
        decode.connector.shutdown()
