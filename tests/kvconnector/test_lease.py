import threading

import pytest

from pdserve.kvconnector.pd.lease import (
    BlockNotLeasedError,
    LeaseEndedError,
    LeaseNotReadyError,
    LeaseTable,
    UnknownLeaseError,
)
from pdserve.kvconnector.transfer_stats import TransferStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_table(ttl_s: float = 10.0) -> tuple[LeaseTable, Clock, TransferStats]:
    clock, stats = Clock(), TransferStats()
    return LeaseTable(default_ttl_s=ttl_s, stats=stats, clock=clock), clock, stats


def test_released_lease_is_freeable_once() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [3, 4], [b"h3", b"h4"], [30, 40])
    assert table.take_freeable() == []
    table.release(lease.lease_id)
    assert table.take_freeable() == ["req-1"]
    assert table.take_freeable() == []


def test_lease_never_released_expires_and_is_counted() -> None:
    table, clock, stats = make_table(ttl_s=5.0)
    table.grant("req-1", [1], [], [11])
    clock.now += 4.9
    assert table.take_freeable() == []
    clock.now += 0.2
    assert table.take_freeable() == ["req-1"]
    assert table.num_expired == 1 and stats.snapshot().num_lease_expiries == 1


def test_renewal_pushes_expiry_out() -> None:
    table, clock, _ = make_table(ttl_s=5.0)
    lease = table.grant("req-1", [1], [], [11])
    clock.now += 4.0
    assert table.renew(lease.lease_id) == clock.now + 5.0
    clock.now += 4.0
    assert table.take_freeable() == []
    clock.now += 1.5
    assert table.take_freeable() == ["req-1"]


def test_release_while_a_read_is_in_flight_defers_freeing_until_end_read() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [1, 2], [], [11, 22])
    table.begin_read(lease.lease_id, [2])
    table.release(lease.lease_id)
    assert table.take_freeable() == []
    table.end_read(lease.lease_id)
    assert table.take_freeable() == ["req-1"]


def test_a_last_read_releases_the_lease_as_it_begins_and_frees_it_as_it_ends() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [1, 2], [], [11, 22])
    table.begin_read(lease.lease_id, [1, 2], release=True)
    with pytest.raises(LeaseEndedError):
        table.begin_read(lease.lease_id, [1])
    assert table.take_freeable() == []
    table.end_read(lease.lease_id)
    assert table.take_freeable() == ["req-1"]
    with pytest.raises(UnknownLeaseError):
        table.release(lease.lease_id)


def test_expiry_during_a_read_defers_freeing_until_end_read() -> None:
    table, clock, _ = make_table(ttl_s=1.0)
    lease = table.grant("req-1", [1], [], [11])
    table.begin_read(lease.lease_id, [1])
    clock.now += 2.0
    assert table.take_freeable() == []
    table.end_read(lease.lease_id)
    assert table.take_freeable() == ["req-1"]


def test_block_outside_the_lease_is_refused() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [1, 2], [], [11, 22])
    with pytest.raises(BlockNotLeasedError, match=r"\[9\]"):
        table.begin_read(lease.lease_id, [1, 9])


def test_read_after_release_or_expiry_or_of_unknown_lease_is_refused() -> None:
    table, clock, _ = make_table(ttl_s=1.0)
    released = table.grant("req-1", [1], [], [11])
    expired = table.grant("req-2", [2], [], [22])
    table.release(released.lease_id)
    clock.now += 2.0
    with pytest.raises(LeaseEndedError, match="released"):
        table.begin_read(released.lease_id, [1])
    with pytest.raises(LeaseEndedError, match="expired"):
        table.begin_read(expired.lease_id, [2])
    with pytest.raises(LeaseEndedError):
        table.renew(expired.lease_id)
    with pytest.raises(UnknownLeaseError):
        table.begin_read("no-such-lease", [1])


def test_concurrent_reads_and_releases_free_every_request_exactly_once() -> None:
    table, _, _ = make_table()
    leases = [table.grant(f"req-{i}", [i], [], [i]) for i in range(200)]
    freed: list[str] = []

    def reader(start: int) -> None:
        for lease in leases[start::4]:
            table.begin_read(lease.lease_id, [int(lease.request_id[4:])])
            table.release(lease.lease_id)
            freed.extend(table.take_freeable())
            table.end_read(lease.lease_id)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    freed.extend(table.take_freeable())
    assert sorted(freed) == sorted(lease.request_id for lease in leases)
    assert len(table) == 0


def test_a_lease_grows_with_each_chunk_and_serves_only_checksummed_blocks() -> None:
    """A chunk-wise hand-off: one lease, reshaped to each chunk's blocks so far; a block is
    readable once its checksum is attached, and each reshape renews the lease."""
    table, clock, _ = make_table(ttl_s=5.0)
    lease = table.grant("req-1", [7, 3], [b"h0", b"h1"], checksums=None)
    table.attach_checksums(lease.lease_id, {7: 70, 3: 30})
    clock.now += 4.0
    grown = table.reshape(lease.lease_id, [7, 3, 12], [b"h0", b"h1", b"h2"])
    assert grown.lease_id == lease.lease_id and grown.expires_at == clock.now + 5.0
    assert table.unchecksummed(lease.lease_id) == [12]
    table.begin_read(lease.lease_id, [7, 3])  # the first chunk's blocks stay readable
    table.end_read(lease.lease_id)
    with pytest.raises(LeaseNotReadyError):
        table.begin_read(lease.lease_id, [12])
    table.attach_checksums(lease.lease_id, {12: 120})
    assert table.checksums(lease.lease_id, [12, 7, 3]) == [120, 70, 30]
    clock.now += 4.0  # past the grant's expiry, not the reshape's
    assert table.take_freeable() == []


def test_a_reshape_after_a_preemption_forgets_the_blocks_the_request_left() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [7, 3], [b"h0", b"h1"], checksums=[70, 30])
    table.reshape(lease.lease_id, [9, 3], [b"h0", b"h1"])  # block 7 was freed and recomputed
    with pytest.raises(BlockNotLeasedError):
        table.begin_read(lease.lease_id, [7])
    assert table.unchecksummed(lease.lease_id) == [9]
    table.attach_checksums(lease.lease_id, {7: 1, 9: 90})  # 7 is skipped: no longer held
    assert table.checksums(lease.lease_id, [9, 3, 7]) == [90, 30, 0]


def test_an_ended_lease_is_not_reshaped() -> None:
    table, _, _ = make_table()
    lease = table.grant("req-1", [1], [], [11])
    table.release(lease.lease_id)
    with pytest.raises(LeaseEndedError):
        table.reshape(lease.lease_id, [1, 2], [])
    assert table.unchecksummed(lease.lease_id) == []
