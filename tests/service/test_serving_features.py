"""Serving features on a 1 + 1 app over gRPC and a 2 + 2 app over NIXL: ``n`` choices (the prompt
prefilled once, each choice its own seed), readiness, logprobs, structured outputs and tools,
each shape deployed once for the module's tests.

References are the colocated engine's outputs for the same prompt and seeds: choice ``i``
of ``n=3, seed=s`` equals a request with seed ``s + i``.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import grpc
import httpx
import jsonschema
import pytest

from bench.load_driver import get_json, is_drained, wait_until_drained
from pdserve.deploy.cluster import base_url
from pdserve.grammar import GrammarSpec
from pdserve.messages.sampling_params import SamplingParams
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.engine.structured_schemas import SCHEMAS, TOOL_SCHEMAS, TOOLS
from tests.ports import free_port
from tests.service.service_apps import anthropic_client, openai_client, running_shape

# Both shapes and both transports, in two apps (each app costs 15-25 s to start on 2 cores;
# 2+2 over gRPC runs in the fault matrix, 1+1 over NIXL in the smollm2 suite).
SHAPES = [(1, 1, "grpc"), (2, 2, "nixl")]
PROMPT = "Parallel sampling: one prompt, prefilled once and leased once, decoded n times. "
GRPC_PORT = free_port()


@pytest.fixture(scope="module", params=SHAPES, ids=[f"{p}p{d}d-{t}" for p, d, t in SHAPES])
def app(request, ray_cluster):
    with running_shape(*request.param, grpc_port=GRPC_PORT) as config:
        yield config


@pytest.fixture
def one_app(app):
    """The 1 + 1 gRPC app only, for what does not depend on the P/D shape (a request's
    parsing, an API surface's rendering over the chat path): run on the 2 + 2 app too, it
    would add to the suite's time and nothing to what is checked."""
    if app.num_prefill > 1:
        pytest.skip("shape-independent: checked on the 1 + 1 app")
    return app


def colocated_texts(colocated, prompt: str, seeds: list[int | None], **sampling) -> list[str]:
    return [
        colocated.generate([prompt], SamplingParams(seed=seed, **sampling))[0].text
        for seed in seeds
    ]


def test_n_choices_with_a_seed_equal_the_colocated_engine_with_seeds_s_s1_s2(app, colocated):
    sampling = dict(max_tokens=10, temperature=0.9)
    before = get_json(app, "/stats")["totals"]
    reply = openai_client(app).completions.create(
        model="tiny", prompt=PROMPT, n=3, seed=41, **sampling
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == colocated_texts(
        colocated, PROMPT, [41, 42, 43], **sampling
    )
    assert reply.usage.completion_tokens == 30
    assert reply.usage.prompt_tokens == len(colocated.tokenizer.encode(PROMPT))
    after = get_json(app, "/stats")["totals"]
    # One prefill, one pull: the prompt's blocks moved once, whatever n is.
    num_prompt_blocks = -(-reply.usage.prompt_tokens // 16)
    assert after["num_blocks_received"] - before["num_blocks_received"] <= num_prompt_blocks
    assert all(is_drained(w) for w in wait_until_drained(app))


def test_streamed_choices_interleave_by_index_and_greedy_choices_are_equal(app, colocated):
    sampling = dict(max_tokens=8, temperature=0.0)
    (expected,) = colocated_texts(colocated, PROMPT, [None], **sampling)
    chunks = list(
        openai_client(app).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1]
    assert chunks[-1].usage.completion_tokens == 16
    whole = openai_client(app).completions.create(model="tiny", prompt=PROMPT, n=2, **sampling)
    assert [c.text for c in whole.choices] == [expected, expected]


def test_grpc_generate_streams_each_choice_with_its_index(app, colocated):
    sampling = dict(max_tokens=6, temperature=0.8)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        replies = list(
            generate_pb2_grpc.GenerateStub(channel).Generate(
                generate_pb2.GenerateRequest(text=PROMPT, n=2, seed=7, **sampling), timeout=60
            )
        )
    texts = ["".join(r.text for r in replies if r.index == i) for i in (0, 1)]
    assert texts == colocated_texts(colocated, PROMPT, [7, 8], **sampling)


def test_grpc_generate_returns_each_tokens_logprobs_equal_to_the_colocated_engines(app, colocated):
    output = colocated.generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
    )[0]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        replies = list(
            stub.Generate(
                generate_pb2.GenerateRequest(
                    text=PROMPT, max_tokens=5, temperature=0.0, logprobs=2
                ),
                timeout=60,
            )
        )
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.Generate(generate_pb2.GenerateRequest(text=PROMPT, logprobs=21)))
    assert (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "logprobs" in caught.value.details()
    )
    got = [entry for reply in replies for entry in reply.logprobs]
    assert (
        [e.token_id for e in got]
        == [t for r in replies for t in r.token_ids]
        == output.output_token_ids
    )
    assert [e.logprob for e in got] == pytest.approx(
        [e.logprob for e in output.output_logprobs], abs=1e-4
    )
    assert [[(t.token_id, t.logprob) for t in e.top] for e in got] == [
        [(t, pytest.approx(lp, abs=1e-4)) for t, lp in e.top] for e in output.output_logprobs
    ]


@pytest.mark.parametrize("field, value", [("n", 0), ("n", 17), ("best_of", 2)])
def test_bad_n_is_a_400_naming_the_field(app, field, value):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, field: value}
    response = httpx.post(base_url(app) + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def colocated_logprobs(colocated, prompt, **sampling):
    output = colocated.generate([prompt], SamplingParams(**sampling))[0]
    return output, output.output_logprobs


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.9, seed=3)], ids=["greedy", "seeded"]
)
def test_completion_logprobs_equal_the_colocated_engines_streamed_and_not(app, colocated, sampling):
    output, expected = colocated_logprobs(colocated, PROMPT, max_tokens=6, logprobs=3, **sampling)
    decode = colocated.tokenizer.decode
    client = openai_client(app)
    whole = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, **sampling)
        .choices[0]
        .logprobs
    )
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, stream=True, **sampling
        )
        if c.choices and c.choices[0].logprobs
    ]
    for got in (whole, _concat(streamed)):
        assert got.tokens == [decode([e.token_id]) for e in expected]
        assert got.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
        for top, entry in zip(got.top_logprobs, expected):
            # OpenAI keys alternatives by text: ids that decode alike share a key.
            assert len(entry.top) == 3 and top == pytest.approx(
                {decode([t]): lp for t, lp in entry.top}, abs=1e-4
            )
    # The first token's logprob is the prefill worker's, the rest the decode worker's.
    assert len(whole.tokens) == len(output.output_token_ids) == 6


def _concat(pieces):
    class Joined:
        tokens = [t for p in pieces for t in p.tokens]
        token_logprobs = [lp for p in pieces for lp in p.token_logprobs]
        top_logprobs = [top for p in pieces for top in p.top_logprobs]

    return Joined


def test_chat_logprobs_and_top_logprobs_equal_the_colocated_engines(app, colocated):
    messages = [{"role": "user", "content": PROMPT}]
    tokenizer = colocated.tokenizer
    prompt_ids = tokenizer.encode(
        tokenizer.chat_template.render(messages), add_special_tokens=False
    )
    _, expected = colocated_logprobs(
        colocated, prompt_ids, max_tokens=5, logprobs=2, temperature=0.0
    )
    reply = openai_client(app).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([e.token_id]) for e in expected]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert [t.logprob for c in content for t in c.top_logprobs] == pytest.approx(
        [lp for e in expected for _, lp in e.top], abs=1e-4
    )
    assert [len(c.top_logprobs) for c in content] == [2] * len(expected)
    assert content[0].bytes == list(content[0].token.encode())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field(app, path, body, param):
    response = httpx.post(
        base_url(app) + path, json={"model": "tiny", "max_tokens": 2, **body}, timeout=60
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_echo_with_logprobs_returns_the_prompts_logprobs_computed_on_the_prefill_worker(
    app, colocated
):
    output = colocated.generate(
        [PROMPT], SamplingParams(max_tokens=4, temperature=0, logprobs=1, prompt_logprobs=1)
    )[0]
    decode = colocated.tokenizer.decode
    client = openai_client(app)
    for _ in range(2):  # the repeat would be a prefix hit: prompt logprobs skip the cache
        reply = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True
        )
        choice = reply.choices[0]
        assert choice.text == PROMPT + output.text
        prompt_ids, output_ids = output.prompt_token_ids, output.output_token_ids
        assert choice.logprobs.tokens == [decode([t]) for t in prompt_ids + output_ids]
        assert choice.logprobs.token_logprobs[0] is None
        expected = [e.logprob for e in output.prompt_logprobs[1:] + output.output_logprobs]
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        prefill = reply.model_extra["kv_provenance"]["prefill"]
        assert prefill["num_cache_hit_tokens"] == 0 and prefill["num_computed_tokens"] == len(
            prompt_ids
        )
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + output.text


def _vllm_prompt_logprobs(colocated, entries) -> list:
    """vLLM's shape of the colocated engine's prompt logprobs (token ids as string keys)."""
    decode = colocated.tokenizer.decode
    rendered: list = [None]
    for entry in entries[1:]:
        position = {
            str(t): {"logprob": lp, "rank": rank, "decoded_token": decode([t])}
            for rank, (t, lp) in enumerate(entry.top, start=1)
        }
        position[str(entry.token_id)] = {
            "logprob": entry.logprob,
            "rank": entry.rank,
            "decoded_token": decode([entry.token_id]),
        }
        rendered.append(position)
    return rendered


def test_prompt_logprobs_come_from_the_prefill_worker_in_vllms_shape(app, colocated):
    """Completions: in each choice; chat: at the top level; streamed: with the first chunk.
    Equal to the colocated engine's (which equals transformers': tests/engine)."""
    output = colocated.generate(
        [PROMPT], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    )[0]
    expected = _vllm_prompt_logprobs(colocated, output.prompt_logprobs)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    reply = httpx.post(
        base_url(app) + "/v1/completions", json={**body, "prompt_logprobs": 2, "n": 2}, timeout=60
    ).json()
    for choice in reply["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(expected)
        for position, want in zip(got[1:], expected[1:]):
            assert position.keys() == want.keys()
            for token, entry in want.items():
                assert position[token]["rank"] == entry["rank"]
                assert position[token]["decoded_token"] == entry["decoded_token"]
                assert position[token]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    streamed = httpx.post(
        base_url(app) + "/v1/completions",
        json={**body, "prompt_logprobs": 2, "stream": True},
        timeout=60,
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    carrying = [c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(carrying) == 1 and len(carrying[0]["choices"][0]["prompt_logprobs"]) == len(expected)
    messages = [{"role": "user", "content": PROMPT}]
    chat = httpx.post(
        base_url(app) + "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": 1},
        timeout=60,
    ).json()
    assert (
        chat["prompt_logprobs"][0] is None
        and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    )
    assert all(is_drained(w) for w in wait_until_drained(app))


# ---------------------------------------------------------------- structured outputs and tools

STRUCTURED_SEEDS = range(20)


def _schema_replies(app, schema: dict) -> list[tuple[str, str]]:
    """(whole, streamed) completion text per seed, through the official client."""
    client = openai_client(app)
    extra = {"structured_outputs": {"json": schema}}

    def ask(seed: int) -> tuple[str, str]:
        fields = dict(model="tiny", prompt=PROMPT, max_tokens=160, temperature=0.8, seed=seed)
        whole = client.completions.create(**fields, extra_body=extra).choices[0].text
        stream = client.completions.create(**fields, extra_body=extra, stream=True)
        return whole, "".join(chunk.choices[0].text for chunk in stream)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, STRUCTURED_SEEDS))


@pytest.mark.parametrize("name", ["person", "order"])
def test_json_schema_replies_validate_and_equal_the_colocated_engine_streamed_and_not(
    app, colocated, name
):
    schema = SCHEMAS[name]
    spec = GrammarSpec("json_schema", json.dumps(schema))
    expected = colocated.generate(
        [PROMPT] * len(STRUCTURED_SEEDS),
        [
            SamplingParams(max_tokens=160, temperature=0.8, seed=seed, structured=spec)
            for seed in STRUCTURED_SEEDS
        ],
    )
    replies = _schema_replies(app, schema)
    assert [whole for whole, _ in replies] == [o.text for o in expected]
    assert all(whole == streamed for whole, streamed in replies)
    for whole, _ in replies:
        jsonschema.validate(json.loads(whole), schema)
    assert all(is_drained(w) for w in wait_until_drained(app))


def test_choice_regex_and_n3_json_object_replies_always_match(app):
    client = openai_client(app)
    choices = ["alpha", "beta", "gamma"]
    for seed in range(5):
        picked = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            temperature=0.8,
            seed=seed,
            max_tokens=10,
            extra_body={"guided_choice": choices},
        )
        assert picked.choices[0].text in choices and picked.choices[0].finish_reason == "stop"
        code = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0.8,
            seed=seed,
            max_tokens=12,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        )
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].message.content)
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        n=3,
        seed=5,
        temperature=0.8,
        max_tokens=160,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMAS["person"]},
        },
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["person"])


def test_tool_choice_required_returns_a_valid_call_streamed_and_not(app):
    client = openai_client(app)
    fields = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )
    whole = client.chat.completions.create(**fields)
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert call.function.name in TOOL_SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    names, arguments, reasons = [], "", []
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
    assert names == [call.function.name] and arguments == call.function.arguments
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize(
    "endpoint, body, param",
    [
        ("/v1/completions", {"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
        ("/v1/completions", {"guided_json": {"type": "wat"}}, "guided_json"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
                ]
            },
            "tools.0.function.parameters",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "pattern": "x" * 70000},
                    },
                }
            },
            "response_format.json_schema",
        ),
    ],
    ids=["bad-regex", "bad-schema", "unknown-tool", "bad-parameters", "huge-schema"],
)
def test_bad_structured_input_is_a_400_naming_the_field_and_leaks_nothing(
    app, endpoint, body, param
):
    prompt = (
        {"prompt": PROMPT}
        if endpoint == "/v1/completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    reply = httpx.post(
        base_url(app) + endpoint, json={"model": "tiny", **prompt, **body}, timeout=30
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert all(is_drained(w) for w in wait_until_drained(app))


def test_grpc_generate_takes_structured_outputs_and_refuses_a_bad_one(app, colocated):
    spec = GrammarSpec("regex", "[a-z]{3}-[0-9]{2}")
    (expected,) = colocated_texts(
        colocated, PROMPT, [9], max_tokens=12, temperature=0.8, structured=spec
    )
    before = get_json(app, "/stats")["totals"]["num_structured_requests"]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        replies = stub.Generate(
            generate_pb2.GenerateRequest(
                text=PROMPT,
                max_tokens=12,
                temperature=0.8,
                seed=9,
                structured_outputs=generate_pb2.StructuredOutputs(regex=spec.source),
            ),
            timeout=60,
        )
        assert "".join(r.text for r in replies) == expected
        bad = generate_pb2.GenerateRequest(
            text=PROMPT, structured_outputs=generate_pb2.StructuredOutputs(regex="([a-z")
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(bad, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unclosed" in refused.value.details()
    # The prefill and the decode worker each counted it.
    after = get_json(app, "/stats")["totals"]["num_structured_requests"]
    assert after - before == 2


PENALIZED = dict(
    max_tokens=12,
    temperature=0.8,
    frequency_penalty=0.9,
    presence_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias={"101": 4.0, "32": -100.0},
    min_p=0.05,
    min_tokens=6,
)


def test_penalties_and_logits_fields_with_n_choices_equal_the_colocated_engine(app, colocated):
    """Across the hand-off, each choice its own seed: the decode worker counts the prompt
    and the prefill's first token as the colocated engine does."""
    reply = openai_client(app).completions.create(
        model="tiny",
        prompt=PROMPT,
        n=2,
        seed=7,
        max_tokens=12,
        temperature=0.8,
        extra_body={k: v for k, v in PENALIZED.items() if k not in ("max_tokens", "temperature")},
    )
    params = {**PENALIZED, "logit_bias": {101: 4.0, 32: -100.0}}
    assert [c.text for c in reply.choices] == colocated_texts(colocated, PROMPT, [7, 8], **params)
    assert all(is_drained(w) for w in wait_until_drained(app))


def test_a_langchain_payload_with_neutral_penalties_is_answered(one_app, colocated):
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0.0,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "n": 1,
        "stream": False,
    }
    reply = httpx.post(base_url(one_app) + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = colocated_texts(colocated, PROMPT, [None], max_tokens=6, temperature=0.0)
    assert [reply.json()["choices"][0]["text"]] == expected


@pytest.mark.parametrize(
    "field, value",
    [  # one of each kind of check; tests/gateway/test_sampling_fields_api.py has the rest
        ("presence_penalty", 2.5),
        ("logit_bias", {"five": 1}),
        ("allowed_token_ids", [999999]),
        ("min_tokens", 50),
    ],
)
def test_bad_sampling_fields_are_a_400_naming_the_field_and_leak_nothing(one_app, field, value):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, field: value}
    reply = httpx.post(base_url(one_app) + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    assert all(is_drained(w) for w in wait_until_drained(one_app))


# ---------------------------------------------------------------- Anthropic's Messages API

ANTHROPIC_TOOLS = [
    {"name": name, "description": f"the {name} tool", "input_schema": schema}
    for name, schema in TOOL_SCHEMAS.items()
]


def test_anthropic_messages_equal_the_openai_chat_streamed_and_not(app):
    """The official SDK: create and stream give the text OpenAI's chat endpoint gives the
    same conversation (greedy), across the hand-off; usage counts the prompt as chat does."""
    conversation = [{"role": "user", "content": PROMPT}]
    chat = openai_client(app).chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, *conversation],
        max_tokens=12,
        temperature=0,
    )
    client = anthropic_client(app)
    fields = dict(model="tiny", system="Be brief.", messages=conversation, max_tokens=12)
    greedy = {"temperature": 0}  # this SDK has no temperature argument: the API still takes it
    message = client.messages.create(**fields, extra_body=greedy)
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert (
        message.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(**fields, extra_body=greedy) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text and final.stop_reason == message.stop_reason
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=conversation)
    assert counted.input_tokens == chat.usage.prompt_tokens
    assert all(is_drained(w) for w in wait_until_drained(app))


def test_anthropic_tool_choice_any_returns_a_tool_use_whose_input_validates(app):
    client = anthropic_client(app)
    fields = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"},
        max_tokens=120,
        extra_body={"temperature": 0},
    )
    message = client.messages.create(**fields)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) >= 1 and message.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, TOOL_SCHEMAS[uses[0].name])
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    streamed_uses = [block for block in final.content if block.type == "tool_use"]
    assert [(u.name, u.input) for u in streamed_uses] == [(u.name, u.input) for u in uses]
    # The tool's answer goes back as a tool_result of that tool_use's id.
    follow_up = client.messages.create(
        model="tiny",
        max_tokens=4,
        tools=ANTHROPIC_TOOLS,
        messages=[
            *fields["messages"],
            {"role": "assistant", "content": [u.model_dump() for u in uses]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}],
            },
        ],
    )
    assert follow_up.type == "message"
    assert all(is_drained(w) for w in wait_until_drained(app))


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "image",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                    }
                ],
            },
            "toolu_x",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "hi"}],
            },
            "thinking",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "anthropic-version": "2023-01-01",  # sent as the header: before Messages
            },
            "anthropic-version: '2023-01-01'",
        ),
    ],
    ids=["unknown-block", "unmatched-tool-use-id", "no-max-tokens", "thinking", "version"],
)
def test_bad_anthropic_input_is_a_400_in_anthropics_shape(one_app, body, message):
    body = dict(body)
    headers = {"anthropic-version": body.pop("anthropic-version", "2023-06-01")}
    reply = httpx.post(
        base_url(one_app) + "/v1/messages",
        json={"model": "tiny", **body},
        headers=headers,
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]
    assert all(is_drained(w) for w in wait_until_drained(one_app))


# ---------------------------------------------------------------- OpenAI's Responses API


def _chat_reply(app, messages, **fields):
    return openai_client(app).chat.completions.create(
        model="tiny", messages=messages, temperature=0, **fields
    )


def test_responses_equal_chat_completions_plain_and_streamed(one_app):
    """The official SDK's responses.create, whole and streamed, against chat completions on
    the same conversation (greedy), across the hand-off."""
    client = openai_client(one_app)
    chat = _chat_reply(
        one_app,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        max_tokens=10,
    )
    fields = dict(model="tiny", instructions="Be brief.", input=PROMPT, max_output_tokens=10)
    response = client.responses.create(**fields, temperature=0, store=False)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    deltas, completed = [], None
    for event in client.responses.create(**fields, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert "".join(deltas) == response.output_text and completed is not None
    assert completed.output_text == response.output_text
    assert all(is_drained(w) for w in wait_until_drained(one_app))


def test_responses_with_a_function_tool_and_a_json_schema_equal_chat(one_app):
    client = openai_client(one_app)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [
        {"type": "function", "name": name, "parameters": schema}
        for name, schema in TOOL_SCHEMAS.items()
    ]
    chat = _chat_reply(one_app, question, max_tokens=120, tools=TOOLS, tool_choice="required")
    [chat_call] = chat.choices[0].message.tool_calls
    response = client.responses.create(
        model="tiny",
        input=question,
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)
    streamed = [
        event.item
        for event in client.responses.create(
            model="tiny",
            input=question,
            tools=tools,
            tool_choice="required",
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
        if event.type == "response.output_item.done"
    ]
    assert [(i.name, i.arguments) for i in streamed] == [(call.name, call.arguments)]
    schema = SCHEMAS["person"]
    chat = _chat_reply(
        one_app,
        question,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    response = client.responses.create(
        model="tiny",
        input=question,
        temperature=0,
        max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "p", "schema": schema}},
    )
    assert response.output_text == chat.choices[0].message.content
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), schema)
    assert all(is_drained(w) for w in wait_until_drained(one_app))


@pytest.mark.parametrize(
    "field, value",
    [("store", True), ("previous_response_id", "resp_1"), ("input", [{"type": "image"}])],
)
def test_responses_refuse_what_they_cannot_serve_naming_the_field(one_app, field, value):
    body = {"model": "tiny", "input": "hi", field: value}
    reply = httpx.post(base_url(one_app) + "/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
