"""The real Gemma 3 270M GGUF (``gemma3-270m``) disaggregated: a prefill engine in its own
process hands its KV over real gRPC and NIXL to a decode engine here, whose tokens equal a
colocated engine's. Gemma 3's six KV groups travel (three global layers, fifteen windowed
to 512 tokens); one prompt is past the window, so its windowed groups hand off only the
blocks the window still reads.

Skipped, with the install command, when the wheels are absent.
"""

from __future__ import annotations

import pytest

from pdserve.engine import LLMEngine, SamplingParams
from tests.kvconnector.disaggregation import assert_decode_idle, disaggregate, make_decode_engine
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

# The prefill holds every prompt's blocks until the decode pulls them: the four fit its pool.
FACTS = " ".join(
    f"Fact {n}: the number {n} squared is {n * n}, and its double is {2 * n}." for n in range(22)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    FACTS + " To sum up the facts above,",
    "Once upon a time, in a small village by the sea,",
]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.8, seed=7),
]


@pytest.fixture(scope="module")
def colocated(gemma3_gguf) -> LLMEngine:
    return LLMEngine.from_pretrained("gemma3-270m", **ENGINE_KWARGS)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gemma3_gguf_decoded_after_a_pull_equals_colocated(
    transport: str, colocated: LLMEngine, prefill_factory
) -> None:
    prefill = prefill_factory(transport=transport, model="gemma3-270m")
    decode = make_decode_engine(transport, model="gemma3-270m")
    prompts = [colocated.tokenizer.encode(prompt) for prompt in PROMPTS]
    assert len(prompts[2]) > 512  # past the window
    expected = [output.output_token_ids for output in colocated.generate(prompts, PARAMS)]
    outputs = disaggregate(prefill, decode, prompts, PARAMS)
    assert [output.output_token_ids for output in outputs] == expected
    transfer = decode.stats().transfer
    assert transfer.num_failed_transfers == 0 and transfer.num_blocks_received > 0
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()
