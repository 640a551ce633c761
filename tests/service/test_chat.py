"""``POST /v1/chat/completions`` on a 1 + 1 app of the built-in ``tiny`` model (its chat
template is ChatML): the official OpenAI client streamed and not, the chunk shapes, gRPC's
chat prompt, the ``pdserve generate --chat`` / ``pdserve chat`` commands, and bad input.

Every reply equals the colocated engine's on the same rendered prompt: the template is
applied once, at the gateway, and the workers see token ids.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import httpx
import pytest

from bench.load_driver import is_drained, wait_until_drained
from pdserve.deploy.cluster import base_url
from pdserve.messages.sampling_params import SamplingParams
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.ports import free_port
from tests.service.service_apps import openai_client, running_app

GRPC_PORT = free_port()
SYSTEM = {"role": "system", "content": "You are terse. Answer in a few words."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": "Name a colour."}],
    [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts."}],
        }
    ],
]


@pytest.fixture(scope="module")
def service(ray_cluster):
    with running_app(num_prefill=1, num_decode=1, grpc_port=GRPC_PORT) as config:
        yield config


def expected(colocated, messages, max_tokens: int, **sampling):
    tokenizer = colocated.tokenizer
    prompt_ids = tokenizer.encode(
        tokenizer.chat_template.render(messages), add_special_tokens=False
    )
    return colocated.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, **sampling))[0]


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=11)], ids=["greedy", "seeded"]
)
def test_openai_chat_streamed_and_whole_equal_the_colocated_engine(service, colocated, sampling):
    client = openai_client(service)
    for messages in CONVERSATIONS:
        reference = expected(colocated, messages, 12, **sampling)
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, **sampling
        )
        assert whole.object == "chat.completion"
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == reference.text
        assert whole.choices[0].finish_reason == reference.finish_reason
        assert whole.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert whole.usage.completion_tokens == len(reference.output_token_ids)
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_completion_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                **sampling,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference.text
        )
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == reference.finish_reason and not any(finishes[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
            reference.output_token_ids
        )


def test_the_sse_stream_has_openais_chunk_shapes_and_ends_with_done(service):
    body = {
        "model": "tiny",
        "messages": CONVERSATIONS[0],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    response = httpx.post(base_url(service) + "/v1/chat/completions", json=body, timeout=60)
    events = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} or chunks[-1]["choices"][0]["finish_reason"]
    # Without stream_options.include_usage the finish chunk carries the usage and provenance.
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and "kv_provenance" in chunks[-1]
    assert all("usage" not in c for c in chunks[:-1])


def test_a_repeated_conversation_reports_its_cached_prefix_in_usage(service):
    client = openai_client(service)
    messages = [
        {"role": "system", "content": "A long shared instruction. " * 12},
        {"role": "user", "content": "Hello there."},
    ]
    # A salt of its own: other tests' prompts share the template's first block.
    salted = {"extra_body": {"cache_salt": "test-cached-prefix"}}
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **salted)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **salted)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens


def test_grpc_generate_takes_a_chat_prompt(service, colocated):
    reference = expected(colocated, CONVERSATIONS[1], 8, temperature=0.0)
    chat = generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(**m) for m in CONVERSATIONS[1]]
    )
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        replies = list(
            generate_pb2_grpc.GenerateStub(channel).Generate(
                generate_pb2.GenerateRequest(chat=chat, max_tokens=8, temperature=0.0), timeout=60
            )
        )
        assert [t for r in replies for t in r.token_ids] == reference.output_token_ids
        assert replies[-1].num_prompt_tokens == len(reference.prompt_token_ids)
        bad = generate_pb2.ChatMessages(
            messages=[generate_pb2.ChatMessage(role="wizard", content="hi")]
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(
                generate_pb2_grpc.GenerateStub(channel).Generate(
                    generate_pb2.GenerateRequest(chat=bad), timeout=60
                )
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "role" in caught.value.details()


def test_pdserve_generate_chat_and_pdserve_chat_stream_the_reply(service, colocated):
    url = base_url(service)
    reference = expected(
        colocated, [{"role": "user", "content": "Name a colour."}], 8, temperature=0.0
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.deploy.cli",
            "generate",
            "--chat",
            "Name a colour.",
            "--max-tokens",
            "8",
            "--url",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference.text + "\n"
    # Two turns, the second sent with the first's history; an empty line ends the session.
    first = expected(
        colocated, [{"role": "user", "content": "Name a colour."}], 8, temperature=0.0
    ).text
    second = expected(
        colocated,
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Another one?"},
        ],
        8,
        temperature=0.0,
    ).text
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.deploy.cli", "chat", "--max-tokens", "8", "--url", url],
        input="Name a colour.\nAnother one?\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"assistant> {first}\n" in done.stdout and f"assistant> {second}\n" in done.stdout


@pytest.mark.parametrize(
    "field, value, param, says",
    [
        ("messages", [], "messages", "non-empty"),
        ("messages", [{"role": "wizard", "content": "hi"}], "messages", "role"),
        (
            "messages",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages",
            "text",
        ),
        ("messages", "hello", "messages", "list"),
        ("tools", [{"type": "function", "function": {"name": "no spaces"}}], "tools", "pattern"),
        ("response_format", {"type": "xml"}, "response_format", "json_schema"),
        ("functions", [{"name": "f"}], "functions", "not supported"),
        ("n", 17, "n", ""),
        ("top_logprobs", 21, "top_logprobs", ""),
        ("max_completion_tokens", 0, "max_completion_tokens", ""),
        ("stream_options", {"include_usage": "yes"}, "stream_options", ""),
    ],
)
def test_bad_chat_input_is_a_400_naming_the_field(service, field, value, param, says):
    body = {"model": "tiny", "messages": CONVERSATIONS[0], "max_tokens": 4, field: value}
    response = httpx.post(base_url(service) + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_conversation_past_the_context_length_is_a_400_and_the_service_still_serves(
    service, colocated
):
    long = [{"role": "user", "content": "word " * colocated.max_model_len}]
    response = httpx.post(
        base_url(service) + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": long, "max_tokens": 4},
    )
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"]
    ok = openai_client(service).chat.completions.create(
        model="tiny", messages=CONVERSATIONS[0], max_tokens=2
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert all(is_drained(w) for w in wait_until_drained(service))


def test_without_max_tokens_a_reply_may_run_to_the_end_of_the_context(service, colocated):
    """vLLM's rule, and OpenAI's for chat: no ``max_tokens`` (chat), or a null one, leaves the
    reply the rest of ``max_model_len``; a chat reply used to stop at 16 tokens. The prompt
    fills all but ``room`` positions, so the rest is short; a prompt that fills them all has
    no room for an output: a 400."""
    tokenizer, room = colocated.tokenizer, 24

    def conversation(num_chars: int) -> tuple[list[dict], list[int]]:
        messages = [{"role": "user", "content": "a" * num_chars}]
        rendered = tokenizer.chat_template.render(messages)
        return messages, tokenizer.encode(rendered, add_special_tokens=False)

    overhead = len(conversation(0)[1])
    messages, prompt_ids = conversation(colocated.max_model_len - room - overhead)
    assert len(prompt_ids) == colocated.max_model_len - room
    greedy = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    (reference,) = colocated.generate([prompt_ids], greedy)
    reply = openai_client(service).chat.completions.create(
        model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage.completion_tokens == room == len(reference.output_token_ids)
    assert reply.choices[0].message.content == reference.text
    assert reply.choices[0].finish_reason == "length"
    completion = httpx.post(
        base_url(service) + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": prompt_ids,
            "max_tokens": None,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert completion["usage"]["completion_tokens"] == room
    assert completion["choices"][0]["text"] == reference.text
    full, _ = conversation(colocated.max_model_len - overhead)
    refused = httpx.post(
        base_url(service) + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": full},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert "no room" in refused.json()["error"]["message"]
    assert all(is_drained(w) for w in wait_until_drained(service))


def test_tokenize_counts_what_a_chat_is_charged_and_models_reports_max_model_len(service):
    """vLLM's /tokenize and /detokenize over HTTP, and /v1/models' max_model_len."""
    url = base_url(service)
    messages = CONVERSATIONS[0]
    reply = openai_client(service).chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, temperature=0
    )
    counted = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}).json()
    assert counted["count"] == reply.usage.prompt_tokens == len(counted["tokens"])
    text = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": [72, 105]}).json()
    assert text == {"prompt": "Hi"}
    (model,) = httpx.get(url + "/v1/models").json()["data"]
    assert model["max_model_len"] == counted["max_model_len"] > 0
