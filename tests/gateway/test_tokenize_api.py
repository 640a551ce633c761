"""vLLM's ``/tokenize`` and ``/detokenize`` shapes over the built-in smollm2's tokenizer: a
chat counts what ``/v1/chat/completions`` renders, text round-trips, and bad input is a 400
(or 404 for another model) naming the field. The HTTP routes (keys included) are the
service's: ``tests/service/test_chat.py``."""

from __future__ import annotations

import pytest

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import APIError
from pdserve.gateway.api.tokenize_api import detokenize, tokenize
from pdserve.tokenizer.loading import load_tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return load_tokenizer("smollm2")


def test_a_chat_counts_the_prompt_a_chat_completion_is_charged(tokenizer) -> None:
    answer = tokenize({"model": "smollm2", "messages": CHAT}, tokenizer, ["smollm2"], 2048)
    charged = parse_chat({"model": "smollm2", "messages": CHAT}, tokenizer).prompt_token_ids
    assert answer["tokens"] == charged and answer["count"] == len(charged)
    assert answer["max_model_len"] == 2048 and answer["token_strs"] is None
    opened = tokenize(
        {"model": "smollm2", "messages": CHAT, "add_generation_prompt": False},
        tokenizer,
        "smollm2",
        2048,
    )
    assert opened["count"] < answer["count"]  # no assistant turn opened


def test_text_round_trips_with_its_token_strings(tokenizer) -> None:
    text = "Paris is the capital of France."
    answer = tokenize(
        {"model": "smollm2", "prompt": text, "return_token_strs": True},
        tokenizer,
        ["smollm2"],
        2048,
    )
    assert answer["tokens"] == tokenizer.encode(text)
    assert answer["token_strs"] == [tokenizer.backend.id_to_token(t) for t in answer["tokens"]]
    assert "".join(answer["token_strs"]).replace("Ġ", " ") == text
    back = detokenize({"model": "smollm2", "tokens": answer["tokens"]}, tokenizer, ["smollm2"])
    assert back == {"prompt": text}


@pytest.mark.parametrize(
    "call, body, status, param",
    [
        ("tokenize", {"model": "smollm2", "prompt": 5}, 400, "prompt"),
        ("tokenize", {"model": "other", "prompt": "hi"}, 404, "model"),
        ("tokenize", {"model": "smollm2", "messages": []}, 400, "messages"),
        ("tokenize", {"model": "smollm2", "prompt": "hi", "stream": True}, 400, "stream"),
        ("detokenize", {"model": "smollm2", "tokens": [1, 10**7]}, 400, "tokens"),
        ("detokenize", {"model": "smollm2", "tokens": [-1]}, 400, "tokens"),
    ],
)
def test_bad_input_is_refused_naming_the_field(tokenizer, call, body, status, param) -> None:
    with pytest.raises(APIError) as refused:
        if call == "tokenize":
            tokenize(body, tokenizer, ["smollm2"], 2048)
        else:
            detokenize(body, tokenizer, ["smollm2"])
    assert (refused.value.status, refused.value.param) == (status, param)
