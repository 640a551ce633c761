"""Attention that reads the KV pages chunk by chunk (split-KV, merged by log-sum-exp).

It serves every query that attends cached keys: a decode batch's rows (one query each, or a
speculative verification's few), and a prefill chunk continuing a prefix (one row of its
``count`` queries, planned alone so that nothing pads it).

Why not one gather: copying every sequence's whole context out of the pages before one
SDPA writes and re-reads the context once more per layer, and a fresh 100 MB copy (batch 8
x 8k tokens) costs page faults as well: on one CPU thread that was 10.8x the time of SDPA
over a contiguous cache of the same shape. Here the block table is cut into column chunks
small enough to stay in the cache (:data:`SPLIT_KV_BYTES` of K and V for the whole batch);
each chunk is gathered into a reused buffer and attended on its own, and the chunks'
partial outputs are combined with their log-sum-exps (flash-decoding's merge):

    block table [batch, width]      chunk 0       chunk 1       chunk 2
      seq 0  (long)               | b7 b2 b9 b4 | b1 b8 b3 b6 | b5 b0* ..  |
      seq 1  (short, padded)      | b3 b5 b0* ..| .. (masked)               |
                                      │              │              │
                            (out_0, lse_0)  (out_1, lse_1)  (out_2, lse_2)
    out = sum_i out_i * softmax_i(lse_i)          (* the null block, masked)

A row may hold several queries: a speculative verification (a request's last token and its
drafts, ``query_len`` of them, rows padded to the longest) or a prefill chunk reads each page
once for all of them, each query seeing the keys up to its own position::

    row 0  t d0 d1 at p..p+2   query j sees keys < p + j + 1      (a causal mask per query)
    row 1  t       at q        padded: its extra queries repeat t's and are dropped

Only the chunks holding a row's own positions need a mask; the prefix before them is seen
whole by every query.

A sliding window's table starts at the block holding the window's first key, so a row
reads O(window), not O(context). Everything that is the same for all layers (tables, masks,
which rows see nothing of a chunk) is planned once per step by :func:`plan_split_kv`.

On CPU the per-chunk attention is torch's flash kernel for CPU, which returns the
log-sum-exp the merge needs; other devices get one chunk (their gather runs at device
bandwidth) and plain SDPA. Rows of a few queries (decodes, verifications) skip the chunks
where a kernel reads the same table and key ranges in place: on CPU the C++ kernel
(``model/paged_decode_kernel.py``, ``SplitKVPlan.key_ranges``), on CUDA the Triton one
(``model/paged_decode_triton.py``, ``SplitKVPlan.device_key_ranges``). A prefill chunk's
hundreds of queries keep the chunks, whose SDPA multiplies them as matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.model import paged_decode_kernel, paged_decode_triton

# K and V bytes one chunk gathers for the whole batch: small enough to stay in the L2/L3
# caches between the gather and the attention. Measured on one EPYC thread with smollm2's
# heads (3 MiB = 2,048 keys): batch 8 x 8k 21 ms per layer against 43 ms for one whole
# gather into a reused buffer and 90+ ms into a fresh one.
SPLIT_KV_BYTES = 3 << 20

_flash_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class KeyChunk:
    """Columns ``[first_block, first_block + num_blocks)`` of the rows' table.

    ``blocks`` is those columns flattened row-major (``[batch * num_blocks]``). Only the first
    ``num_keys`` gathered keys are attended (trailing ones no row sees are dropped).
    ``attn_mask`` ``[batch, 1, query_len, num_keys]`` is additive (0 / -inf, the query's
    dtype), or ``None`` when every query sees every kept key. ``empty_rows``
    ``[batch, 1, query_len]`` is -inf for a query that sees no key of this chunk (torch's
    kernel returns a log-sum-exp of 0 for such a query, which would weigh its zero output into
    the merge), else ``None``.
    """

    blocks: torch.Tensor
    num_blocks: int
    num_keys: int
    attn_mask: torch.Tensor | None
    empty_rows: torch.Tensor | None


@dataclass(slots=True)
class SplitKVPlan:
    """Rows of consecutive queries over their pages (decodes, verifications, or one prefill
    chunk): tokens ``query_start ..`` of the step, read in ``chunks`` (one, or several on CPU).

    The tokens are laid out as ``[batch, query_len]`` queries: ``query_slots[i]`` is the
    token padded query ``i`` reads, ``token_slots[t]`` the padded query of token ``t`` (both
    ``None`` when every row holds ``query_len`` tokens: nothing is padded). ``buffers`` holds the
    gather buffers and the masks widened to the query heads, made by the step's first layer
    and reused by the others. ``key_ranges``, for rows of a few queries (decodes and
    verifications) on CPU: the table, where each row's tokens start, and each token's keys
    ``[low, high)`` in its row, which the CPU's paged decode kernel reads in place
    (``model/paged_decode_kernel.py``) instead of the chunks. ``device_key_ranges``, the same
    rows on CUDA where Triton imports: the table, each token's row, and its keys ``[low,
    high)``, on the device, for the Triton kernel (``model/paged_decode_triton.py``)."""

    query_start: int
    batch: int
    block_size: int
    chunks: list[KeyChunk]
    query_len: int = 1
    query_slots: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    key_ranges: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    device_key_ranges: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def plan_split_kv(
    query_start: int,
    positions: list[int],
    block_ids: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None,
    chunk_keys: int | None,
    query_lens: list[int] | None = None,
) -> SplitKVPlan:
    """Tables and masks for rows whose first query is at ``positions`` and which hold
    ``query_lens`` consecutive queries each (``None``: one each).

    ``chunk_keys`` is how many keys one chunk gathers over the whole batch (``None``: one
    chunk); each chunk holds at least one block per row.
    """
    batch = len(positions)
    lens = query_lens or [1] * batch
    query_len = max(lens)
    # Row b reads blocks [first[b], last[b]) of its table; query j of it sees the keys
    # [low[b, j], high[b, j]), counted from its first read block (padded queries repeat the
    # row's last one).
    first = [
        0 if sliding_window is None else max(0, p - sliding_window + 1) // block_size
        for p in positions
    ]
    last = [(p + n - 1) // block_size + 1 for p, n in zip(positions, lens)]
    width = max(end - start for start, end in zip(first, last))
    table = torch.tensor(
        [
            ids[start:end] + [0] * (width - (end - start))
            for ids, start, end in zip(block_ids, first, last)
        ],
        dtype=torch.long,
    )
    steps = torch.arange(query_len)
    query_pos = torch.tensor(positions)[:, None] + torch.minimum(
        steps, torch.tensor(lens)[:, None] - 1
    )
    table_start = torch.tensor(first)[:, None] * block_size
    high = query_pos + 1 - table_start
    low = (
        torch.zeros_like(high)
        if sliding_window is None
        else (query_pos - sliding_window + 1).clamp(min=0) - table_start
    )
    blocks_per_chunk = width if chunk_keys is None else max(1, chunk_keys // (batch * block_size))
    chunks = []
    for column in range(0, width, blocks_per_chunk):
        num_blocks = min(blocks_per_chunk, width - column)
        offset = column * block_size
        span = num_blocks * block_size
        seen_low = (low - offset).clamp(0, span)
        seen_high = (high - offset).clamp(0, span)
        num_keys = int(seen_high.max())
        attn_mask = empty_rows = None
        if bool((seen_low > 0).any()) or bool((seen_high < num_keys).any()):
            keys = torch.arange(num_keys)
            visible = (keys >= seen_low[..., None]) & (keys < seen_high[..., None])
            attn_mask = _additive(visible, dtype)[:, None].to(device)
            empty = seen_low >= seen_high
            if bool(empty.any()):
                empty_rows = _additive(~empty, dtype)[:, None].to(device)
        blocks = table[:, column : column + num_blocks].flatten().to(device)
        chunks.append(KeyChunk(blocks, num_blocks, num_keys, attn_mask, empty_rows))
    plan = SplitKVPlan(query_start, batch, block_size, chunks, query_len)
    if query_len <= paged_decode_kernel.MAX_QUERIES_PER_ROW:
        counts = torch.tensor(lens)
        real = steps[None, :] < counts[:, None]  # the rows' own queries, in token order
        token_low, token_high = low[real].contiguous(), high[real].contiguous()
        if device.type == "cpu":
            row_starts = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)))
            plan.key_ranges = (table, row_starts, token_low, token_high)
        elif paged_decode_triton.triton_available():
            token_rows = torch.repeat_interleave(torch.arange(batch), counts)
            plan.device_key_ranges = (
                table.to(device),
                token_rows.to(device),
                token_low.to(device),
                token_high.to(device),
            )
    if min(lens) < query_len:
        counts = torch.tensor(lens)
        token_start = torch.cumsum(counts, 0) - counts
        plan.query_slots = (token_start[:, None] + (query_pos - query_pos[:, :1])).flatten()
        row_of_token = torch.repeat_interleave(torch.arange(batch), counts)
        step_of_token = torch.arange(int(counts.sum())) - token_start[row_of_token]
        plan.token_slots = row_of_token * query_len + step_of_token
        plan.query_slots = plan.query_slots.to(device)
        plan.token_slots = plan.token_slots.to(device)
    return plan


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, -inf elsewhere (the kernel for CPU takes masks of the query's dtype)."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


def split_kv_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    plan: SplitKVPlan,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend the rows' queries ``[num_tokens, num_heads, head_size]`` over their pages.

    ``layer_cache`` is one layer's ``[num_blocks, entries, block_size, num_kv_heads, head_size]``
    (a one-entry cache of latent rows serves as its own values: MLA's absorbed form).
    The query heads that share a K/V head are passed as that head's queries
    (``[batch, kv_heads, query_len * group, head_size]``), so no K/V is expanded per query
    head; a row's queries differ only in how far they see (``KeyChunk.attn_mask``).
    ``scale``: the softmax scale (``None``: ``1/sqrt(head_size)``).
    """
    if plan.key_ranges is not None and paged_decode_kernel.serves(query, layer_cache):
        return paged_decode_kernel.paged_decode(query, layer_cache, *plan.key_ranges, scale)
    if plan.device_key_ranges is not None and paged_decode_triton.serves(query, layer_cache):
        return paged_decode_triton.paged_decode(query, layer_cache, *plan.device_key_ranges, scale)
    num_heads, head_size = query.shape[1:]
    batch, query_len = plan.batch, plan.query_len
    num_kv_heads = layer_cache.shape[3]
    group = num_heads // num_kv_heads
    if plan.query_slots is not None:
        query = query[plan.query_slots]
    grouped = (
        query.view(batch, query_len, num_kv_heads, group, head_size)
        .transpose(1, 2)
        .reshape(batch, num_kv_heads, query_len * group, head_size)
    )
    if len(plan.chunks) == 1:
        keys, values = _gather(layer_cache, plan, plan.chunks[0], query.dtype)
        attended = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=_per_head(plan, 0, "attn_mask", group), scale=scale
        )
        return _ungrouped(attended, plan, num_heads, head_size)
    outputs = query.new_empty(len(plan.chunks), *grouped.shape)
    log_sum_exps = query.new_empty(len(plan.chunks), *grouped.shape[:-1])
    for index, chunk in enumerate(plan.chunks):
        keys, values = _gather(layer_cache, plan, chunk, query.dtype)
        output, log_sum_exp = _flash_for_cpu(
            grouped,
            keys,
            values,
            attn_mask=_per_head(plan, index, "attn_mask", group),
            scale=scale,
        )
        outputs[index] = output
        empty_rows = _per_head(plan, index, "empty_rows", group)
        log_sum_exps[index] = log_sum_exp if empty_rows is None else log_sum_exp + empty_rows
    weights = torch.softmax(log_sum_exps, dim=0).unsqueeze(-1)
    return _ungrouped((outputs * weights).sum(0), plan, num_heads, head_size)


def _per_head(plan: SplitKVPlan, index: int, name: str, group: int) -> torch.Tensor | None:
    """Chunk ``index``'s mask (or empty rows) for the grouped queries: as planned for one
    query per row (it broadcasts over the group), else each query's widened to its group's
    heads, once per step."""
    planned = getattr(plan.chunks[index], name)
    if planned is None or plan.query_len == 1:
        return planned
    key = f"{name}{index}"
    if key not in plan.buffers:
        plan.buffers[key] = planned.repeat_interleave(group, dim=2)
    return plan.buffers[key]


def _ungrouped(
    attended: torch.Tensor, plan: SplitKVPlan, num_heads: int, head_size: int
) -> torch.Tensor:
    """``[batch, kv_heads, query_len * group, head_size]`` back to the tokens' rows."""
    batch, num_kv_heads = attended.shape[:2]
    rows = (
        attended.view(batch, num_kv_heads, plan.query_len, -1, head_size)
        .transpose(1, 2)
        .reshape(batch * plan.query_len, num_heads, head_size)
    )
    return rows if plan.token_slots is None else rows[plan.token_slots]


def _gather(
    layer_cache: torch.Tensor, plan: SplitKVPlan, chunk: KeyChunk, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's keys and values as ``[batch, kv_heads, num_keys, head_size]`` views of the
    step's reused gather buffers (one ``index_select`` each from the strided K and V views;
    each block's rows are contiguous, so the block and offset dims merge without a copy),
    widened to the query's ``dtype`` when the cache is narrower (the chunk is in cache).
    A one-entry cache's rows are gathered once and serve as both."""
    rows = plan.batch * chunk.num_blocks
    entries = (("keys", 0), ("values", 1))[: layer_cache.shape[1]]
    if "keys" not in plan.buffers:
        shape = (rows, *layer_cache.shape[2:])
        for name, _ in entries:
            plan.buffers[name] = layer_cache.new_empty(shape)
    shape = (plan.batch, chunk.num_blocks * plan.block_size, *layer_cache.shape[3:])
    gathered = []
    for name, kv in entries:
        buffer = plan.buffers[name][:rows]
        torch.index_select(layer_cache[:, kv], 0, chunk.blocks, out=buffer)
        gathered.append(buffer.view(shape)[:, : chunk.num_keys].transpose(1, 2).to(dtype))
    return gathered[0], gathered[-1]
