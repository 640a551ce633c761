"""Structured outputs as clients ask for them: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (with the older ``guided_*`` names), on both endpoints.

Every form becomes one ``GrammarSpec``, checked here by compiling it without a tokenizer,
so a schema, regex or grammar that does not compile is a 400 naming the field and the
compiler's reason, before any worker sees the request:

    response_format {"type": "json_object"}                      ─┐
    response_format {"type": "json_schema", "json_schema": {..}}  │
    structured_outputs {"json" | "regex" | "choice" | "grammar"}  ├─▶ GrammarSpec ─▶ params
    guided_json | guided_regex | guided_choice | guided_grammar   ─┘

At most one of them per request: two constraints at once have no single meaning.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pdserve.grammar import GrammarError, GrammarSpec


class StructuredOutputError(ValueError):
    """A structured-output field that is wrong; ``param`` names it (the 400's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


Choice = Annotated[str, StringConstraints(min_length=1)]
Choices = Annotated[list[Choice], Field(min_length=1)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted (the output always
    follows the schema here, strict or not)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of the constraints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: Annotated[str, StringConstraints(min_length=1)] | None = None
    choice: Choices | None = None
    grammar: Annotated[str, StringConstraints(min_length=1)] | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """The request fields that ask for structured output (mixed into both request models)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, StringConstraints(min_length=1)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: Annotated[str, StringConstraints(min_length=1)] | None = None

    @classmethod
    def asks_for_structure(cls, body: object) -> bool:
        """Whether a raw body sets any of these fields (then parsing it compiles a grammar:
        up to tens of milliseconds for a large schema, so the ingress parses it off the loop)."""
        return isinstance(body, dict) and any(body.get(name) for name in cls.model_fields)

    def grammar_spec(self) -> GrammarSpec | None:
        """The one constraint the request asks for, compiled once to check it; None if none."""
        asked = [(param, spec) for param, spec in self._asked() if spec is not None]
        if len(asked) > 1:
            names = ", ".join(param for param, _ in asked)
            raise StructuredOutputError(
                f"ask for one structured output at a time, got {names}", asked[1][0]
            )
        if not asked:
            return None
        param, spec = asked[0]
        try:
            spec.validate()
        except GrammarError as error:
            raise StructuredOutputError(f"{param}: {error}", param) from None
        return spec

    def _asked(self) -> list[tuple[str, GrammarSpec | None]]:
        """(field, spec) for each form present; a malformed spec raises its 400 here."""
        forms: list[tuple[str, Any, str]] = [
            ("guided_json", self.guided_json, "json_schema"),
            ("guided_regex", self.guided_regex, "regex"),
            ("guided_choice", self.guided_choice, "choice"),
            ("guided_grammar", self.guided_grammar, "lark"),
        ]
        if self.structured_outputs is not None:
            so = self.structured_outputs
            forms += [
                ("structured_outputs.json", so.json_, "json_schema"),
                ("structured_outputs.regex", so.regex, "regex"),
                ("structured_outputs.choice", so.choice, "choice"),
                ("structured_outputs.grammar", so.grammar, "lark"),
                ("structured_outputs.json_object", so.json_object or None, "json_object"),
            ]
        specs = [(param, _spec(param, kind, value)) for param, value, kind in forms]
        return [*specs, self._response_format_spec()]

    def _response_format_spec(self) -> tuple[str, GrammarSpec | None]:
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return "response_format", None
        if response_format.type == "json_object":
            return "response_format", GrammarSpec("json_object")
        if response_format.json_schema is None:
            raise StructuredOutputError(
                'response_format of type "json_schema" needs a json_schema object',
                "response_format.json_schema",
            )
        param = "response_format.json_schema"
        return param, _spec(param, "json_schema", response_format.json_schema.schema_)


def _spec(param: str, kind: str, value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    try:
        if kind == "choice":
            return GrammarSpec.choice(value)
        if kind == "json_schema":
            return GrammarSpec(
                "json_schema", value if isinstance(value, str) else json.dumps(value)
            )
        return GrammarSpec(kind, "" if kind == "json_object" else value)  # type: ignore[arg-type]
    except GrammarError as error:  # over the size limit
        raise StructuredOutputError(f"{param}: {error}", param) from None
