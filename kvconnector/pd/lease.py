"""Leases: how long a prefill worker keeps a finished request's blocks for a decode worker.

A lease pins a request's blocks until the decode side releases it or it expires (the decode
side renews it while pulling). Whatever happens to the lease, a block is never freed while a
transfer still reads it: reads in flight are counted, and a released or expired lease becomes
freeable only when that count drops to zero. A hand-off's last read releases the lease
as it begins (``begin_read(release=True)``), so its blocks are freed as that read ends.

    grant ──▶ ACTIVE ──release──▶ RELEASED ─┐
                │ ▲                          ├─ reads_in_flight == 0 ──▶ take_freeable() → freed
                │ └─renew                    │
                └──expires_at passes──▶ EXPIRED

gRPC server threads call ``begin_read`` / ``end_read`` / ``renew`` / ``release``; the engine
thread calls ``grant`` and polls ``take_freeable`` once a step, then frees the returned
requests' blocks. One lock guards it all; no call scans every lease.

A lease may be granted before its checksums exist (the engine thread does not hash a whole
prompt; the worker's stream does, ``attach_checksums``, before the hand-off leaves the
worker). Until a block has its checksum ``begin_read`` refuses it: no read is served of a
page nobody can verify.

A chunk-wise hand-off grows one lease while its prompt is still being prefilled: each
chunk's newly full blocks join it (``reshape``), so a decode worker reads them while later
chunks compute. A preempted prefill recomputes into other blocks, and a sliding window
moves past its old ones; ``reshape`` then names the new ones and forgets the old ones'
checksums, so no read begins on a block the request no longer holds (one that began before
still copies it: the engine keeps such blocks until ``reads_in_flight`` is 0)::

    chunk 1 done: reshape [7 3]          checksums {7, 3}      reads of 7, 3 served
    chunk 2 done: reshape [7 3 12 5]     checksums {7, 3} + {12, 5} once attached
    preempted, recomputed: reshape [9 2 4 8]   the old ids leave the lease
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from pdserve.kvconnector.transfer_stats import TransferStats


class LeaseError(Exception):
    """A peer asked for something its lease does not allow."""


class UnknownLeaseError(LeaseError):
    """No such lease: never granted, or already freed."""


class LeaseEndedError(LeaseError):
    """The lease was released or has expired; its blocks may be freed any moment."""


class BlockNotLeasedError(LeaseError):
    """A block id outside the lease was asked for."""


class RepeatedBlockError(LeaseError):
    """A read named a block twice: it would send the same page again and again."""


class LeaseNotReadyError(LeaseError):
    """A block's checksum is not attached yet: its hand-off has not left the worker."""


class LeaseState(Enum):
    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class Lease:
    """What was granted (or last reshaped): handed to the decode side inside
    ``KVTransferParams``."""

    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    expires_at: float


@dataclass(slots=True)
class _LeaseEntry:
    lease: Lease
    block_id_set: frozenset[int]
    ttl_s: float
    expires_at: float
    checksum_of: dict[int, int]
    state: LeaseState = LeaseState.ACTIVE
    reads_in_flight: int = 0


class LeaseTable:
    """Thread-safe table of leases; times are ``clock()`` seconds (wall clock by default,
    because ``expires_at`` travels to another process)."""

    def __init__(
        self,
        default_ttl_s: float = 30.0,
        stats: TransferStats | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.default_ttl_s = default_ttl_s
        self.num_expired = 0
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _LeaseEntry] = {}
        self._expiry_heap: list[tuple[float, str]] = []  # (expires_at, lease_id); stale ok
        self._ended: set[str] = set()  # released/expired, not yet freed

    def grant(
        self,
        request_id: str,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        checksums: Sequence[int] | None,
        ttl_s: float | None = None,
    ) -> Lease:
        """``checksums=None``: they come later (``attach_checksums``); no read until then."""
        if checksums is not None:
            _check_one_checksum_per_block(block_ids, checksums)
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        with self._lock:
            expires_at = self._clock() + ttl
            lease = Lease(
                lease_id=uuid.uuid4().hex,
                request_id=request_id,
                block_ids=tuple(block_ids),
                block_hashes=tuple(block_hashes),
                expires_at=expires_at,
            )
            self._entries[lease.lease_id] = _LeaseEntry(
                lease=lease,
                block_id_set=frozenset(lease.block_ids),
                ttl_s=ttl,
                expires_at=expires_at,
                checksum_of=dict(zip(block_ids, checksums or ())),
            )
            heapq.heappush(self._expiry_heap, (expires_at, lease.lease_id))
            return lease

    def reshape(
        self, lease_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> Lease:
        """Makes the lease hold ``block_ids`` (a chunk-wise hand-off's blocks so far, or the
        whole prompt's at its end) and renews it. Checksums of blocks it still holds are
        kept; the new blocks' come with ``attach_checksums``. Raises ``LeaseError`` for a
        lease that ended (the caller then hands off without it)."""
        with self._lock:
            now = self._clock()
            entry = self._active_entry(lease_id, now)
            kept = frozenset(block_ids)
            entry.checksum_of = {b: c for b, c in entry.checksum_of.items() if b in kept}
            entry.block_id_set = kept
            entry.expires_at = now + entry.ttl_s
            entry.lease = dataclasses.replace(
                entry.lease,
                block_ids=tuple(block_ids),
                block_hashes=tuple(block_hashes),
                expires_at=entry.expires_at,
            )
            heapq.heappush(self._expiry_heap, (entry.expires_at, lease_id))
            return entry.lease

    def unchecksummed(self, lease_id: str) -> list[int]:
        """The lease's blocks that have no checksum yet (none for a lease that ended)."""
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None or entry.state is not LeaseState.ACTIVE:
                return []
            return [b for b in entry.lease.block_ids if b not in entry.checksum_of]

    def attach_checksums(self, lease_id: str, checksum_of: Mapping[int, int]) -> None:
        """Attaches checksums of leased blocks; reads of them are served from now on.
        A lease that ended meanwhile (its request aborted) is left as it is; a block the
        lease no longer holds (reshaped away meanwhile) is skipped."""
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None or entry.state is not LeaseState.ACTIVE:
                return
            entry.checksum_of.update(
                (b, c) for b, c in checksum_of.items() if b in entry.block_id_set
            )

    def checksums(self, lease_id: str, block_ids: Sequence[int]) -> list[int]:
        """The attached checksum of each of ``block_ids`` (0 where there is none)."""
        with self._lock:
            entry = self._entries.get(lease_id)
            checksum_of = entry.checksum_of if entry is not None else {}
            return [checksum_of.get(b, 0) for b in block_ids]

    def renew(self, lease_id: str) -> float:
        """Push the expiry ``ttl_s`` past now; returns the new ``expires_at``."""
        with self._lock:
            entry = self._active_entry(lease_id, self._clock())
            entry.expires_at = self._clock() + entry.ttl_s
            heapq.heappush(self._expiry_heap, (entry.expires_at, lease_id))
            return entry.expires_at

    def release(self, lease_id: str) -> None:
        """The decode side is done; the blocks become freeable once no read holds them.
        Releasing an ended lease is a no-op, so a retried release is harmless."""
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None:
                raise UnknownLeaseError(f"lease {lease_id!r} is unknown or already freed")
            if entry.state is LeaseState.ACTIVE:
                self._release(lease_id, entry)

    def begin_read(self, lease_id: str, block_ids: Sequence[int], release: bool = False) -> Lease:
        """Start serving a read of ``block_ids``; they stay allocated until ``end_read``.

        ``release``: the lease's last read (a hand-off's final pull) releases it here, so its
        blocks are freed as this read ends, without a separate release round trip."""
        with self._lock:
            entry = self._active_entry(lease_id, self._clock())
            outside = [b for b in block_ids if b not in entry.block_id_set]
            if outside:
                raise BlockNotLeasedError(
                    f"block ids {outside[:8]} are not under lease {lease_id!r} "
                    f"(it holds {len(entry.block_id_set)} blocks)"
                )
            unverifiable = [b for b in block_ids if b not in entry.checksum_of]
            if unverifiable:
                raise LeaseNotReadyError(
                    f"blocks {unverifiable[:8]} of lease {lease_id!r} have no checksums yet; "
                    f"their hand-off has not left the prefill worker, so no one should read them"
                )
            if len(set(block_ids)) != len(block_ids):
                raise RepeatedBlockError(
                    f"the read names {len(block_ids)} block ids but only "
                    f"{len(set(block_ids))} distinct ones; name each block once"
                )
            entry.reads_in_flight += 1
            if release:
                self._release(lease_id, entry)
            return entry.lease

    def end_read(self, lease_id: str) -> None:
        with self._lock:
            entry = self._entries[lease_id]  # kept while a read is in flight
            assert entry.reads_in_flight > 0, "end_read without begin_read"
            entry.reads_in_flight -= 1

    def reads_in_flight(self, lease_id: str) -> int:
        """Reads of the lease being served now (0 for a lease freed or never granted)."""
        with self._lock:
            entry = self._entries.get(lease_id)
            return entry.reads_in_flight if entry is not None else 0

    def take_freeable(self, now: float | None = None) -> list[str]:
        """Request ids whose blocks may be freed now: lease released or expired and no read
        in flight. Each is returned once and its lease forgotten."""
        with self._lock:
            now = self._clock() if now is None else now
            while self._expiry_heap and self._expiry_heap[0][0] <= now:
                expires_at, lease_id = heapq.heappop(self._expiry_heap)
                entry = self._entries.get(lease_id)
                if (
                    entry is not None
                    and entry.state is LeaseState.ACTIVE
                    and entry.expires_at == expires_at
                ):
                    self._expire(lease_id, entry)
            freeable = [
                lease_id for lease_id in self._ended if self._entries[lease_id].reads_in_flight == 0
            ]
            request_ids = []
            for lease_id in freeable:
                self._ended.discard(lease_id)
                request_ids.append(self._entries.pop(lease_id).lease.request_id)
            return request_ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _active_entry(self, lease_id: str, now: float) -> _LeaseEntry:
        entry = self._entries.get(lease_id)
        if entry is None:
            raise UnknownLeaseError(f"lease {lease_id!r} is unknown or already freed")
        if entry.state is LeaseState.ACTIVE and entry.expires_at <= now:
            self._expire(lease_id, entry)
        if entry.state is not LeaseState.ACTIVE:
            raise LeaseEndedError(
                f"lease {lease_id!r} was {entry.state.value}; "
                "its blocks may already be freed, recompute them"
            )
        return entry

    def _release(self, lease_id: str, entry: _LeaseEntry) -> None:
        entry.state = LeaseState.RELEASED
        self._ended.add(lease_id)

    def _expire(self, lease_id: str, entry: _LeaseEntry) -> None:
        entry.state = LeaseState.EXPIRED
        self._ended.add(lease_id)
        self.num_expired += 1
        if self._stats is not None:
            self._stats.record_lease_expiry()


def _check_one_checksum_per_block(block_ids: Sequence[int], checksums: Sequence[int]) -> None:
    if len(checksums) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids but {len(checksums)} checksums")
