"""Structured outputs across the P/D hand-off, on real workers in this process (no Ray; the
KV moves over real gRPC between a PrefillWorker and a DecodeWorker).

The prefill worker samples the first token under the grammar; the decode worker rebuilds
the matcher from the grammar plus that token and continues. Every reply equals the
colocated engine's token for token, for each schema and 20 seeds at temperature 0.8, also
when the pull fails and the decode worker recomputes the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable

import jsonschema
import pytest

from pdserve.decode.worker import DecodeWorker
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.grammar import GrammarSpec
from pdserve.messages.connector_config import KVConnectorConfig
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.generation import GenerationChunk, WorkerRequest
from pdserve.messages.kv_transfer_params import KVTransferParams
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.prefill.worker import PrefillWorker
from tests.engine.structured_schemas import SCHEMAS

SECRET = "a-test-secret-of-enough-length"
ENGINE = dict(model="tiny", num_kv_blocks=512, hash_seed=0)
PROMPT = list(b"Reply with the record as JSON, please: ")
SEEDS = range(20)


def _spec(worker_id: str, role: str) -> WorkerSpec:
    return WorkerSpec(
        worker_id,
        EngineConfig(engine_id=worker_id, **ENGINE),
        KVConnectorConfig(role=role, secret=SECRET),
    )


@pytest.fixture(scope="module")
def workers():
    prefill = PrefillWorker(_spec("prefill-0", "producer"))
    decode = DecodeWorker(_spec("decode-0", "consumer"))
    yield prefill, decode
    decode.engine.shutdown()
    prefill.engine.shutdown()


@pytest.fixture(scope="module")
def colocated() -> LLMEngine:
    return LLMEngine.from_pretrained(**ENGINE)


async def _stream(worker, request: WorkerRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in worker.generate(request)]


async def _disaggregated(
    prefill: PrefillWorker,
    decode: DecodeWorker,
    request_id: str,
    params: SamplingParams,
    prompt: list[int] = PROMPT,
    before_pull: Callable[[KVTransferParams], None] | None = None,
) -> list[int]:
    """The gateway's two phases: the first token on the prefill worker, the rest pulled
    (``before_pull`` sees the hand-off first)."""
    first = await _stream(
        prefill,
        WorkerRequest(
            request_id, prompt, dataclasses.replace(params, max_tokens=1), remote_decode=True
        ),
    )
    hand_off = first[-1].kv_transfer_params
    if hand_off is None:  # the first token already ended the request (grammar complete)
        return [t for chunk in first for t in chunk.new_token_ids]
    if before_pull is not None:
        before_pull(hand_off)
    rest = await _stream(
        decode, WorkerRequest(request_id, prompt, params, kv_transfer_params=hand_off)
    )
    return [t for chunk in rest for t in chunk.new_token_ids]


def _run_all(prefill, decode, params: list[SamplingParams]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return await asyncio.gather(
            *(_disaggregated(prefill, decode, f"r{i}", p) for i, p in enumerate(params))
        )

    return asyncio.run(run())


@pytest.mark.parametrize("name", SCHEMAS)
def test_disaggregated_json_equals_colocated_token_for_token(workers, colocated, name):
    prefill, decode = workers
    schema = SCHEMAS[name]
    spec = GrammarSpec("json_schema", json.dumps(schema))
    params = [
        SamplingParams(max_tokens=160, temperature=0.8, seed=seed, structured=spec)
        for seed in SEEDS
    ]
    structured_before = decode.engine.stats().num_structured_requests
    expected = colocated.generate([PROMPT] * len(params), params)
    got = _run_all(prefill, decode, params)
    assert got == [o.output_token_ids for o in expected]
    for output in expected:
        jsonschema.validate(json.loads(output.text), schema)
    # Every reply went through the decode worker, which rebuilt each one's matcher.
    assert decode.engine.stats().num_structured_requests - structured_before == len(SEEDS)
    assert not prefill.engine.has_unfinished_requests()
    assert not decode.engine.has_unfinished_requests()


def test_a_first_token_that_completes_the_grammar_ends_the_request_on_the_prefill(workers):
    prefill, decode = workers
    params = SamplingParams(
        max_tokens=8, temperature=0.8, seed=3, structured=GrammarSpec.choice(["a", "b"])
    )
    [tokens] = _run_all(prefill, decode, [params])
    assert bytes(tokens) in (b"a", b"b")
    assert prefill.engine.num_leases_held == 0  # finished by its grammar: nothing leased


def test_a_failed_pull_recomputes_and_still_equals_colocated(workers, colocated):
    """The page the decode worker pulls changed after the hand-off: its checksum fails, the
    prompt is recomputed there, and the grammar (already past the first token) goes on."""
    prefill, decode = workers
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["person"]))
    params = SamplingParams(max_tokens=160, temperature=0.8, seed=11, structured=spec)
    prompt = [*PROMPT, *b"(recomputed)"]
    [expected] = colocated.generate([prompt], [params])
    fallbacks_before = decode.engine.stats().num_recompute_fallbacks

    def corrupt_a_page(hand_off: KVTransferParams) -> None:
        prefill.engine.runner.kv_cache[hand_off.block_ids[-1]].view(-1)[3] += 1.0  # unique

    pulled = _disaggregated(prefill, decode, "rc", params, prompt, before_pull=corrupt_a_page)
    assert asyncio.run(pulled) == expected.output_token_ids
    assert decode.engine.stats().num_recompute_fallbacks == fallbacks_before + 1


def test_a_first_token_outside_the_decode_sides_grammar_stops_saying_why(workers):
    """The decode worker's matcher refuses the first token it was handed (here an ``x``,
    where the schema's JSON must open with ``{``; in production: workers with different
    grammar versions): the request ends ``stop`` with the grammar's reason as its
    ``stop_reason``, never a hang or an error, and the prefill worker's lease is freed."""
    prefill, decode = workers
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["person"]))
    params = SamplingParams(max_tokens=32, temperature=0.0, structured=spec)

    async def run() -> tuple[list[GenerationChunk], int]:
        first = await _stream(
            prefill,
            WorkerRequest(
                "bad", PROMPT, dataclasses.replace(params, max_tokens=1), remote_decode=True
            ),
        )
        hand_off = first[-1].kv_transfer_params
        assert hand_off is not None and prefill.engine.num_leases_held == 1
        refused = dataclasses.replace(hand_off, first_token_id=ord("x"))
        chunks = await _stream(
            decode, WorkerRequest("bad", PROMPT, params, kv_transfer_params=refused)
        )
        # The release reaches the prefill worker, whose loop frees the lease's blocks.
        for _ in range(200):
            if prefill.engine.num_leases_held == 0:
                break
            await asyncio.sleep(0.05)
        return chunks, prefill.engine.num_leases_held

    chunks, leases_held = asyncio.run(run())
    last = chunks[-1]
    assert last.finished and last.finish_reason == "stop" and last.error is None
    assert isinstance(last.stop_reason, str) and last.stop_reason.startswith("grammar: ")
    assert [t for c in chunks for t in c.new_token_ids] == [ord("x")]
    assert not decode.engine.has_unfinished_requests()
    assert leases_held == 0
