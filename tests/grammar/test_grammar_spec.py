"""Grammar specs compile, or fail naming the compiler's reason; the compiler caches by source."""

from __future__ import annotations

import json

import pytest

from pdserve.grammar import MAX_GRAMMAR_SOURCE_BYTES, GrammarCompiler, GrammarError, GrammarSpec
from pdserve.tokenizer.tokenizer import ByteTokenizer

GOOD = [
    GrammarSpec(
        "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    ),
    GrammarSpec("json_object"),
    GrammarSpec("regex", r"[0-9]{3}-[a-z]+"),
    GrammarSpec.choice(["yes", "no", 'say "maybe"']),
    GrammarSpec("lark", 'start: "a"+ "b"'),
]


@pytest.mark.parametrize("spec", GOOD, ids=[s.kind for s in GOOD])
def test_each_kind_compiles(spec):
    spec.validate()


@pytest.mark.parametrize(
    "spec, reason",
    [
        (GrammarSpec("regex", "([a-z"), "unclosed character class"),
        (GrammarSpec("json_schema", '{"type": "wat"}'), "wat"),
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
    ],
    ids=["regex", "schema-type", "schema-json", "schema-not-object", "lark"],
)
def test_a_spec_that_does_not_compile_names_the_reason(spec, reason):
    with pytest.raises(GrammarError, match=reason):
        spec.validate()


@pytest.mark.parametrize("options", [[], [""], ["a", 3]])
def test_choices_must_be_non_empty_strings(options):
    with pytest.raises(GrammarError, match="choice"):
        GrammarSpec.choice(options).validate()


def test_a_source_over_the_limit_is_refused_before_compiling():
    with pytest.raises(GrammarError, match="over the limit"):
        GrammarSpec("regex", "a" * (MAX_GRAMMAR_SOURCE_BYTES + 1))


def test_the_compiler_compiles_a_source_once_and_evicts_the_least_recent():
    tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer.backend, 512, tokenizer.eos_token_ids, cache_size=2)
    a, b, c = (GrammarSpec("regex", pattern) for pattern in ("a+", "b+", "c+"))
    first = compiler.matcher(a)
    compiler.matcher(a)
    assert (compiler.stats.num_compiled, compiler.stats.num_cache_hits) == (1, 1)
    compiler.matcher(b)
    compiler.matcher(c)  # evicts a
    assert len(compiler) == 2
    compiler.matcher(a)
    assert compiler.stats.num_compiled == 4
    # Each matcher is its own copy: advancing one leaves the next at the start.
    first.accept(ord("a"))
    fresh = compiler.matcher(a)
    fresh.accept(ord("b"))
    assert fresh.error is not None and first.error is None
