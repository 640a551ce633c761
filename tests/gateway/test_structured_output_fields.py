"""The structured-output fields of both endpoints become one GrammarSpec, or a 400 that
names the field (and the compiler's reason) before any worker sees the request."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.api.chat import parse_chat
from pdserve.gateway.api.openai_schema import APIError, parse_completion
from pdserve.grammar import MAX_GRAMMAR_SOURCE_BYTES, GrammarSpec
from pdserve.tokenizer.loading import load_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _completion(**fields) -> GrammarSpec | None:
    body = {"model": "tiny", "prompt": "x", **fields}
    return parse_completion(body).params.structured


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            GrammarSpec("json_schema", json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec("regex", "[a-z]+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, GrammarSpec.choice(["x", "y"])),
        ({"structured_outputs": {"grammar": 'start: "q"'}}, GrammarSpec("lark", 'start: "q"')),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object")),
        ({"guided_json": SCHEMA}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json_schema", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]"}, GrammarSpec("regex", "[0-9]")),
        ({"guided_choice": ["a"]}, GrammarSpec.choice(["a"])),
        ({"guided_grammar": 'start: "q"'}, GrammarSpec("lark", 'start: "q"')),
        ({}, None),
    ],
    ids=lambda v: None if isinstance(v, (dict, GrammarSpec)) else str(v),
)
def test_each_form_becomes_its_grammar_spec(fields, expected):
    assert _completion(**fields) == expected


@pytest.mark.parametrize(
    "fields, param, reason",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "wat"}},
                }
            },
            "response_format.json_schema",
            "wat",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "needs a json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema'"),
        ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex", "unclosed"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least 1"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar", "nope"),
        ({"structured_outputs": {"pattern": "x"}}, "structured_outputs", "pattern"),
        (
            {"guided_regex": "(", "guided_choice": ["a"]},
            "guided_choice",  # the second: the one to drop
            "one structured output at a time",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a" * (MAX_GRAMMAR_SOURCE_BYTES + 1)}, "guided_regex", "over the limit"),
        # JSON's "\ud800" as a schema's text: a 500 before (the size check's encode raised).
        ({"guided_json": "\ud800"}, "guided_json", "unpaired UTF-16 surrogate"),
        (
            {"structured_outputs": {"json": '{"type": "string", "pattern": "\ud800"}'}},
            "structured_outputs.json",
            "unpaired UTF-16 surrogate",
        ),
    ],
    ids=[
        "bad-schema",
        "no-schema",
        "bad-type",
        "bad-regex",
        "no-choices",
        "bad-lark",
        "unknown-key",
        "two",
        "bad-json",
        "huge",
        "surrogate",
        "surrogate-in-schema-text",
    ],
)
def test_a_bad_structured_output_is_a_400_naming_the_field(fields, param, reason):
    with pytest.raises(APIError) as caught:
        _completion(**fields)
    assert caught.value.status == 400 and caught.value.param == param
    assert reason in caught.value.message


def test_chat_takes_response_format_too():
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
    }
    parsed = parse_chat(body, load_tokenizer("smollm2"))
    assert parsed.params.structured == GrammarSpec("json_object")
