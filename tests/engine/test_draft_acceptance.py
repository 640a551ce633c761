"""How many drafts a request carries (engine/spec_decode/draft_acceptance.py): all of them
while they land, fewer as they miss, none during a pause that doubles, one as a probe."""

from __future__ import annotations

from pdserve.engine.spec_decode import DraftAcceptance


def test_a_request_whose_drafts_land_drafts_the_most() -> None:
    acceptance = DraftAcceptance(min_acceptance=0.3)
    for _ in range(10):
        assert acceptance.num_drafts(4) == 4
        acceptance.record(4, 4)
    assert acceptance.num_drafts(2) == 2  # never more than the room


def test_misses_shrink_the_drafts_then_pause_and_the_pause_doubles() -> None:
    acceptance = DraftAcceptance(min_acceptance=0.3)
    counts = []
    while acceptance.num_paused_steps == 0:
        counts.append(acceptance.num_drafts(4))
        acceptance.record(counts[-1], 0)
    assert counts[0] == 4 and counts == sorted(counts, reverse=True) and counts[-1] >= 1
    assert acceptance.num_paused_steps == 16
    assert [acceptance.num_drafts(4) for _ in range(16)] == [0] * 16
    assert acceptance.num_drafts(4) == 1  # the probe
    acceptance.record(1, 0)
    assert acceptance.num_paused_steps == 32


def test_a_probe_that_lands_resumes_drafting_and_good_runs_reset_the_pause() -> None:
    acceptance = DraftAcceptance(min_acceptance=0.3)
    for _ in range(4):  # the rate falls 1.0, 0.7, 0.49, 0.34, 0.24: under 0.3, a pause
        acceptance.record(4, 0)
    assert [acceptance.num_drafts(4) for _ in range(17)] == [0] * 16 + [1]  # pause, probe
    acceptance.record(1, 1)
    assert acceptance.num_drafts(4) >= 1
    for _ in range(5):
        acceptance.record(4, 4)
    assert acceptance.next_pause_steps == 16 and acceptance.num_drafts(4) == 4


def test_without_a_cost_a_request_always_drafts_the_most() -> None:
    acceptance = DraftAcceptance(min_acceptance=0.0)
    for _ in range(50):
        assert acceptance.num_drafts(4) == 4
        acceptance.record(4, 0)
