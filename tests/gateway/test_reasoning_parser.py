"""Reasoning parsers: exact splits of whole replies, and the same split from any cut of the
reply into deltas (hypothesis), tags split across deltas included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.reasoning_parser import REASONING_PARSERS

CASES = [
    # (parser, reply, reasoning, content)
    ("deepseek_r1", "I should add.</think>The sum is 3.", "I should add.", "The sum is 3."),
    ("deepseek_r1", "<think>Hmm.</think>\nYes.", "Hmm.", "\nYes."),
    ("deepseek_r1", "Still thinking, cut off", "Still thinking, cut off", ""),
    ("deepseek_r1", "a </thin b", "a </thin b", ""),
    ("qwen3", "<think>\nParis is it.\n</think>\n\nParis.", "\nParis is it.\n", "\n\nParis."),
    ("qwen3", "Paris.", "", "Paris."),
    ("qwen3", "  <think>x", "x", ""),
    ("qwen3", "<thi", "", "<thi"),
    ("qwen3", '<think></think>{"a": 1}', "", '{"a": 1}'),
]


@pytest.mark.parametrize("name, reply, reasoning, content", CASES)
def test_whole_replies_split_exactly(name, reply, reasoning, content):
    assert REASONING_PARSERS[name]().split(reply) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(CASES),
    st.lists(st.integers(0, 60), max_size=8),
)
def test_any_cut_into_deltas_streams_the_whole_split(case, cuts):
    name, reply, _, _ = case
    parser = REASONING_PARSERS[name]()
    points = sorted({min(c, len(reply)) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)])]
    splitter = parser.splitter()
    streamed = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    joined = ("".join(r for r, _ in streamed), "".join(c for _, c in streamed))
    assert joined == parser.split(reply)


def test_a_prompt_that_closed_the_reasoning_is_seen_as_ended():
    parser = REASONING_PARSERS["qwen3"]()
    start, end = [1], [2]
    assert parser.reasoning_ended_in([5, 1, 7, 2, 9], start, end)  # thinking off
    assert not parser.reasoning_ended_in([5, 1, 7], start, end)  # the template opened it
    assert not parser.reasoning_ended_in([5, 6], start, end)  # the model will open it
