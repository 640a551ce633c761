"""Runs the model for one scheduler step over the paged KV tensor.

The runner owns the single KV tensor of the worker (docs/architecture.md, "The KV
tensor"); the scheduler owns which blocks each request uses. A step is a list of
:class:`ScheduledChunk`; the runner flattens their tokens (multi-token chunks first,
then the single-token ones, so the decodes form one contiguous batch), builds the
slot and block-table indices once, runs the model, and returns logits for the chunks
that sample, in the order the scheduler gave them.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn

from pdserve.engine.attention import build_attention_metadata
from pdserve.engine.model_config import ModelConfig, resolve_dtype
from pdserve.engine.model_input import ScheduledChunk


def configure_torch_threads(num_threads: int = 1) -> None:
    """Set torch's intra-op threads for this process (the engine calls it at start).

    One thread is the default for worker processes: on a machine shared with other
    busy processes, extra torch threads wait on busy cores and a step runs many times
    slower (docs/FACTS: 17x on 2 cores).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)


class ModelRunner:
    """Holds the model and its KV tensor; turns a step's chunks into logits.

    ``kv_cache`` is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    in the model's dtype, zero-filled, allocated outside inference mode so that KV
    transports may write into it in place.
    """

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.model = model.eval()
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.kv_cache = torch.zeros(
            num_blocks,
            model_config.num_layers,
            2,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one step; float32 logits ``[num_sampled, vocab]``, one row per ``sample=True`` chunk, in order."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError(f"chunk of request {chunk.request_id!r} has no tokens")
        # Multi-token chunks first, decodes last (stable, so each group keeps its order).
        order = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        order += [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        ordered = [chunks[i] for i in order]
        counts = [len(c.token_ids) for c in ordered]
        starts = [c.start_position for c in ordered]
        end = max(s + n for s, n in zip(starts, counts))
        if end > self.model_config.max_position_embeddings:
            raise ValueError(
                f"a chunk reaches position {end}, beyond the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )
        metadata = build_attention_metadata(
            counts,
            starts,
            [c.block_ids for c in ordered],
            self.block_size,
            self.device,
            self.model_config.sliding_window,
        )
        input_ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in ordered)), dtype=torch.long)
        # Row of the last token of each sampling chunk, in the caller's chunk order.
        last_row = {}
        row = 0
        for index, count in zip(order, counts):
            row += count
            last_row[index] = row - 1
        sample_rows = torch.tensor([last_row[i] for i, c in enumerate(chunks) if c.sample], dtype=torch.long)
        with torch.inference_mode():
            hidden = self.model(input_ids.to(self.device), metadata.positions, self.kv_cache, metadata)
            logits = self.model.compute_logits(hidden[sample_rows.to(self.device)])
            return logits.float()
