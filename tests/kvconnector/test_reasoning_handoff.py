"""A reasoning model's structured output: the grammar constrains only what follows the end
of its reasoning (``SamplingParams.reasoning_end_token_ids``), on one engine and across the
P/D hand-off (the first token inside the reasoning, or the token that ends it), with
speculative decoding equal to without.

tiny stands in for a reasoning model: its byte tokenizer makes "!" (id 33) the end of the
reasoning, and a test logits processor steers it there at a chosen output position (the
random model would not end its reasoning by itself). The regex after it is free of "!".
"""

from __future__ import annotations

import math
import re

import pytest

import pdserve.engine.llm_engine as llm_engine_module
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.grammar import GrammarSpec
from tests.kvconnector.disaggregation import assert_decode_idle, disaggregate, make_decode_engine
from tests.kvconnector.kv_peer import TRANSPORTS
from tests.kvconnector.prefill_engine_process import ENGINE_KWARGS

END = ord("!")
PATTERN = r"[0-9]{3}-[a-z]{2,4}"
PROMPT = [ord(c) for c in "Think first, then answer: "]


def params(**fields) -> SamplingParams:
    defaults = dict(max_tokens=40, temperature=0.0)
    return SamplingParams(
        structured=GrammarSpec("regex", PATTERN),
        reasoning_end_token_ids=[END],
        **{**defaults, **fields},
    )


def steer(monkeypatch, position: int, script: str = "") -> None:
    """A test logits processor: the token at output ``position`` is the reasoning's end, or
    the output follows ``script`` from its start (its "!" ending the reasoning)."""
    forced = {i: ord(c) for i, c in enumerate(script)} if script else {position: END}
    original = llm_engine_module.sample

    def steered(logits, all_params, seeds, positions, *rest):
        logits = logits.clone()
        for row, at in enumerate(positions):
            if at in forced:
                logits[row] = -math.inf
                logits[row, forced[at]] = 0.0
        return original(logits, all_params, seeds, positions, *rest)

    monkeypatch.setattr(llm_engine_module, "sample", steered)


def answer_after_reasoning(token_ids: list[int]) -> tuple[list[int], str]:
    end = token_ids.index(END)
    return token_ids[:end], bytes(token_ids[end + 1 :]).decode()


@pytest.fixture(scope="module")
def colocated() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)


def test_the_reasoning_is_free_and_what_follows_matches_the_grammar(monkeypatch, colocated):
    steer(monkeypatch, 5)
    (output,) = colocated.generate([PROMPT], params())
    reasoning, answer = answer_after_reasoning(output.output_token_ids)
    assert len(reasoning) == 5
    assert re.fullmatch(PATTERN, answer), answer
    assert output.finish_reason == "stop"
    (unconstrained,) = colocated.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0))
    assert reasoning == unconstrained.output_token_ids  # nothing constrained the reasoning


def test_without_a_reasoning_end_the_grammar_applies_from_the_first_token(colocated):
    plain = SamplingParams(max_tokens=40, temperature=0.0, structured=GrammarSpec("regex", PATTERN))
    (output,) = colocated.generate([PROMPT], plain)
    assert re.fullmatch(PATTERN, bytes(output.output_token_ids).decode())


def test_speculative_decoding_equals_plain_decoding_across_the_reasoning_end(monkeypatch):
    """The n-gram drafter proposes through the end (the prompt holds what the output says);
    a draft after it was drawn without the grammar, so the verified run is cut at the end
    and the tokens after it are drawn again, under the grammar."""
    steer(monkeypatch, 0, script="abcab!123-xy")
    repetitive = [*PROMPT, *[ord(c) for c in "abcab!123-xy abcab!123-xy abcab!"]]
    plain = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS)
    speculative = LLMEngine.from_pretrained("tiny", **ENGINE_KWARGS, speculative_method="ngram")
    all_params = [params(), params(temperature=0.8, seed=3)]
    expected = [o.output_token_ids for o in plain.generate([repetitive] * 2, all_params)]
    outputs = speculative.generate([repetitive] * 2, all_params)
    assert [o.output_token_ids for o in outputs] == expected
    for output in outputs:
        assert re.fullmatch(PATTERN, answer_after_reasoning(output.output_token_ids)[1])
    assert speculative.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("ends", ["inside the reasoning", "with the first token"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_hand_off_carries_where_the_reasoning_stands(
    monkeypatch, colocated, prefill_factory, transport, ends
):
    """The prefill samples the first token: inside the reasoning (the decode worker's
    matcher waits for its end), or the end itself (biased there: the decode worker's matcher
    starts at once). The decode engine runs in this process, steered as the reference."""
    if ends == "inside the reasoning":
        steer(monkeypatch, 4)
        request = params()
    else:
        request = params(logit_bias={END: 100.0})
    prefill = prefill_factory(transport=transport)
    decode = make_decode_engine(transport)
    (expected,) = colocated.generate([PROMPT], request)
    (output,) = disaggregate(prefill, decode, [PROMPT], [request])
    assert output.output_token_ids == expected.output_token_ids
    reasoning, answer = answer_after_reasoning(output.output_token_ids)
    assert len(reasoning) == (4 if ends == "inside the reasoning" else 0)
    assert re.fullmatch(PATTERN, answer), answer
    assert_decode_idle(decode)
    prefill.wait_until_idle()
    decode.shutdown()
