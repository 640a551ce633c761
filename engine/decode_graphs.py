"""CUDA graphs of the static decode step: one per padded size, captured at start, replayed.

Why: a small model's decode step on a GPU is launch-bound. Eager, its few hundred kernels are
launched one after another from Python (13 ms a step for smollm2's shape on an H200, where
the bytes it reads take under 0.5 ms); a graph replays them all with one launch. vLLM runs
decode instances of a P/D deployment this way (``FULL_DECODE_ONLY``).

What is captured is ``ModelRunner.padded_decode_forward``: the forward over the buffers of
``engine/static_decode_batch.py``, whose tensors depend only on the padded row count and the
queries per row, so a replay reads whatever the step's ``fill`` wrote there::

    start:  for queries in (1, 1 + k):   for size in (max_rows, ..., 8, 4, 2, 1):  (largest
                warm-up run (Triton compiles outside any capture)                 first, so
                capture padded_decode_forward(size, queries) into the shared pool  smaller
                                                                                   ones reuse
    step:   fill(chunks) ─▶ replay graph(padded, queries) ─▶ LM head on hidden[:rows]   its memory)

A graph ends at the final hidden states: the LM head runs after the replay on the real rows
alone, so no graph holds logits (a vocabulary's width for every padded row of every size,
hundreds of MB for a 128k vocabulary at 64 rows). Prefill and mixed steps, and anything
``StaticDecodeBatch.takes`` refuses (LoRA, a row past the positions the buffers cover), stay
eager. Sampling, grammar masks, logprobs and penalties run on the logits. A request reaches a decode step only once its KV has landed (the
scheduler keeps it in ``WAITING_FOR_REMOTE_KVS`` until then), so no replay reads a page that
a transfer is still writing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from pdserve.model.architectures.moe import SparseMoE

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The captured steps of ``runner`` (its static decode batch enabled), by ``(padded
    rows, queries per row)``."""

    def __init__(self, runner: ModelRunner, queries: list[int]) -> None:
        static = runner.static_decode
        if static is None or runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA runner with its static decode batch")
        self.runner = runner
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
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

    @staticmethod
    def captures(model: torch.nn.Module) -> bool:
        """Whether ``model``'s decode forward can be captured: its experts, if any, run
        through the grouped matmul (``SparseMoE.grouped_matmul``; the fallback reads each
        expert's row count on the host). Logs why not."""
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
        """Warm up on a side stream (compiles, allocator's first blocks), then capture."""
        static, runner = self.runner.static_decode, self.runner
        assert static is not None
        static.fill_padding(size, queries)
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            runner.padded_decode_forward(size, queries)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = runner.padded_decode_forward(size, queries)
        return graph, hidden

    def replay(self, padded: int, queries: int) -> torch.Tensor | None:
        """The final hidden states of the step ``fill`` wrote, from its graph (its output
        buffer, overwritten by the next replay); None where none was captured for that size."""
        captured = self._graphs.get((padded, queries))
        if captured is None:
            return None
        graph, hidden = captured
        graph.replay()
        return hidden
