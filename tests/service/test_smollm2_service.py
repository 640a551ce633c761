"""The built-in real model, SmolLM2-135M-Instruct (GGUF), served disaggregated.

Greedy chat replies through the gateway equal the colocated engine's token for token, on
1 + 1 and 2 + 2 apps, over gRPC and NIXL (the 2 + 2 one decoding speculatively); the official OpenAI client gets "Paris" for the
capital of France, streamed and not; a repeated long system prompt shows cached tokens.
Each smollm2 worker holds ≈ 0.55 GB of fp32 weights, so the shapes run one at a time and
every request of a shape runs concurrently; the Paris and JSON tests reuse the 1 + 1 gRPC
app (``smollm2_app`` redeploys the suite's shared app only when a test asks for another
shape).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from collections.abc import Callable, Iterator

import httpx
import jsonschema
import pytest

from bench.load_driver import is_drained, wait_until_drained
from pdserve.deploy.cluster import base_url
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.grammar import GrammarSpec
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.structured_schemas import SCHEMAS, TOOL_SCHEMAS, TOOLS
from tests.service.service_apps import (
    openai_client,
    running_app,
    skip_without,
    wait_until_ready,
    worker_rows,
)

NUM_KV_BLOCKS = 160  # ≈ 0.7 MiB a block for this model
MAX_TOKENS = 32
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Keep answers short."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    [SYSTEM, {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three primary colours."}],
    [
        SYSTEM,
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1, 2, 3, 4, 5"},
        {"role": "user", "content": "Now count backwards from five."},
    ],
    [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}],
]
# 1+1 gRPC last: the Paris and JSON tests after it run on the same app (from 2+2 gRPC, Serve
# keeps prefill-0 and decode-0). 2+2 over NIXL: tiny's suites. The 2+2 app decodes with
# speculative decoding (ngram): its replies must equal the colocated engine's all the same.
SHAPES = [(1, 1, "nixl"), (2, 2, "grpc"), (1, 1, "grpc")]
SPECULATIVE_SHAPE = (2, 2, "grpc")
Shape = tuple[int, int, str]


@pytest.fixture(scope="module")
def smollm2_app(ray_cluster, smollm2_gguf) -> Iterator[Callable[[Shape], PDServeConfig]]:
    """Deploys a shape on request, keeping the last one: asking for another replaces it."""
    deployed: dict[Shape, PDServeConfig] = {}
    with contextlib.ExitStack() as stack:

        def app(shape: Shape) -> PDServeConfig:
            if shape not in deployed:
                stack.close()
                deployed.clear()
                num_prefill, num_decode, transport = shape
                deployed[shape] = stack.enter_context(
                    running_app(
                        model="smollm2",
                        num_prefill=num_prefill,
                        num_decode=num_decode,
                        transport=transport,
                        num_kv_blocks=NUM_KV_BLOCKS,
                        speculative_method="ngram" if shape == SPECULATIVE_SHAPE else "off",
                    )
                )
            return deployed[shape]

        yield app


@pytest.fixture(scope="module")
def colocated_smollm2(smollm2_gguf) -> Iterator[LLMEngine]:
    """The reference: a colocated engine with the workers' settings, built once here."""
    engine = LLMEngine.from_pretrained("smollm2", num_kv_blocks=NUM_KV_BLOCKS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected_replies(colocated_smollm2) -> list[tuple[str, int]]:
    """(text, completion tokens) of each conversation from the colocated engine, greedy."""
    engine = colocated_smollm2
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.chat_template.render(m), add_special_tokens=False)
        for m in CONVERSATIONS
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [(output.text, len(output.output_token_ids)) for output in outputs]


@pytest.mark.parametrize(
    "num_prefill, num_decode, transport", SHAPES, ids=[f"{p}p{d}d-{t}" for p, d, t in SHAPES]
)
def test_greedy_chat_replies_equal_the_colocated_engine(
    smollm2_app, expected_replies, num_prefill, num_decode, transport
):
    skip_without(transport)
    config = smollm2_app((num_prefill, num_decode, transport))
    report = wait_until_ready(config)
    assert report["ready"] and report["missing_handshakes"] == []
    client = openai_client(config)

    def ask(messages):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return reply.choices[0].message.content, reply.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        replies = list(pool.map(ask, CONVERSATIONS))
    assert replies == expected_replies
    assert "<|im_end|>" not in "".join(text for text, _ in replies)
    assert all(is_drained(w) for w in wait_until_drained(config))
    if (num_prefill, num_decode, transport) == SPECULATIVE_SHAPE:
        decode_rows = [w for w in worker_rows(config).values() if w["role"] == "consumer"]
        assert sum(w["num_spec_decode_accepted_tokens"] for w in decode_rows) > 0
        metrics = httpx.get(base_url(config) + "/metrics", timeout=30).text
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics


def test_openai_chat_answers_paris_and_reports_cached_tokens(smollm2_app):
    config = smollm2_app((1, 1, "grpc"))
    client = openai_client(config)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model="smollm2", messages=question, temperature=0, max_tokens=MAX_TOKENS
    )
    assert "Paris" in whole.choices[0].message.content
    streamed = client.chat.completions.create(
        model="smollm2", messages=question, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in streamed)
    long_system = {
        "role": "system",
        "content": "You answer questions about geography. "
        "Be precise and brief, and name places directly. " * 6,
    }
    for question in ("What is the capital of Italy?", "What is the capital of Spain?"):
        reply = client.chat.completions.create(
            model="smollm2",
            temperature=0,
            max_tokens=8,
            messages=[long_system, {"role": "user", "content": question}],
        )
    # The second question reuses the system prompt's blocks.
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert 16 * 4 <= cached < reply.usage.prompt_tokens
    assert all(is_drained(w) for w in wait_until_drained(config))


def test_smollm2_json_replies_and_tool_calls_validate_and_equal_the_colocated_engine(
    smollm2_app, colocated_smollm2
):
    """The real model through the official client on the 1 + 1 gRPC app: JSON Schema replies
    at temperature 0.8 (3 seeds of two schemas here; tiny's suites run 20 seeds on every
    shape) equal the colocated engine's and validate; greedy ``tool_choice: required`` over
    two tools returns a call of one of them whose arguments validate."""
    config = smollm2_app((1, 1, "grpc"))
    client = openai_client(config)
    engine = colocated_smollm2
    tokenizer = engine.tokenizer
    question = [{"role": "user", "content": "Describe a person called Ada as JSON."}]
    prompt = tokenizer.encode(tokenizer.chat_template.render(question), add_special_tokens=False)
    cases = [(name, seed) for name in ("person", "order") for seed in range(3)]
    expected = engine.generate(
        [prompt] * len(cases),
        [
            SamplingParams(
                max_tokens=128,
                temperature=0.8,
                seed=seed,
                structured=GrammarSpec("json_schema", json.dumps(SCHEMAS[name])),
            )
            for name, seed in cases
        ],
    )

    def ask(case):
        name, seed = case
        return client.chat.completions.create(
            model="smollm2",
            messages=question,
            max_tokens=128,
            temperature=0.8,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
            },
        ).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(ask, cases))
    assert [r.message.content for r in replies] == [o.text for o in expected]
    for (name, _), reply in zip(cases, replies):
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.message.content), SCHEMAS[name])
    called = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=96,
    ).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.tool_calls
    for call in called.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    assert all(is_drained(w) for w in wait_until_drained(config))
