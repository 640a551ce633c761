"""What a request's output must match: a JSON Schema, any JSON object, a regex, a choice of
strings or a Lark grammar, as one small value that travels with the sampling params.

The spec is plain data (a kind and its source text), so it crosses every hop unchanged:
gateway → prefill worker (which samples the first token under it) → decode worker (which
rebuilds the matcher from it plus the tokens so far). Each side turns it into the same
llguidance grammar, so both sides mask the same tokens.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal

import llguidance

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "choice", "lark")

# JSON is written compact (no free whitespace between tokens) unless a schema's own
# "x-guidance" says otherwise: with flexible whitespace a small model can spend its whole
# budget on newlines and tabs between two keys (vLLM's ``disable_any_whitespace``).
_COMPACT_JSON = {"whitespace_flexible": False}

# A schema or grammar beyond this is refused before it is compiled: compile time and the
# matcher's memory grow with the source, and one request must not stall a worker's compiler.
MAX_GRAMMAR_SOURCE_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message is the compiler's reason."""


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """``kind`` and its ``source``: the schema as JSON text, the regex, the choices as a
    JSON list of strings, or the Lark grammar (``json_object``'s source is unused)."""

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")
        try:
            size = len(self.source.encode())
        except UnicodeEncodeError as error:  # JSON's "\ud800" decodes to a lone surrogate
            raise GrammarError(
                f"the {self.kind} holds an unpaired UTF-16 surrogate at character "
                f"{error.start}; send valid Unicode"
            ) from None
        if size > MAX_GRAMMAR_SOURCE_BYTES:
            raise GrammarError(
                f"the {self.kind} is {size} bytes, over the limit of {MAX_GRAMMAR_SOURCE_BYTES}"
            )

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(options))

    def llguidance_grammar(self) -> str:
        """The spec as an llguidance grammar (JSON text); raises ``GrammarError``."""
        try:
            if self.kind in ("json_schema", "json_object"):
                return llguidance.grammar_from("json_schema", json.dumps(self._schema()))
            if self.kind == "regex":
                return llguidance.grammar_from("regex", self.source)
            if self.kind == "choice":
                return llguidance.grammar_from("lark", _choice_lark(self.source))
            return llguidance.grammar_from("lark", self.source)
        except (ValueError, TypeError) as error:  # llguidance raises ValueError on bad JSON
            raise GrammarError(f"the {self.kind} does not parse: {error}") from None

    def _schema(self) -> dict:
        """The JSON Schema to compile, with the compact-JSON default."""
        if self.kind == "json_object":
            return {"type": "object", "x-guidance": _COMPACT_JSON}
        try:
            schema = json.loads(self.source)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError("the json_schema must be a JSON object")
        return {"x-guidance": _COMPACT_JSON, **schema}

    def validate(self) -> None:
        """Compiles the grammar without a tokenizer (no model needed: the gateway calls it to
        answer a bad schema with a 400); raises ``GrammarError`` naming why. A spec that
        compiled is remembered (agents send the same schema with every request)."""
        _validate(self)


@functools.lru_cache(maxsize=256)
def _validate(spec: GrammarSpec) -> None:
    """``GrammarSpec.validate``'s work; a raise is not cached, a success is."""
    reason = llguidance.LLMatcher.validate_grammar(spec.llguidance_grammar())
    if reason:
        raise GrammarError(reason.strip())


def _choice_lark(source: str) -> str:
    """``start: "a" | "b"``: each choice a Lark string literal (JSON quoting is Lark's)."""
    try:
        options = json.loads(source)
    except json.JSONDecodeError as error:
        raise GrammarError(f"choices must be a JSON list of strings: {error}") from None
    if not isinstance(options, list) or not options:
        raise GrammarError("choices must be a non-empty list of strings")
    if not all(isinstance(o, str) and o for o in options):
        raise GrammarError("every choice must be a non-empty string")
    return "start: " + " | ".join(json.dumps(o) for o in options)
