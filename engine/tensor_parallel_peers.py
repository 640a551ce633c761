"""Ranks 1..k-1 of a tensor-parallel engine: processes beside it that run every step.

A worker of degree ``k`` is one engine (rank 0: ledger, scheduler, sampler, connector) and
``k - 1`` peer processes, each holding its slice of the model (``LlamaForCausalLM.shard``).
Rank 0 sends each step's chunks down a pipe to every peer, then runs its own forward; the
gloo collectives inside the forward keep the ranks in lock-step, and only rank 0's logits
are sampled:

    engine process (rank 0)                          peer process (rank r)
    ModelRunner.execute(chunks)
      peers.send(chunks) ──── pipe (ordered) ──────▶ ModelRunner.execute(chunks)
      its slice's forward ◀── all-reduce / gather ──▶ its slice's forward
      logits → sampler                               logits dropped

    KV pages: one shared mapping of [blocks, layers, K/V, block, kv_heads, head]; rank r's
    attention reads and writes its KV heads' view of it, and the connector, the tier and
    the transports see whole blocks, as at TP=1 (so a hand-off between workers of unequal
    degrees moves the same bytes as between two TP=1 workers, with no re-layout).

Why processes of rank 0's own (vLLM's multiprocess executor) and not Ray actors: the ranks
of a worker share its node and its pages, a pipe costs microseconds a step where a Ray call
costs a millisecond, and the peers live exactly as long as rank 0 (a peer whose pipe closes
exits; rank 0 learns of a peer's death from its process sentinel and from the collectives,
whose connections reset at once). The deployer reserves the worker's resources for all of
its ranks (``deploy/app.py: worker_actor_options``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing

from pdserve.model.tensor_parallel import GROUP_HOST, TensorParallel, join_group

if TYPE_CHECKING:
    from pdserve.engine.model_input import ScheduledChunk
    from pdserve.messages.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# Every collective fails after this long without its peers (a rank that stopped answering);
# a dead rank fails the others at once. The ranks of a step differ by at most one layer's
# work, far below it.
GROUP_TIMEOUT = timedelta(seconds=60)
# How long a peer may take to load its slice of the model and report ready.
_START_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 5.0
_JOIN_POLL_S = 0.05  # how often rank 0's join looks at its peers' sentinels
# What a starting peer sends rank 0: before it joins the group, then once its runner is built.
_JOINING = "joining"
_READY = "ready"


class TensorParallelGroupLost(RuntimeError):
    """A rank of the engine's group died or failed: the engine cannot step again."""


class TensorParallelPeers:
    """Starts ranks ``1..world_size-1`` and feeds them each step; rank 0 is the caller.

    ``on_lost`` is called (from a watchdog thread) when a peer process ends while the group
    is open: a worker exits then, so that it is restarted whole (a lost rank leaves the
    group unusable).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        kv_pages: torch.Tensor,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        self.world_size = config.tensor_parallel_size
        store = dist.TCPStore(
            GROUP_HOST,
            0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=GROUP_TIMEOUT,
        )
        context = torch.multiprocessing.get_context("spawn")
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._processes: list[Any] = []
        self._closed = threading.Event()
        self._on_lost = on_lost
        self._store = store  # the peers meet through it until the group is joined
        try:
            for rank in range(1, self.world_size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=run_peer,
                    args=(rank, store.port, config, num_blocks, kv_pages, theirs),
                    name=f"{config.engine_id}-tp{rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                self._pipes.append(ours)
                self._processes.append(process)
            self._wait_until_joining()
            self.tensor_parallel = self._join_watching_peers(store)
        except BaseException:  # the ranks started so far would outlive the failed start
            self.close()
            raise

    def _wait_until_joining(self) -> None:
        """Wait until every peer says it is joining the group. Why: gloo's join waits out the
        group's whole timeout (60 s) for a rank that never comes, then blames the timeout;
        a peer that fails or dies first (its interpreter did not start, it was killed) fails
        the start here at once, with its error or its exit code."""
        waiting = dict(enumerate(zip(self._pipes, self._processes), start=1))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while waiting:
            watched = [
                end for pipe, process in waiting.values() for end in (pipe, process.sentinel)
            ]
            left = deadline - time.monotonic()
            if left <= 0 or not multiprocessing.connection.wait(watched, timeout=left):
                raise TensorParallelGroupLost(
                    f"rank {min(waiting)} did not start in {_START_TIMEOUT_S} s"
                )
            for rank, (pipe, process) in list(waiting.items()):
                if pipe.poll():
                    message = _start_message(pipe, process)
                    if message != _JOINING:
                        raise TensorParallelGroupLost(f"rank {rank} failed to start: {message}")
                    del waiting[rank]
                elif not process.is_alive():
                    raise TensorParallelGroupLost(
                        f"rank {rank} failed to start: {_start_message(pipe, process)}"
                    )

    def _join_watching_peers(self, store: dist.Store) -> TensorParallel:
        """Rank 0's join, failed at once by a peer that dies while the group forms. Why: a
        peer that said it joins and then dies (killed, out of memory) left rank 0's join to
        wait out the group's whole timeout (60 s). The join runs on a thread here while this
        one watches the peers' sentinels; a join abandoned so ends with its timeout, on a
        thread that holds nothing."""
        joined: list[TensorParallel] = []
        failed: list[BaseException] = []

        def join() -> None:
            try:
                joined.append(join_group(store, 0, self.world_size, GROUP_TIMEOUT))
            except BaseException as error:  # noqa: BLE001 - raised below, on the caller's thread
                failed.append(error)

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        sentinels = [process.sentinel for process in self._processes]
        while thread.is_alive():
            if multiprocessing.connection.wait(sentinels, timeout=_JOIN_POLL_S):
                raise TensorParallelGroupLost(f"the group did not form: {self.failure()}")
        if failed:
            raise failed[0]
        return joined[0]

    @property
    def pids(self) -> list[int]:
        """The peers' process ids, rank 1 first."""
        return [process.pid for process in self._processes]

    def wait_ready(self) -> None:
        """Wait until every peer has built its runner; a peer that failed raises its error."""
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            if not pipe.poll(_START_TIMEOUT_S):
                raise TensorParallelGroupLost(f"rank {rank} did not start in {_START_TIMEOUT_S} s")
            message = _start_message(pipe, process)
            if message != _READY:
                raise TensorParallelGroupLost(f"rank {rank} failed to start: {message}")
        threading.Thread(target=self._watch, name="tp-peer-watchdog", daemon=True).start()

    def send(
        self, chunks: list[ScheduledChunk], lora_adapters: dict[str, tuple[str, str]] | None
    ) -> None:
        """Give every peer this step's chunks (before rank 0 runs its own forward), and the
        LoRA adapters to hold where they changed (``ModelRunner.hold_lora_adapters``),
        pickled once for all of them (``recv`` unpickles what ``send`` would)."""
        payload = ForkingPickler.dumps((chunks, lora_adapters))
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(payload)
            except OSError as error:  # a broken pipe: the peer is gone
                reason = self.failure() or f"rank {rank} is gone: {error}"
                raise TensorParallelGroupLost(reason) from error

    def failure(self) -> str | None:
        """Why the group cannot step (a peer that exited, with its error if it sent one),
        or None while every peer runs."""
        for rank, (pipe, process) in enumerate(zip(self._pipes, self._processes), start=1):
            if multiprocessing.connection.wait([process.sentinel], timeout=0):
                process.join(_STOP_TIMEOUT_S)  # ended: reap it (its exit code may lag)
                reason = f"rank {rank} (pid {process.pid}) exited with {process.exitcode}"
                if pipe.poll():
                    with contextlib.suppress(
                        EOFError, OSError
                    ):  # a dying peer's pipe may be closed
                        reason += f": {pipe.recv()}"
                return reason
        return None

    def close(self) -> None:
        """Stop the peers (each exits when its pipe closes) and reap them."""
        if self._closed.is_set():
            return
        self._closed.set()
        for pipe in self._pipes:
            pipe.close()
        for process in self._processes:
            process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(_STOP_TIMEOUT_S)

    def _watch(self) -> None:
        sentinels = [process.sentinel for process in self._processes]
        multiprocessing.connection.wait(sentinels)
        if self._closed.is_set():
            return
        logger.error("tensor-parallel group lost: %s", self.failure())
        if self._on_lost is not None:
            self._on_lost()


def _start_message(
    pipe: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess
) -> str:
    """What a starting peer sent (``_JOINING``, ``_READY`` or its error), or, where its pipe
    closed with nothing in it, how it exited."""
    try:
        return str(pipe.recv())
    except (EOFError, OSError):
        process.join(_STOP_TIMEOUT_S)
        return f"pid {process.pid} exited with {process.exitcode}"


def run_peer(
    rank: int,
    port: int,
    config: EngineConfig,
    num_blocks: int,
    kv_pages: torch.Tensor,
    pipe: multiprocessing.connection.Connection,
) -> None:
    """A peer's life: join the group, build its slice, then run each step rank 0 sends
    until the pipe closes. An error is sent back (rank 0 reports it) before exiting."""
    # Imported here: the runner's module imports this one.
    from pdserve.engine.model_runner import ModelRunner, configure_torch_threads
    from pdserve.model.loader import load_model

    try:
        configure_torch_threads(config.torch_threads)
        store = dist.TCPStore(GROUP_HOST, port, config.tensor_parallel_size, timeout=GROUP_TIMEOUT)
        pipe.send(_JOINING)
        tensor_parallel = join_group(store, rank, config.tensor_parallel_size, GROUP_TIMEOUT)
        model, model_config, _ = load_model(
            config.model, config.dtype, config.device, config.quantization
        )
        runner = ModelRunner.for_engine(
            config, model, model_config, num_blocks, kv_pages, tensor_parallel
        )
        pipe.send(_READY)
        while True:
            try:
                chunks, lora_adapters = pipe.recv()
            except EOFError:  # rank 0 closed the group, or died
                return
            if lora_adapters is not None:
                runner.hold_lora_adapters(lora_adapters, config.max_lora_rank)
            runner.execute(chunks)
    except BaseException as error:  # noqa: BLE001 - reported to rank 0, then this rank ends
        with contextlib.suppress(EOFError, OSError):  # a dying peer's pipe may be closed
            pipe.send(f"{type(error).__name__}: {error}")
        raise SystemExit(1) from None
