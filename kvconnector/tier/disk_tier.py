"""The disk level of the KV tier: one file per page in a directory of this run's own.

    <disk_path>/<app>/<worker_id>/run-<random>/<block hash hex>.kv     page_bytes raw bytes

Writes leave the step path: ``store`` copies the page into a host buffer and queues it; a
writer thread writes ``.tmp`` then renames, so a reader never sees half a file, and only
then indexes it (an entry whose write is queued is served from its buffer). Loads read on
the caller's thread (the tier connector's loader), straight into the destination buffer.

The checksums live in this process's memory, not in the files, so a restarted worker cannot
trust what it finds: **a disk tier starts empty** and deletes the runs it finds beside its
own (a killed worker's, which never closed; or the run of the worker instance it replaces,
which may still be stopping: that one's loads then fail their check and are recomputed).
Each run writes only in its own directory, so two instances of one worker, a new one
starting while Serve stops the old, never write into, or delete, each other's live pages.
A missing directory is created; one that cannot be created or written is an error at
start. A write that fails later (disk full, directory removed) is a counted store failure
and the page is simply not kept.

Pages are a tenant's data: the directories are the owner's alone (0700), each page file
too (0600), and a closed tier (its worker stopped, scaled away or its app taken down)
deletes its pages and its run directory (and the worker's, when no other run is left). The
deployment gives each app its own directory under ``kv_tier_disk_path``
(``<disk_path>/<app>/<worker>``), so two apps sharing a path never delete each other's pages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np

from pdserve.cache import BlockHash
from pdserve.kvconnector.checksum import page_checksum
from pdserve.kvconnector.tier.tier_level import FillPage, TierLevel
from pdserve.kvconnector.tier.tier_lru import TierLRU, capacity_for_budget

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".kv"
# Pages queued for the writer at most; beyond, a store is dropped (counted as a failure)
# rather than letting a slow disk grow host memory without bound.
MAX_QUEUED_WRITES = 256


DIRECTORY_MODE = 0o700
PAGE_MODE = 0o600


RUN_PREFIX = "run-"


def prepare_run_directory(worker_directory: Path) -> Path:
    """Creates ``worker_directory`` (the owner's alone) and a new run directory in it,
    deletes earlier runs and stray pages there, checks that it is writable; the run's path."""
    try:
        worker_directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        worker_directory.chmod(DIRECTORY_MODE)  # mkdir's mode is masked by the umask
        for stale in worker_directory.iterdir():
            if stale.is_dir() and stale.name.startswith(RUN_PREFIX):
                _delete_run(stale)
            elif stale.suffix in (PAGE_SUFFIX, ".tmp"):  # a layout before runs had their own
                stale.unlink()
        run = worker_directory / f"{RUN_PREFIX}{uuid.uuid4().hex[:12]}"
        run.mkdir(mode=DIRECTORY_MODE)
        run.chmod(DIRECTORY_MODE)
        probe = run / ".write-probe.tmp"
        probe.write_bytes(b"pdserve")
        probe.unlink()
    except OSError as error:
        raise ValueError(
            f"the disk KV tier cannot use {str(worker_directory)!r}: {error}. Point "
            "kv_tier_disk_path at a writable directory, or leave it unset "
            "(no disk tier)"
        ) from error
    return run


def _delete_run(run: Path) -> None:
    """Deletes a run's pages and its directory (a file that is not a page stays, and with it
    the directory); a run already gone is fine."""
    try:
        for page_file in run.iterdir():
            if page_file.suffix in (PAGE_SUFFIX, ".tmp"):
                page_file.unlink(missing_ok=True)
        run.rmdir()
    except FileNotFoundError:
        pass  # removed already: by an operator, or by the worker instance that replaced it


class DiskTier(TierLevel):
    medium = "disk"

    def __init__(
        self, worker_directory: str | Path, budget_bytes: int, page_bytes: int, block_size: int
    ) -> None:
        super().__init__(page_bytes, block_size)
        self._index: TierLRU[int] = TierLRU(
            capacity_for_budget(self.medium, budget_bytes, page_bytes)
        )
        self.worker_directory = Path(worker_directory)
        self.directory = prepare_run_directory(self.worker_directory)  # this run's pages
        self._queued: OrderedDict[BlockHash, tuple[np.ndarray, int]] = OrderedDict()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-tier-disk-writer", daemon=True
        )
        self._writer.start()

    def path_of(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{PAGE_SUFFIX}"

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            if not isinstance(block_hash, bytes):  # a BlockHash is bytes: nothing else is held
                return False
            return block_hash in self._queued or self._index.get(block_hash) is not None

    def num_pages(self) -> int:
        return len(self._index)

    def num_queued(self) -> int:
        with self._lock:
            return len(self._queued)

    # ---- writing --------------------------------------------------------------------
    def store(self, block_hash: BlockHash, fill: FillPage, checksum: int | None = None) -> None:
        with self._lock:
            if block_hash in self._queued or self._index.get(block_hash) is not None:
                return
            if len(self._queued) >= MAX_QUEUED_WRITES or self._closed:
                self.counters.store_failures += 1
                return
        page = np.empty(self.page_bytes, dtype=np.uint8)
        fill(page)
        if checksum is None:
            checksum = page_checksum(page)
        with self._lock:
            self._queued[block_hash] = (page, checksum)
            self._wake.notify()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queued and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                block_hash, (page, checksum) = next(iter(self._queued.items()))
            started = time.perf_counter()
            written = self._write_file(block_hash, page)
            with self._lock:
                self._queued.pop(block_hash, None)
                counters = self.counters
                if not written:
                    counters.store_failures += 1
                    continue
                pinned = block_hash in self.pins  # promised while queued: kept, over budget
                if not self._make_room() and not pinned:  # every page is pinned for a load
                    self.path_of(block_hash).unlink(missing_ok=True)
                    counters.store_failures += 1
                    continue
                self._index.put(block_hash, checksum, over_capacity=pinned)
                self._stored_event(block_hash)
                counters.record_store(self.page_bytes, time.perf_counter() - started)

    def _write_file(self, block_hash: BlockHash, page: np.ndarray) -> bool:
        path = self.path_of(block_hash)
        temporary = path.with_suffix(".tmp")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PAGE_MODE)
            with open(descriptor, "wb") as file:
                file.write(page.data)  # the page's buffer, as memoryview(page)
            os.replace(temporary, path)
            return True
        except OSError as error:
            logger.warning(
                "disk KV tier: could not write %s (%s); the page is not kept", path, error
            )
            temporary.unlink(missing_ok=True)
            return False

    def _make_room(self) -> bool:
        """Under the lock: evicts until a page fits; False when only pinned pages are left."""
        while self._index.is_full:
            if not self._evict_lru():
                return False
        return True

    def _evict_lru(self) -> bool:
        """Under the lock: deletes the least recently used page not pinned; False when
        every page is pinned."""
        popped = self._index.pop_lru(self.pins)
        if popped is None:
            return False
        victim, _ = popped
        self.path_of(victim).unlink(missing_ok=True)
        self.counters.evictions += 1
        self._removed_event(victim)
        return True

    # ---- reading --------------------------------------------------------------------
    def load(self, block_hash: BlockHash, dst: np.ndarray) -> bool:
        started = time.perf_counter()
        with self._lock:
            queued = self._queued.get(block_hash)
            if queued is not None:
                np.copyto(dst, queued[0])
                checksum = queued[1]
            else:
                indexed = self._index.get(block_hash)
                if indexed is None:
                    return False
                checksum = indexed
        ok = (queued is not None or self._read_file(block_hash, dst)) and page_checksum(
            dst
        ) == checksum
        with self._lock:
            self.counters.record_load(ok, self.page_bytes, time.perf_counter() - started)
        return ok

    def _read_file(self, block_hash: BlockHash, dst: np.ndarray) -> bool:
        """Reads exactly one page; a short or missing file is a failed load."""
        try:
            with open(self.path_of(block_hash), "rb") as file:
                return file.readinto(dst.data) == self.page_bytes and not file.read(1)
        except OSError as error:
            logger.warning("disk KV tier: could not read %s: %s", self.path_of(block_hash), error)
            return False

    def discard(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._queued.pop(block_hash, None)
            if self._index.pop(block_hash) is not None:
                self.path_of(block_hash).unlink(missing_ok=True)
                self._removed_event(block_hash)

    def close(self) -> None:
        """Stops the writer and deletes every page and the directory: queued pages are
        dropped (the tier is a cache), and no tenant's KV outlives the worker on disk."""
        with self._lock:
            self._closed = True
            self._queued.clear()
            self._wake.notify()
        self._writer.join(timeout=5.0)
        with self._lock:
            self._index = TierLRU(self._index.capacity)
            try:
                _delete_run(self.directory)
                self.worker_directory.rmdir()  # only when no other run (or file) is there
            except FileNotFoundError:
                pass  # removed already
            except OSError as error:  # a file of someone else's, or a newer run: leave it
                logger.info("disk KV tier: %s left in place: %s", self.worker_directory, error)
