"""The penalties' sparse counts equal a plain count of the prompt and output, however the
output grows (one token or a speculative run at a time, past the buffers' capacity) or is
cut back, and a draft row's view adds its drafts without touching them."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.token_counts import TokenCounts

TOKENS = st.integers(0, 200)


def as_dict(ids, output) -> dict[int, float]:
    return dict(zip(ids.tolist(), output.tolist(), strict=True))


def expected(prompt: list[int], output: list[int]) -> dict[int, float]:
    counts = Counter(output)
    return {token: float(counts[token]) for token in {*prompt, *output}}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(TOKENS, min_size=1, max_size=40),
    st.lists(st.lists(TOKENS, max_size=6), max_size=30),
    st.integers(0, 100),
    st.lists(TOKENS, max_size=5),
)
def test_counts_equal_a_plain_count(prompt, runs, cut, drafts):
    counts = TokenCounts(prompt)
    output: list[int] = []
    for run in runs:
        output += run
        counts.sync(output)
        assert as_dict(counts.ids, counts.output) == expected(prompt, output)
    assert len(set(counts.ids.tolist())) == len(counts.ids)  # each id once
    before = as_dict(counts.ids, counts.output)
    assert as_dict(*counts.with_drafts(drafts)) == expected(prompt, output + drafts)
    assert as_dict(counts.ids, counts.output) == before
    output = output[: min(cut, len(output))]  # a replay's check cut it back
    counts.sync(output)
    assert as_dict(counts.ids, counts.output) == expected(prompt, output)
