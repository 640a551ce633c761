"""A decode step whose tensors depend only on its padded size: persistent buffers, one copy.

Why: a CUDA graph replays what it captured, the same kernels over the same addresses, and a
decode step built afresh each time (``model/attention.py``: new index tensors, new plans,
host-to-device copies of small lists) cannot be captured. Here every tensor the decode
forward reads lives in buffers allocated once for ``max_rows`` rows of up to
``max_queries`` queries each (one, or a verification's last token and its drafts); a step
writes its rows into one packed host buffer and copies it to the device at once (on CPU the
host buffer is the device's: no copy). What the forward sees then depends on the padded row
count and the queries per row alone, so the same function serves a graph's capture and
every replay, and the CPU's eager step skips the per-step index building::

    packed int64, R = max_rows, T = R * max_queries, G = KV groups, W = table width
    | ids [T] | positions [T] | per group: write rows [T, L, E], low [T], high [T] |
      └──────────────────────── head, copied whole ──────────────────────────┘
    | tables [G, R, W] |   group g's rows [:n] copied (right after the head for group 0)

Token ``t`` of the step is row ``t // q``'s query ``t % q`` (``q`` queries per row). Its write
rows are its rows in each layer slot (``L``) and entry (``E``: K, V) of the KV tensor seen as
rows (``model/attention.py``), computed on the host, so the forward's metadata is views of
the buffers and nothing else. It sees keys ``[low, high)`` of its row's table, counted from
the table's first page, block 0 of the request: a causal limit, and a sliding window's first
key. Rows past the step's own (padding up to a captured size), and a row's queries past its
own (a verification with fewer drafts than the step's queries per row), hold token 0 at
position 0 over block 0, the null block that no request holds: they write and read its
first slot, and their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.cache import cdiv
from pdserve.engine.model_input import ScheduledChunk
from pdserve.model.attention import AttentionMetadata, StepAttention
from pdserve.model.split_kv import SplitKVPlan


@dataclass(frozen=True, slots=True)
class StaticStep:
    """A filled step: ``padded`` rows of ``queries`` each, and where some row holds fewer
    (a verification with fewer drafts than another), the rows of the forward's output that
    are the chunks' own tokens, in order (``None``: the first ``rows x queries``)."""

    padded: int
    queries: int
    real_tokens: np.ndarray | None


# Padded sizes: 1, 2, 4, 8, then steps of 8 (vLLM's capture sizes for decode batches).
_SMALL_SIZES = (1, 2, 4, 8)
_STEP = 8


def padded_sizes(max_rows: int) -> list[int]:
    """Every padded row count up to ``max_rows`` (included, the last size)."""
    sizes = [size for size in _SMALL_SIZES if size < max_rows]
    sizes += list(range(_STEP * 2, max_rows, _STEP))
    return sorted({*sizes, max_rows})


class StaticDecodeBatch:
    """The buffers of decode steps (module doc): ``fill`` writes a step, ``metadata``
    gives the forward its views for a padded size.

    ``max_position``: the positions a row may reach (the engine's longest sequence, for which
    the RoPE tables are built), which sets the tables' width; ``layer_slots`` and
    ``group_windows`` as the runner's (each layer's KV group and slot, each group's window);
    ``pad_rows``: pad each step to a captured size (where CUDA graphs replay it).
    """

    def __init__(
        self,
        max_rows: int,
        max_queries: int,
        max_position: int,
        block_size: int,
        num_layer_slots: int,
        kv_entries: int,
        group_windows: list[int | None],
        layer_slots: tuple[tuple[int, int], ...],
        device: torch.device,
        pad_rows: bool = True,
    ) -> None:
        if max_rows < 1 or max_queries < 1 or max_position < 1:
            raise ValueError(
                f"a static decode batch needs rows, queries and positions (got {max_rows}, "
                f"{max_queries}, {max_position})"
            )
        self.max_rows, self.max_queries = max_rows, max_queries
        self.width, self.block_size = cdiv(max_position, block_size), block_size
        self.group_windows, self.layer_slots = group_windows, layer_slots
        self.max_position = max_position
        self.device = device
        self.sizes = padded_sizes(max_rows)
        self.pad_rows = pad_rows
        self.rows_per_block = num_layer_slots * kv_entries * block_size
        num_groups, tokens = len(group_windows), max_rows * max_queries
        self._rows_shape = (num_layer_slots, kv_entries)
        self._group_size = tokens * (num_layer_slots * kv_entries + 2)
        self._head = tokens * 2 + num_groups * self._group_size
        total = self._head + num_groups * max_rows * self.width
        pinned = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.long, pin_memory=pinned)
        self._device = (
            self._host if device.type == "cpu" else torch.zeros_like(self._host, device=device)
        )
        # The last copy out of the pinned buffer, waited for before it is written again.
        self._copied: torch.cuda.Event | None = None
        # Each (layer slot, entry)'s row relative to the token's K row in layer 0.
        self._layer_offsets = (np.arange(num_layer_slots * kv_entries) * block_size).reshape(
            self._rows_shape
        )
        self._row_tokens: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._host_regions = self._regions(self._host.numpy())
        self._device_regions = self._regions(self._device)

    def _regions(self, packed: Any) -> Any:  # a numpy array or a tensor: sliced alike
        """The packed buffer's named views (module doc), ``(ids, positions, per group
        (write rows [T, slots, entries], low, high, tables [R, W]))``."""
        tokens = self.max_rows * self.max_queries
        rows_end = tokens * self._rows_shape[0] * self._rows_shape[1]
        groups = []
        for group in range(len(self.group_windows)):
            base = tokens * 2 + group * self._group_size
            table_start = self._head + group * self.max_rows * self.width
            groups.append(
                (
                    packed[base : base + rows_end].reshape(tokens, *self._rows_shape),
                    packed[base + rows_end : base + rows_end + tokens],
                    packed[base + rows_end + tokens : base + rows_end + 2 * tokens],
                    packed[table_start : table_start + self.max_rows * self.width].reshape(
                        self.max_rows, self.width
                    ),
                )
            )
        return packed[:tokens], packed[tokens : 2 * tokens], groups

    def padded_size(self, num_rows: int) -> int:
        """The smallest padded size holding ``num_rows`` rows (``num_rows`` itself where
        rows are not padded: no graph replays the step, so padding would only cost)."""
        if not self.pad_rows:
            return num_rows
        return next(size for size in self.sizes if size >= num_rows)

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether the step is a decode batch these buffers hold: every chunk a sampled last
        token and its drafts (any number up to ``max_queries - 1``), base model, within the
        positions covered, its tables long enough (a short one gets the eager step's clear
        error)."""
        return len(chunks) <= self.max_rows and all(
            len(chunk.token_ids) == 1 + chunk.num_draft_tokens <= self.max_queries
            and chunk.sample
            and not chunk.all_logits
            and chunk.lora_id is None
            and chunk.start_position + len(chunk.token_ids) <= self.max_position
            and all(
                len(table) * self.block_size >= chunk.start_position + len(chunk.token_ids)
                for table in chunk.block_tables
            )
            for chunk in chunks
        )

    def fill(self, chunks: list[ScheduledChunk]) -> StaticStep:
        """Write the step's rows (``takes`` is true) and pad them (module doc): to a captured
        size where rows are padded, and each row to the step's most queries (under padding,
        a verification to ``max_queries``, the size its graphs have). On CUDA the head and
        each group's used table rows go to the device in one copy each, ordered on the
        current stream before the forward."""
        num_rows = len(chunks)
        counts = np.fromiter((len(c.token_ids) for c in chunks), np.int64, num_rows)
        queries = int(counts.max())
        if self.pad_rows and queries > 1:
            queries = self.max_queries
        padded = self.padded_size(num_rows)
        tokens = num_rows * queries
        self._wait_for_last_copy()
        ids, positions, groups = self._host_regions
        # [rows, queries]: each row's own queries, then padding (position 0, the null block).
        real = np.arange(queries)[None, :] < counts[:, None]
        starts = np.fromiter((c.start_position for c in chunks), np.int64, num_rows)
        token_positions = np.where(real, starts[:, None] + np.arange(queries), 0).reshape(-1)
        flat_real = real.reshape(-1)
        ids[:tokens] = 0
        ids[:tokens][flat_real] = np.fromiter(
            (token for c in chunks for token in c.token_ids), np.int64, int(counts.sum())
        )
        positions[:tokens] = token_positions
        rows = np.repeat(np.arange(num_rows), queries)
        for group, (write_rows, low, high, table) in enumerate(groups):
            for row, chunk in enumerate(chunks):
                need = cdiv(chunk.start_position + len(chunk.token_ids), self.block_size)
                table[row, :need] = chunk.block_tables[group][:need]
            blocks = table[rows, token_positions // self.block_size]
            first_rows = np.where(
                flat_real, blocks * self.rows_per_block + token_positions % self.block_size, 0
            )
            write_rows[:tokens] = first_rows[:, None, None] + self._layer_offsets
            window = self.group_windows[group]
            seen_from = 0 if window is None else np.maximum(token_positions - window + 1, 0)
            low[:tokens] = np.where(flat_real, seen_from, 0)
            high[:tokens] = np.where(flat_real, token_positions + 1, 1)
        self._pad(num_rows, padded, queries)
        return StaticStep(padded, queries, None if flat_real.all() else np.flatnonzero(flat_real))

    def fill_padding(self, padded: int, queries: int) -> None:
        """Every row of a ``padded`` step padding: what a capture's warm-up and capture
        read (nothing of a request)."""
        self._wait_for_last_copy()
        self._pad(0, padded, queries)

    def _wait_for_last_copy(self) -> None:
        """Before the pinned buffer is written again, the copy out of it has ended."""
        if self._copied is not None:
            self._copied.synchronize()

    def _pad(self, num_rows: int, padded: int, queries: int) -> None:
        """Rows ``num_rows .. padded`` as padding (module doc), then the copy to the device."""
        tokens, used = num_rows * queries, padded * queries
        ids, positions, groups = self._host_regions
        ids[tokens:used] = 0
        positions[tokens:used] = 0
        for write_rows, low, high, table in groups:
            table[num_rows:padded, 0] = 0
            write_rows[tokens:used] = self._layer_offsets
            low[tokens:used] = 0
            high[tokens:used] = 1
        if self._device is not self._host:
            self._copy_to_device(padded)

    def _copy_to_device(self, padded: int) -> None:
        """The head, and each group's first ``padded`` table rows (contiguous after the
        head for the first group: one copy where the model has one KV group)."""
        end = self._head + padded * self.width
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        for group in range(1, len(self.group_windows)):
            start = self._head + group * self.max_rows * self.width
            end = start + padded * self.width
            self._device[start:end].copy_(self._host[start:end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))

    def input_ids(self, padded: int, queries: int) -> torch.Tensor:
        """The step's token ids, ``[padded * queries]``: a view of the buffers."""
        return self._device_regions[0][: padded * queries]

    def metadata(self, padded: int, queries: int) -> StepAttention:
        """The forward's attention for ``padded`` rows of ``queries``: views of the buffers,
        each group's write rows per layer, and the decode
        kernels' key ranges (``SplitKVPlan.key_ranges`` on CPU, ``device_key_ranges`` on
        CUDA); no host value that differs between steps of the same size."""
        used = padded * queries
        _, positions, groups = self._device_regions
        row_starts, token_rows = self._row_tokens_for(padded, queries)
        metadata = []
        for write_rows, low, high, table in groups:
            plan = SplitKVPlan(0, padded, self.block_size, [], queries)
            ranges = (table[:padded], low[:used], high[:used])
            if self.device.type == "cpu":
                plan.key_ranges = (ranges[0], row_starts, ranges[1], ranges[2])
            else:
                plan.device_key_ranges = (ranges[0], token_rows, ranges[1], ranges[2])
            metadata.append(
                AttentionMetadata(
                    positions[:used], write_rows[:used].transpose(0, 1), self.max_position, [], plan
                )
            )
        return StepAttention(metadata, self.layer_slots)

    def _row_tokens_for(self, padded: int, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row's tokens start (``[padded + 1]``, the CPU kernel's) and each
        token's row (``[padded * queries]``, the Triton kernel's): the same for every step of
        this size, so built once (before a capture, by its warm-up step)."""
        key = (padded, queries)
        if key not in self._row_tokens:
            rows = torch.arange(padded + 1, dtype=torch.long, device=self.device)
            self._row_tokens[key] = (
                rows * queries,
                torch.repeat_interleave(rows[:-1], queries),
            )
        return self._row_tokens[key]
