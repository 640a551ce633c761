"""What the README says the API refuses is exactly what it refuses: each field it lists gets a
400 naming that field, and it lists every field the code refuses (docs that say what the code
does not are a defect). The real parsers both ingresses share; no server needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.gateway.api.chat import _UNSUPPORTED_CHAT_FIELDS, parse_chat
from pdserve.gateway.api.openai_schema import _UNSUPPORTED_FIELDS, APIError, parse_completion
from pdserve.tokenizer.tokenizer import ByteTokenizer

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def refused_in(endpoint: str) -> list[str]:
    line = next(line for line in README.splitlines() if f"refused in `{endpoint}`:" in line)
    return re.findall(r"`(\w+)`", line.split(":", 1)[1])


COMPLETIONS = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PARSERS = {
    "/v1/completions": lambda body: parse_completion(body),
    "/v1/chat/completions": lambda body: parse_chat(body, ByteTokenizer(512)),
}


def test_the_readme_lists_exactly_the_fields_the_code_refuses():
    assert set(refused_in("/v1/completions")) == set(_UNSUPPORTED_FIELDS)
    assert set(refused_in("/v1/chat/completions")) == set(_UNSUPPORTED_CHAT_FIELDS)


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [(e, f) for e in PARSERS for f in refused_in(e)],
)
def test_each_field_the_readme_lists_as_refused_gets_a_400_naming_it(endpoint, field):
    base = COMPLETIONS if endpoint == "/v1/completions" else CHAT
    with pytest.raises(APIError) as refused:
        PARSERS[endpoint]({**base, field: {"not": "the default"}})
    assert refused.value.status == 400
    assert refused.value.body()["error"]["param"] == field
    assert field in refused.value.message
