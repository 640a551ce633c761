"""The sampling fields as both endpoints parse them into ``SamplingParams``, and the checks
that need the vocabulary (``RequestOrchestrator.prepare``): ids inside it, ``bad_words``
tokenized as vLLM does, ``min_tokens`` within ``max_tokens``. No server needed."""

from __future__ import annotations

import types

import pytest

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import APIError, parse_completion
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.orchestrator import RequestOrchestrator
from pdserve.messages.generation import ModelInfo
from pdserve.tokenizer.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(512)
FIELDS = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.2,
    "logit_bias": {"65": 3.0, "66": -100},
    "min_p": 0.1,
    "min_tokens": 2,
    "allowed_token_ids": [65, 66, 67],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
}


def orchestrator() -> RequestOrchestrator:
    pool = types.SimpleNamespace(prefill={"prefill-0": None}, decode={}, all={"prefill-0": None})
    config = GatewayConfig(model="tiny", model_name="tiny")
    info = ModelInfo("tiny", 256, 16, "xxh3_128", 0, [256])
    return RequestOrchestrator(config, pool, info, TOKENIZER)  # type: ignore[arg-type]


def parsed(endpoint: str, **fields):
    if endpoint == "completions":
        return parse_completion({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields})
    messages = [{"role": "user", "content": "hi"}]
    return parse_chat({"model": "tiny", "messages": messages, "max_tokens": 4, **fields}, TOKENIZER)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_field_reaches_the_params(endpoint) -> None:
    params = parsed(endpoint, **FIELDS).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert (params.repetition_penalty, params.min_p, params.min_tokens) == (1.2, 0.1, 2)
    assert params.logit_bias == {65: 3.0, 66: -100.0}
    assert params.allowed_token_ids == [65, 66, 67] and params.include_stop_str_in_output
    assert not (params.skip_special_tokens or params.spaces_between_special_tokens)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_langchain_payload_is_plain_sampling(endpoint) -> None:
    neutral = dict(frequency_penalty=0, presence_penalty=0, logit_bias={}, n=1, stream=True)
    params = parsed(endpoint, **neutral).params
    assert not params.adjusts_logits and not params.penalized


def test_bad_words_are_tokenized_alone_and_after_a_space() -> None:
    """Byte tokens: " ab" is another sequence than "ab" (a longer one), so only the word
    alone is kept, as vLLM keeps a spaced form only when it has as many tokens."""
    token_ids, params = orchestrator().prepare(parsed("completions", bad_words=["ab", " c"]))
    assert params.bad_words_token_ids == [[97, 98], [99]]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"600": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 512]}, "allowed_token_ids"),
        ({"min_tokens": 5}, "min_tokens"),
    ],
)
def test_ids_outside_the_vocabulary_and_min_tokens_past_max_tokens_are_refused(
    fields, param
) -> None:
    with pytest.raises(APIError) as refused:
        orchestrator().prepare(parsed("completions", **fields))
    assert (refused.value.status, refused.value.param) == (400, param)


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("repetition_penalty", 2.5),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"five": 1}),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
        ("prompt_logprobs", 21),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_values_out_of_vllms_ranges_are_a_400_naming_the_field(endpoint, field, value) -> None:
    with pytest.raises(APIError) as refused:
        parsed(endpoint, **{field: value})
    assert (refused.value.status, refused.value.param) == (400, field)
