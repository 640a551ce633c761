"""Structured outputs in the engine: every sampled token is masked by the request's grammar.

Colocated, on the tiny model (random weights: only the mask makes its output valid): for
each schema and 20 seeds at temperature 0.8, every reply that stops parses and validates;
choices and regexes always match; logprobs are the model's raw distribution; a grammar that
does not compile refuses the request; the stats count the masked work.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.grammar import GrammarError, GrammarSpec
from tests.engine.structured_schemas import SCHEMAS

SEEDS = range(20)
PROMPT = "Answer in JSON: "


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", num_kv_blocks=512)


def _params(spec: GrammarSpec, seed: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=0.8, seed=seed, structured=spec, **fields)


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_sampled_reply_parses_and_validates_against_its_schema(engine, name):
    schema = SCHEMAS[name]
    spec = GrammarSpec("json_schema", json.dumps(schema))
    outputs = engine.generate([PROMPT] * len(SEEDS), [_params(spec, seed) for seed in SEEDS])
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), schema)
    assert len({o.text for o in outputs}) > 1  # the seeds differ, the mask did not fix one reply


def test_choices_and_regexes_always_match(engine):
    choice = GrammarSpec.choice(["red", "green", "blue"])
    regex = GrammarSpec("regex", r"[0-9]{3}-[a-z]{2,4}")
    outputs = engine.generate(
        [PROMPT] * 40, [_params(choice, s) for s in SEEDS] + [_params(regex, s) for s in SEEDS]
    )
    assert all(
        o.text in ("red", "green", "blue") and o.finish_reason == "stop" for o in outputs[:20]
    )
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", o.text) for o in outputs[20:])


def test_a_grammar_ends_the_request_when_complete_even_with_budget_left(engine):
    [output] = engine.generate([PROMPT], [_params(GrammarSpec("regex", "ab"), 0)])
    assert output.text == "ab" and output.finish_reason == "stop"
    assert len(output.output_token_ids) == 2  # no EOS step after the grammar completed


def test_logprobs_report_the_raw_distribution_not_the_masked_one(engine):
    """A forced token's logprob is the model's (finite, below 0), not the masked 0.0; it
    equals the unconstrained logprob of the same token after the same prefix."""
    prompt = engine.tokenizer.encode(PROMPT)
    [forced] = engine.generate([prompt], [_params(GrammarSpec("regex", "xyz"), 1, logprobs=2)])
    assert forced.text == "xyz"
    for position, entry in enumerate(forced.output_logprobs):
        assert entry.logprob < 0
        [reference] = engine.generate(
            [prompt + forced.output_token_ids[: position + 1]],
            [SamplingParams(max_tokens=1, prompt_logprobs=0)],
        )
        # fp32 logprobs near -18 through the decode and the prefill attention: equal to ~1e-6
        expected = reference.prompt_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_a_grammar_that_does_not_compile_refuses_the_request_and_leaks_nothing(engine):
    free_before = engine.kv_cache_manager.get_num_free_blocks()
    with pytest.raises(GrammarError, match="unclosed"):
        engine.add_request("bad", PROMPT, _params(GrammarSpec("regex", "([a-z"), 0))
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.get_num_free_blocks() == free_before


def test_the_stats_count_structured_requests_masked_rows_and_compiles(engine):
    before = engine.stats()
    spec = GrammarSpec("regex", "[a-c]{4}")
    engine.generate([PROMPT] * 3, [_params(spec, s) for s in range(3)])
    after = engine.stats()
    assert after.num_structured_requests - before.num_structured_requests == 3
    assert after.num_constrained_rows - before.num_constrained_rows == 3 * 4
    # Each row allows 3 of the 512 ids: 509 masked per row.
    assert after.num_masked_tokens - before.num_masked_tokens == 3 * 4 * (512 - 3)
    assert after.grammar.num_compiled - before.grammar.num_compiled == 1
    assert after.grammar.num_cache_hits - before.grammar.num_cache_hits == 2
