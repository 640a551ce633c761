"""The gateway's merge of worker streams: each token sent once, a diverging replay caught.

A request's tokens arrive as deltas from a prefill stream (the first token), a decode
stream that repeats it and a replay after a lost decode worker that repeats all sent so
far. Each chunk is compared only where it overlaps what was sent, so a long stream costs
O(n), and any divergence in the repeated part, in whatever chunks it comes, is refused.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.stream_emitter import ReplayDiverged, StreamEmitter
from pdserve.messages.generation import GenerationChunk


def chunk(tokens: list[int], finished: bool = False) -> GenerationChunk:
    return GenerationChunk(
        request_id="r",
        new_token_ids=tokens,
        text_delta="".join(chr(97 + t % 26) for t in tokens),
        num_output_tokens=0,
        finished=finished,
        finish_reason="length" if finished else None,
    )


def split(tokens: list[int], cuts: list[int]) -> list[list[int]]:
    edges = sorted({0, len(tokens), *(c % (len(tokens) + 1) for c in cuts)})
    return [tokens[a:b] for a, b in zip(edges, edges[1:])]


def emitter() -> StreamEmitter:
    return StreamEmitter([], 4, GatewayMetrics("m"), time.perf_counter())


@given(
    tokens=st.lists(st.integers(0, 500), min_size=2, max_size=60),
    sent_before_loss=st.integers(1, 59),
    first_cuts=st.lists(st.integers(0, 60), max_size=8),
    replay_cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_a_replay_repeating_what_was_sent_adds_each_token_once(
    tokens, sent_before_loss, first_cuts, replay_cuts
):
    sent_before_loss = min(sent_before_loss, len(tokens) - 1)
    merged = emitter()
    received: list[int] = []
    for part in split(tokens[:sent_before_loss], first_cuts):
        delta = merged.update(chunk(part), final=True)
        received += delta.token_ids if delta else []
    merged.restart_stream()  # the decode worker was lost: the replay starts from token 0
    parts = split(tokens, replay_cuts)
    for index, part in enumerate(parts):
        delta = merged.update(chunk(part, finished=index == len(parts) - 1), final=True)
        received += delta.token_ids if delta else []
    assert received == tokens


@given(
    tokens=st.lists(st.integers(0, 500), min_size=2, max_size=40),
    wrong_at=st.integers(0, 39),
    replay_cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_a_replay_that_differs_anywhere_in_the_sent_part_is_refused(tokens, wrong_at, replay_cuts):
    wrong_at %= len(tokens)
    merged = emitter()
    merged.update(chunk(tokens), final=True)
    merged.restart_stream()
    replay = list(tokens)
    replay[wrong_at] += 1
    with pytest.raises(ReplayDiverged):
        for part in split(replay, replay_cuts):
            merged.update(chunk(part), final=True)


def test_cached_tokens_are_the_prefix_hit_of_the_stream_that_brought_the_first_token():
    """A prefill that computed the whole prompt (prompt logprobs: no cached KV used) then a
    decode worker whose own pool held most of it: the request's cached tokens are the
    prefill's 0, not the decode's 1248 (the larger one was taken)."""
    merged = emitter()
    first = GenerationChunk(
        request_id="r",
        new_token_ids=[5],
        text_delta="f",
        num_output_tokens=1,
        finished=True,
        finish_reason="length",
    )
    merged.update(first, final=False)  # the prefill's first token, handed off
    merged.restart_stream()
    rest = GenerationChunk(
        request_id="r",
        new_token_ids=[5, 6, 7],
        text_delta="fgh",
        num_output_tokens=3,
        finished=True,
        finish_reason="length",
        num_cached_tokens=1248,
    )
    delta = merged.update(rest, final=True)
    assert delta is not None and delta.token_ids == [6, 7]
    assert merged.num_cached_tokens == 0
