"""Which prefill and which decode worker serve a request: prefix first, then load.

The router keeps, per worker, the block hashes that worker's ledger holds per KV cache group
(``cache.HeldBlocks``), built from the worker's KV events (``BlockStored`` / ``BlockRemoved``
/ ``AllBlocksCleared``); a sliding-window group needs only a prefix's last blocks. A prompt's
block hashes form a chain (hash ``i`` covers tokens ``0 .. (i+1)*block_size``), so a worker can
reuse only a *contiguous prefix* of them:

    prompt hashes:   h0  h1  h2  h3  h4
    worker A holds:  h0  h1  --  h3         → prefix match 2 blocks (h3 is useless without h2)
    worker B holds:  h0  h1  h2             → prefix match 3 blocks   ← prefill goes here

A worker with a KV tier (KV events with a ``medium``) continues a prefix past its pool: those
blocks load back instead of being computed, but a load is not free, so a pool block ranks
twice a tier block (``prefix_rank``); the matched count includes both:

    worker A: pool h0 h1 h2          rank 2*3 + 0 = 6   ← a pool hit wins a tie of length
    worker B: pool h0 | tier h1 h2   rank 2*1 + 2 = 4

For decode the connector pulls exactly the blocks the decode worker lacks, so every held
hash saves a transfer: a decode candidate's cost counts the blocks it would pull. But a held
hash must not outweigh any load: with one shared system prompt every request would go to the
worker that served it first, and a decode worker added by a scale step would get nothing
until that one hit the load cap. So each request in flight on a candidate costs as much as
the request's own blocks (times ``decode_load_weight``), as a running request of similar
size does; the cheapest candidate wins, then the one holding more:

    request of 66 blocks, 64 of them a shared system prompt
    old worker: holds 64, 2 in flight   cost  2 + 2 * 66 = 134
    new worker: holds  0, 0 in flight   cost 66 + 0 * 66 =  66   ← goes here, then holds them
    (one in flight on each: 2 + 66 against 66 + 66: the holder; loads level off)

Prefill weighs its prefix against load the same way, in what a worker would compute: its
uncached part of the prompt (``prefix_rank``'s half-blocks: a tier block loads, at about half
a computed one's cost), with each request in flight there taken to cost as much again, as
it would queue ahead (times ``prefill_load_weight``). A prefill worker added by a scale step
holds no shared prefix; ranked by prefix alone it would get nothing until every holder hit
the load cap, while the holders' queues ate the TTFT the step was for:

    4,200-token prompt (262 blocks), its first 30 a shared prefix
    holder: 1 in flight   cost (1 + 1) * 2 * (262 - 30) = 928
    new:    0 in flight   cost (1 + 0) * 2 * 262        = 524   ← goes here, then holds it
    (the holder idle: 464 against 524, the holder)

Load (requests in flight through this gateway) also caps hot spots of both roles: a worker
more than ``max_load_imbalance`` requests busier than the idlest one is not a candidate,
whatever it holds; it breaks the last ties. Equal candidates are taken in turn, so a cold
cluster spreads its load.

A request that runs a LoRA adapter goes first to a worker holding the adapter in memory,
then to one that has it registered (it reads the files again), then to any (which reads them
from the path the request brings); within each, as above. Its block hashes carry the
adapter's digest, so the prefix a worker holds is already the adapter's own. Which adapters
each worker has comes with its KV events (``LoRAAdapterReport``); their union is what the
gateway serves (``lora_adapters``).

Pure Python: no Ray, no engine; the gateway feeds it ``KVEventBatch`` messages.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cache import BlockHash, HeldBlocks
from pdserve.messages.kv_event_batch import KVEventBatch
from pdserve.messages.lora_adapters import LoRAAdapterRef, LoRAAdapterReport


class NoWorkerAvailable(RuntimeError):
    """Every worker of the needed role is down or not answering (the gateway sends 503)."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no {role} worker is available")
        self.role = role


@dataclass(slots=True)
class WorkerIndex:
    """What the router knows of one worker: its instance, event cursor, hashes and load.

    ``available`` is False while the worker does not answer (dead, restarting, hung): it
    is not picked until it answers again. ``left_routing`` is set meanwhile, for the calls
    already made to it to stop waiting.
    """

    instance_id: str | None = None
    next_seq: int = 0
    held: HeldBlocks = field(default_factory=HeldBlocks)
    load: int = 0
    available: bool = True
    left_routing: asyncio.Event = field(default_factory=asyncio.Event)
    lora: LoRAAdapterReport = field(default_factory=LoRAAdapterReport)

    def holds_adapter(self, lora_name: str | None) -> int:
        """2: ``lora_name`` is in memory here; 1: registered (read again); 0: neither (or
        the base model: no preference)."""
        if lora_name is None:
            return 0
        if lora_name in self.lora.resident:
            return 2
        return int(any(ref.name == lora_name for ref in self.lora.registered))


def prefix_rank(held: HeldBlocks, block_hashes: list[BlockHash]) -> tuple[int, int]:
    """``(rank, matched blocks)`` of a worker's prefix: pool blocks count twice tier blocks."""
    num_pool = held.prefix_match(block_hashes)
    num_tier = held.num_tier_blocks_after(block_hashes, num_pool)
    return 2 * num_pool + num_tier, num_pool + num_tier


# A candidate's key (the greatest wins) and matched blocks, from what it holds, its load,
# the request's block hashes and the role's load weight.
Ranking = Callable[[WorkerIndex, int, list[BlockHash], float], tuple[tuple[float, ...], int]]


def _ranked_by_prefix(
    index: WorkerIndex, load: int, block_hashes: list[BlockHash], _: float
) -> tuple[tuple[float, ...], int]:
    """A whole run's key (conditional disaggregation): its prefix's rank, then the idler."""
    rank, matched = prefix_rank(index.held, block_hashes)
    return (rank, -load), matched


def _ranked_by_compute_and_load(
    index: WorkerIndex, load: int, block_hashes: list[BlockHash], load_weight: float
) -> tuple[tuple[float, ...], int]:
    """A prefill worker's key: the least to compute, each request in flight there counted
    as this one again, then the longer prefix, then the idler (module doc)."""
    rank, matched = prefix_rank(index.held, block_hashes)
    to_compute = max(1, 2 * len(block_hashes) - rank)  # half-blocks; the last token always
    cost = (1 + load_weight * load) * to_compute
    return (-cost, rank, -load), matched


def _ranked_by_pull_and_load(
    index: WorkerIndex, load: int, block_hashes: list[BlockHash], load_weight: float
) -> tuple[tuple[float, ...], int]:
    """A decode worker's key: the fewest blocks to pull plus its load in blocks, then the
    hashes it holds (the module's docstring draws it)."""
    num_held = index.held.count_held(block_hashes)
    num_missing = len(block_hashes) - num_held
    cost = num_missing + load_weight * load * max(1, len(block_hashes))
    return (-cost, num_held), num_held


@dataclass(slots=True)
class RouteChoice:
    worker_id: str
    num_matched_blocks: int


class Router:
    """Prefix- and load-aware choice among named prefill and decode workers."""

    def __init__(
        self,
        prefill_worker_ids: list[str],
        decode_worker_ids: list[str],
        max_load_imbalance: int = 4,
        decode_load_weight: float = 1.0,
        prefill_load_weight: float = 1.0,
    ) -> None:
        if not prefill_worker_ids:
            raise ValueError("the router needs at least one prefill worker")
        if max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be >= 0, got {max_load_imbalance}")
        if decode_load_weight < 0 or prefill_load_weight < 0:
            raise ValueError(
                f"decode_load_weight and prefill_load_weight must be >= 0, got "
                f"{decode_load_weight} and {prefill_load_weight}"
            )
        self.max_load_imbalance = max_load_imbalance
        self.load_weights = {"prefill": prefill_load_weight, "decode": decode_load_weight}
        self._workers: dict[str, WorkerIndex] = {}
        self._prefill_ids = list(prefill_worker_ids)
        self._decode_ids = list(decode_worker_ids)
        for worker_id in self._prefill_ids + self._decode_ids:
            self._workers[worker_id] = WorkerIndex()
        self._turn = itertools.count()

    # ------------------------------------------------------------------ events

    def next_seq(self, worker_id: str) -> int:
        """The first event sequence number the router has not seen from ``worker_id``."""
        return self._workers[worker_id].next_seq

    def apply(self, batch: KVEventBatch) -> None:
        """Folds a worker's KV events into its index; overlapping batches are idempotent."""
        index = self._workers.get(batch.worker_id)
        if index is None:
            return  # a worker removed since the call was made
        if batch.instance_id != index.instance_id:
            # A restarted worker: its old blocks are gone, and its sequence restarted.
            index.instance_id = batch.instance_id
            index.held = HeldBlocks()
            index.next_seq = 0
            index.lora = batch.lora
            if batch.snapshot is None and batch.first_seq > 0:
                return  # partial history of a new instance: wait for a batch from 0 or a snapshot
        self.note_lora(batch.worker_id, batch.lora)
        if batch.snapshot is not None:
            index.held = batch.snapshot.copy()
            index.next_seq = batch.first_seq
        if batch.next_seq <= index.next_seq:
            return
        skip = max(0, index.next_seq - batch.first_seq)
        for event in batch.events[skip:]:
            index.held.apply(event)
        index.next_seq = batch.next_seq

    def note_lora(self, worker_id: str, report: LoRAAdapterReport) -> None:
        """Keeps a worker's adapters as ``report`` says, unless a newer report of the same
        instance came first (a poll's answer may overtake an admin load's, or trail it)."""
        index = self._workers.get(worker_id)
        if index is None or report.instance_id != index.instance_id:
            return
        if report.generation >= index.lora.generation:
            index.lora = report

    def lora_adapters(self) -> dict[str, LoRAAdapterRef]:
        """The adapters the service serves: every worker's registered ones, by name (two
        workers that read one name from different files: the first worker's)."""
        served: dict[str, LoRAAdapterRef] = {}
        for index in self._workers.values():
            for ref in index.lora.registered:
                served.setdefault(ref.name, ref)
        return served

    def add_worker(self, worker_id: str, role: str) -> None:
        """A worker a scale step added (``role``: "prefill" or "decode"). It enters routing
        once its event poll answers: until then it may still be loading its model, and a
        request sent there would wait for the load."""
        if worker_id in self._workers:
            return
        self._workers[worker_id] = WorkerIndex()
        self.set_available(worker_id, False)
        (self._prefill_ids if role == "prefill" else self._decode_ids).append(worker_id)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def remove_worker(self, worker_id: str) -> None:
        """Forgets a worker (scaled away or dead): it is never picked again."""
        self._workers.pop(worker_id, None)
        for ids in (self._prefill_ids, self._decode_ids):
            if worker_id in ids:
                ids.remove(worker_id)

    def instance_id(self, worker_id: str) -> str | None:
        """The worker instance the router last heard from (None: not yet, or removed)."""
        index = self._workers.get(worker_id)
        return index.instance_id if index is not None else None

    def set_available(self, worker_id: str, available: bool) -> None:
        """Takes a worker out of routing (it stopped answering) or puts it back."""
        index = self._workers.get(worker_id)
        if index is None:
            return
        index.available = available
        if available:
            index.left_routing.clear()
        else:
            index.left_routing.set()

    def is_available(self, worker_id: str) -> bool:
        index = self._workers.get(worker_id)
        return index is not None and index.available

    def left_routing(self, worker_id: str) -> asyncio.Event | None:
        """Set while ``worker_id`` is out of routing; None for a worker the router does not
        know (removed)."""
        index = self._workers.get(worker_id)
        return index.left_routing if index is not None else None

    # ------------------------------------------------------------------ load

    def begin(self, worker_id: str) -> None:
        if worker_id in self._workers:
            self._workers[worker_id].load += 1

    def end(self, worker_id: str) -> None:
        if worker_id in self._workers:
            index = self._workers[worker_id]
            index.load = max(0, index.load - 1)

    def num_in_flight(self) -> int:
        """Worker streams in flight through this gateway (the event poll keeps its pace
        while any is)."""
        return sum(index.load for index in self._workers.values())

    # ------------------------------------------------------------------ choice

    def pick_prefill(
        self, block_hashes: list[BlockHash], lora_name: str | None = None
    ) -> RouteChoice:
        """The prefill worker that would compute least of ``block_hashes`` for its load
        (among those that hold adapter ``lora_name`` best).

        Raises ``NoWorkerAvailable`` when no prefill worker is available.
        """
        return self._pick(
            "prefill", self._prefill_ids, block_hashes, _ranked_by_compute_and_load, lora_name
        )

    def longest_prefill_prefix(self, block_hashes: list[BlockHash]) -> int:
        """The most blocks of ``block_hashes``' prefix any available prefill worker holds,
        whatever its load: what the prefill role could reuse, where ``pick_prefill`` may pass
        the holder over for a busy one. Raises ``NoWorkerAvailable`` when none is available."""
        held = [
            prefix_rank(self._workers[w].held, block_hashes)[1]
            for w in self._prefill_ids
            if self._workers[w].available
        ]
        if not held:
            raise NoWorkerAvailable("prefill")
        return max(held)

    def has_decode_workers(self) -> bool:
        """Whether the deployment disaggregates (False: colocated, prefill workers decode)."""
        return bool(self._decode_ids)

    def pick_decode(
        self, block_hashes: list[BlockHash], lora_name: str | None = None
    ) -> RouteChoice | None:
        """The decode worker that would pull least of ``block_hashes`` for its load (among
        those that hold adapter ``lora_name`` best); None when the deployment has none
        (colocated). Raises ``NoWorkerAvailable`` when it has some but none is available."""
        if not self._decode_ids:
            return None
        return self._pick(
            "decode", self._decode_ids, block_hashes, _ranked_by_pull_and_load, lora_name
        )

    def pick_decode_by_prefix(
        self, block_hashes: list[BlockHash], lora_name: str | None = None
    ) -> RouteChoice:
        """The decode worker with the longest cached prefix of ``block_hashes``: where a
        request would run whole if the gateway skips the prefill worker (conditional
        disaggregation). Raises ``NoWorkerAvailable`` when none is available."""
        return self._pick("decode", self._decode_ids, block_hashes, _ranked_by_prefix, lora_name)

    def prefill_loads(self) -> dict[str, int]:
        """Each available prefill worker's requests in flight through this gateway."""
        return {w: self._workers[w].load for w in self._prefill_ids if self._workers[w].available}

    def better_prefill_worker(
        self,
        worker_id: str,
        block_hashes: list[BlockHash],
        lora_name: str | None,
        loads: dict[str, int],
    ) -> str | None:
        """Where ``pick_prefill`` would place, now, a request that waits on prefill worker
        ``worker_id`` (its own load there taken off), were the available workers' loads
        ``loads`` (``prefill_loads``, with the moves already decided); None: ``worker_id``
        itself, which wins a tie, or a worker out of routing (its calls are watched)."""
        if worker_id not in loads:
            return None
        view = {**loads, worker_id: loads[worker_id] - 1}
        others = [w for w in view if w != worker_id]
        best_id, _ = self._best(
            "prefill",
            [worker_id, *others],
            view,
            block_hashes,
            _ranked_by_compute_and_load,
            lora_name,
        )
        return None if best_id == worker_id else best_id

    def _pick(
        self,
        role: str,
        all_ids: list[str],
        block_hashes: list[BlockHash],
        ranked: Ranking,
        lora_name: str | None,
    ) -> RouteChoice:
        worker_ids = [w for w in all_ids if self._workers[w].available]
        if not worker_ids:
            raise NoWorkerAvailable(role)
        # Rotate the start so that equal candidates are taken in turn.
        start = next(self._turn) % len(worker_ids)
        rotated = worker_ids[start:] + worker_ids[:start]
        loads = {w: self._workers[w].load for w in rotated}
        best_id, matched = self._best(role, rotated, loads, block_hashes, ranked, lora_name)
        return RouteChoice(worker_id=best_id, num_matched_blocks=matched)

    def _best(
        self,
        role: str,
        worker_ids: list[str],
        loads: dict[str, int],
        block_hashes: list[BlockHash],
        ranked: Ranking,
        lora_name: str | None,
    ) -> tuple[str, int]:
        """The best of ``worker_ids`` (the first of equals) at ``loads``, and the blocks it
        matched: by adapter, then ``ranked``, among those within ``max_load_imbalance`` of
        the idlest."""
        ceiling = min(loads[w] for w in worker_ids) + self.max_load_imbalance
        best: tuple[float, ...] | None = None
        best_matched = 0
        best_id = worker_ids[0]
        for worker_id in worker_ids:
            load = loads[worker_id]
            if load > ceiling:
                continue
            index = self._workers[worker_id]
            key, matched = ranked(index, load, block_hashes, self.load_weights[role])
            key = (index.holds_adapter(lora_name), *key)
            if best is None or key > best:
                best, best_matched, best_id = key, matched, worker_id
        assert best is not None  # the idlest worker is always under the ceiling
        return best_id, best_matched
