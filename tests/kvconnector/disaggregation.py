"""Helpers of the P/D engine tests: a decode engine with a consumer connector, prompts that
share system prefixes, and the loop that prefills remotely and decodes locally."""

from __future__ import annotations

import dataclasses
import random
import time

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.kvconnector.pd.pd_connector import PDConnector
from pdserve.messages.connector_config import KVConnectorConfig
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS, PrefillProcess


def make_decode_engine(transport: str = "grpc", **overrides: object) -> LLMEngine:
    policy = overrides.pop("failure_policy", "recompute")
    timeout_s = overrides.pop("transfer_timeout_s", 10.0)
    hash_seed = overrides.pop("hash_seed", 0)
    model = str(overrides.pop("model", "tiny"))
    connector = PDConnector(
        KVConnectorConfig(
            role="consumer",
            transport=transport,
            failure_policy=policy,
            transfer_timeout_s=timeout_s,
        ),
        engine_id="decode-0",
        hash_algorithm="xxh3_128",
        hash_seed=hash_seed,
    )
    return LLMEngine.from_pretrained(
        model,
        connector=connector,
        hash_seed=hash_seed,
        engine_id="decode-0",
        **{**ENGINE_KWARGS, **overrides},
    )


def random_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts sharing system prefixes, lengths not multiples of the block size."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(rng.choice([32, 45, 70]))] for _ in range(2)]
    return [
        rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(1, 50))]
        for _ in range(count)
    ]


def disaggregate(
    prefill: PrefillProcess,
    decode: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    prefix: str = "r",
) -> list[RequestOutput]:
    """Runs each prompt's prefill remotely (one token, as the gateway asks it: a windowed
    group's prompt blocks would leave the window under more), then decodes all of them in
    one batch."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for request_id, prompt, request_params in zip(ids, prompts, params):
        first_token = dataclasses.replace(request_params, max_tokens=1)
        prefilled = prefill.prefill(request_id, prompt, first_token)
        assert prefilled.kv_transfer_params is not None, prefilled
        decode.add_request(
            request_id, prompt, request_params, kv_transfer_params=prefilled.kv_transfer_params
        )
    return run_to_completion(decode, ids)


def run_to_completion(
    engine: LLMEngine, ids: list[str], timeout_s: float = 60.0
) -> list[RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(ids):
        assert time.monotonic() < deadline, f"requests {set(ids) - set(finished)} hang"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[request_id] for request_id in ids]


def assert_decode_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0
    assert not engine.connector.has_pending_loads()
