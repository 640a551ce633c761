"""A request's stamps become consecutive intervals that add up to the worker's time to its
first chunk, whichever points the request reached."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pdserve.engine.kv_connector_base import PullSummary
from pdserve.engine.request_stamps import RequestStamps

INTERVALS = ("op_wait_s", "queued_s", "load_s", "compute_s", "emit_s")


@given(
    st.lists(st.floats(0, 1e3, allow_nan=False), min_size=6, max_size=6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
# Found by hypothesis: a stamp of 0.0 was taken for a missing one ("or"), so the load
# interval came out negative.
@example([0.0, 0.0, 0.0, 1.0, 1.0, 2.0], True, True, False)
def test_the_intervals_are_consecutive_and_add_up_to_the_time_in_the_worker(
    points, admitted, loaded, sampled
):
    entered, added, admitted_at, loaded_at, first_token, yielded = sorted(points)
    stamps = RequestStamps(
        added_at=added,
        admitted_at=admitted_at if admitted else None,
        loaded_at=loaded_at if admitted and loaded else None,
        first_token_at=first_token if sampled else None,
    )
    timing = stamps.timing(entered, yielded)
    assert all(getattr(timing, name) >= 0 for name in INTERVALS)
    assert timing.in_worker_s == pytest.approx(yielded - entered)
    assert timing.op_wait_s == pytest.approx(added - entered)
    if not loaded:
        assert timing.load_s == 0


def test_a_load_keeps_its_first_pull_s_handshake_and_read():
    stamps = RequestStamps(added_at=0.0, admitted_at=1.0)
    stamps.record_load(PullSummary(num_blocks=3, num_bytes=96, duration_s=0.25, handshake_s=0.5))
    loaded_at = stamps.loaded_at
    stamps.record_load(PullSummary(num_blocks=1, num_bytes=32, duration_s=9.0))
    assert stamps.loaded_at == loaded_at > 1.0
    timing = stamps.timing(entered_at=0.0, yielded_at=loaded_at + 1.0, checksum_s=0.1)
    assert (timing.handshake_s, timing.transfer_s, timing.checksum_s) == (0.5, 0.25, 0.1)
    assert timing.load_s == pytest.approx(loaded_at - 1.0)
