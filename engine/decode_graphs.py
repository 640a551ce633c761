"""CUDA graphs of the static decode step: one per padded size, captured at start, replayed.

Why: a small model's decode step on a GPU is launch-bound. Eager, its few hundred kernels are
launched one after another from Python (13 ms a step for smollm2's shape on an H200, where
the bytes it reads take under 0.5 ms); a graph replays them all with one launch. vLLM runs
decode instances of a P/D deployment this way (``FULL_DECODE_ONLY``).

What is captured is ``ModelRunner.padded_decode_forward``: the forward over the buffers of
``engine/static_decode_batch.py``, whose tensors depend only on the padded row count and the
queries per row, so a replay reads whatever the step's ``fill`` wrote there::

    start:  for queries in (1, 1 + k):
                for size in (max_rows, ..., 8, 4, 2, 1):     (largest first: the smaller
                    warm-up run (Triton compiles here)          sizes reuse its memory in
                    capture padded_decode_forward(size, queries)  the one shared pool)
    step:   fill(chunks) ─▶ replay graph(padded, queries) ─▶ LM head on hidden[:rows]

A graph ends at the final hidden states: the LM head runs after the replay on the real rows
alone, so no graph holds logits (a vocabulary's width for every padded row of every size,
hundreds of MB for a 128k vocabulary at 64 rows). Prefill and mixed steps, and anything
``StaticDecodeBatch.takes`` refuses (LoRA, a row past the positions the buffers cover), stay
eager. Sampling, grammar masks, logprobs and penalties run on the logits. A request reaches
a decode step only once its KV has landed (the scheduler keeps it in
``WAITING_FOR_REMOTE_KVS`` until then), so no replay reads a page that a transfer is still
writing.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from pdserve.model.architectures.moe import SparseMoE
from pdserve.model.architectures.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The captured steps of ``runner`` (its static decode batch enabled), by ``(padded
    rows, queries per row)``; built by :meth:`capture`."""

    def __init__(self, runner: ModelRunner, queries: list[int]) -> None:
        static = runner.static_decode
        if static is None or runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA runner with its static decode batch")
        self.runner = runner
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Once for all the captures (torch.cuda.graph would collect and empty the cache
        # before each: most of the capture time at 70 sizes).
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(runner.device)
        started = time.perf_counter()
        for query_count in queries:
            for size in reversed(static.sizes):
                self._graphs[size, query_count] = self._capture(size, query_count, pool)
        torch.cuda.synchronize(runner.device)
        self.capture_seconds = time.perf_counter() - started
        self.memory_bytes = torch.cuda.memory_reserved(runner.device) - before
        logger.info(
            "captured %d decode graphs (queries per row %s, up to %d rows) in %.1f s, %.0f MiB",
            len(self._graphs),
            queries,
            static.max_rows,
            self.capture_seconds,
            self.memory_bytes / 2**20,
        )

    @classmethod
    def capture(cls, runner: ModelRunner, queries: list[int]) -> DecodeGraphs | None:
        """The runner's graphs, or None (logged, the steps then run eagerly over the static
        buffers) where its model cannot be captured or a capture fails. Once captured, the
        model's RoPE tables may not grow: the graphs read them where they are."""
        if not cls.can_capture(runner.model):
            return None
        try:
            with torch.cuda.device(runner.device):
                graphs = cls(runner, queries)
        except RuntimeError as error:
            logger.warning("no CUDA graphs: capturing the decode step failed (%s)", error)
            return None
        for module in runner.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.frozen = True
        return graphs

    @staticmethod
    def can_capture(model: torch.nn.Module) -> bool:
        """Whether ``model``'s decode forward can be captured: its experts, if any, run
        through the grouped matmul as one kernel (``SparseMoE.grouped_matmul``; the fallback
        reads each expert's row count on the host). Logs why not."""
        for name, module in model.named_modules():
            if isinstance(module, SparseMoE) and not module.grouped_matmul:
                logger.warning(
                    "no CUDA graphs: the experts of %s do not run through torch._grouped_mm "
                    "here (dtype %s); decode steps run eagerly over the static buffers",
                    name,
                    module.gate_up.dtype,
                )
                return False
        return True

    def _capture(
        self, size: int, queries: int, pool: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (compiles, allocator's first blocks), then capture on it
        (a capture may not run on the default stream)."""
        static, runner = self.runner.static_decode, self.runner
        assert static is not None
        static.fill_padding(size, queries)
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            runner.padded_decode_forward(size, queries)
            side.synchronize()
            graph.capture_begin(pool=pool)
            try:
                hidden = runner.padded_decode_forward(size, queries)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(runner.device).wait_stream(side)
        return graph, hidden

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The ``(padded rows, queries per row)`` of every captured step."""
        return list(self._graphs)

    def replay(self, padded: int, queries: int) -> torch.Tensor | None:
        """The final hidden states of the step ``fill`` wrote, from its graph (its output
        buffer, overwritten by the next replay); None where none was captured for that size."""
        captured = self._graphs.get((padded, queries))
        if captured is None:
            return None
        graph, hidden = captured
        graph.replay()
        return hidden
