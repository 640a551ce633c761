"""Runs the model for one scheduler step over the paged KV tensor.

The runner owns the single KV tensor of the worker (docs/architecture.md, "The KV
tensor"); the scheduler owns which blocks each request uses. A step is a list of
:class:`ScheduledChunk`; the runner flattens their tokens (multi-token chunks first,
then the single-token ones, so the decodes form one contiguous batch), builds the
slot and block-table indices once, runs the model, and returns logits for the chunks
that sample, in the order the scheduler gave them. A speculative verification (a last
token and its drafts) goes with the decodes: its tokens read their pages in place, each
page once for all of them (``model/split_kv.py``), padded to the batch's longest row,
where a prefill chunk continuing a prefix reads its pages alone (no padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import TYPE_CHECKING

import torch

from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.kv_cache_groups import kv_cache_groups
from pdserve.engine.model_input import ScheduledChunk
from pdserve.engine.static_decode_batch import StaticDecodeBatch
from pdserve.engine.tensor_parallel_peers import TensorParallelGroupLost
from pdserve.model import latent_decode_triton, paged_decode_kernel, paged_decode_triton
from pdserve.model.architectures import CausalLM
from pdserve.model.architectures.rotary import RotaryEmbedding
from pdserve.model.attention import StepAttention, build_attention_metadata
from pdserve.model.lora.lora_step import LoRAStacks, LoRAStep
from pdserve.model.lora.lora_step import active as lora_active
from pdserve.model.lora.peft_adapter import LoRAAdapter
from pdserve.model.model_config import ModelConfig, resolve_dtype
from pdserve.model.split_kv import SPLIT_KV_BYTES
from pdserve.model.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from pdserve.engine.tensor_parallel_peers import TensorParallelPeers
    from pdserve.messages.engine_config import EngineConfig


def configure_torch_threads(num_threads: int = 1) -> None:
    """Set torch's intra-op threads for this process (the engine calls it at start).

    One thread is the default for worker processes: on a machine shared with other
    busy processes, extra torch threads wait on busy cores and a step runs many times
    slower (measured on 2 busy cores: 17x).
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)


def allocate_kv_pages(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A worker's whole KV tensor, zero-filled, outside inference mode (so that KV
    transports may write into it in place):

    ``[num_blocks, layer slots, entries, block_size, kv_heads, head_size]``

    a slot per layer (per layer of the largest KV group when groups mix, see
    ``ModelConfig.kv_layer_groups``); entries and heads from ``ModelConfig.kv_token_shape``
    (K and V per KV head, or one latent row)."""
    groups = model_config.kv_layer_groups
    entries, heads, head_size = model_config.kv_token_shape
    return torch.zeros(
        num_blocks,
        max(len(layers) for layers in groups),
        entries,
        block_size,
        heads,
        head_size,
        dtype=kv_cache_dtype,
        device=device,
    )


class ModelRunner:
    """Holds the model and its KV tensor; turns a step's chunks into logits.

    ``kv_cache`` is the worker's whole KV tensor (``allocate_kv_pages``; given as
    ``kv_pages`` when it is shared, else allocated here) in ``kv_cache_dtype`` (default: the
    model's dtype): what the connector, the tier and the transports read and write.

    Under tensor parallelism (``tensor_parallel``) the model keeps its rank's slice and
    attends over ``attention_kv``, the view of its KV heads in ``kv_cache``, so every
    rank's pages are the same block ids of one shared tensor
    (``engine/tensor_parallel_peers.py``); rank 0 holds ``peers`` and sends them each step.
    """

    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        kv_cache_dtype: torch.dtype | str | None = None,
        kv_pages: torch.Tensor | None = None,
        tensor_parallel: TensorParallel | None = None,
        peers: TensorParallelPeers | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.model = model.eval()
        if tensor_parallel is not None:  # before fusing: the fused matrices are the slices'
            model.shard(tensor_parallel)
        self.peers = peers
        self.sharded = tensor_parallel is not None
        # The engine's resident adapters by digest (``LoRARegistry``), which chunks name.
        self.lora_adapters: Mapping[str, LoRAAdapter] = {}
        self._lora_stacks = LoRAStacks()
        self._peer_lora_digests: frozenset[str] = frozenset()  # the adapters peers hold
        self._group_lost: str | None = None  # why the ranks are out of step, once they are
        if hasattr(model, "fuse_weights"):  # pack projections for inference (models/llama.py)
            model.fuse_weights()
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.kv_cache_dtype = (
            self.dtype if kv_cache_dtype is None else resolve_dtype(kv_cache_dtype)
        )
        # Each layer's (KV group, slot in the tensor's layer axis); each group's window.
        groups = model_config.kv_layer_groups
        slots = {
            layer: (g, slot) for g, layers in enumerate(groups) for slot, layer in enumerate(layers)
        }
        self.layer_slots = tuple(slots[layer] for layer in range(model_config.num_layers))
        self.group_windows = [
            model_config.sliding_window if model_config.is_windowed(layers[0]) else None
            for layers in groups
        ]
        self.num_slots = max(len(layers) for layers in groups)
        if kv_pages is None:
            kv_pages = allocate_kv_pages(
                model_config, num_blocks, block_size, self.kv_cache_dtype, self.device
            )
        self.kv_cache = kv_pages
        self.attention_kv = kv_pages
        if tensor_parallel is not None:
            start, end = tensor_parallel.kv_head_range(model_config.num_kv_heads)
            self.attention_kv = kv_pages[..., start:end, :]
        if self.device.type == "cpu":  # built (≈ 20 s, once per machine) now, not mid-step
            paged_decode_kernel.build()
        # Pages are read in chunks of SPLIT_KV_BYTES on CPU (model/split_kv.py); elsewhere
        # the whole table at once.
        key_value_bytes = self.attention_kv[0, 0, :, 0].nbytes
        self.split_kv_keys = (
            max(1, SPLIT_KV_BYTES // key_value_bytes) if self.device.type == "cpu" else None
        )
        self.static_decode: StaticDecodeBatch | None = None
        self.decode_graphs: DecodeGraphs | None = None

    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        model: CausalLM,
        model_config: ModelConfig,
        num_blocks: int,
        kv_pages: torch.Tensor | None = None,
        tensor_parallel: TensorParallel | None = None,
        peers: TensorParallelPeers | None = None,
        draft: bool = False,
    ) -> ModelRunner:
        """The runner an engine of ``config`` runs (rank 0's, a peer's, or a ``draft``
        model's), its position tables built for every position the engine serves, its decode
        steps over static buffers where a kernel serves them, and on CUDA (``cuda_graphs``
        auto) replayed from graphs: of one query a row, and of a verification's ``1 + k``
        unless it is a draft's (which never verifies)."""
        runner = cls(
            model,
            model_config,
            num_blocks,
            config.block_size,
            config.device,
            config.dtype,
            config.resolved_kv_cache_dtype,
            kv_pages,
            tensor_parallel,
            peers,
        )
        max_model_len = config.max_model_len_for(
            model_config.max_position_embeddings, num_blocks, kv_cache_groups(model_config, config)
        )
        runner.reserve_positions(max_model_len)
        queries = [1]
        if config.speculative_method != "off" and not draft:
            queries.append(1 + config.num_speculative_tokens)
        static = runner.enable_static_decode(config.max_num_seqs, max(queries), max_model_len)
        if static and runner.device.type == "cuda" and config.cuda_graphs == "auto":
            runner.decode_graphs = DecodeGraphs.capture(runner, queries)
        return runner

    def reserve_positions(self, num_positions: int) -> None:
        """Builds the model's RoPE tables for ``num_positions`` now. Grown on demand they
        would cost the first step that reaches a new length: on a decode worker, the first
        decode after a long prompt's pull, since it never computed those positions (5 ms
        at 8k on ``tiny``, whose decode step takes 7)."""
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reserve(num_positions)

    def enable_static_decode(
        self, max_rows: int, max_queries: int, max_position: int, pad_rows: bool | None = None
    ) -> bool:
        """Serve decode steps (each row a last token and its drafts) of up to ``max_rows``
        rows of up to ``max_queries`` queries from persistent buffers
        (``engine/static_decode_batch.py``), where a kernel reads the pages in place for this
        model (the C++ kernel for a float32 model on CPU, Triton on CUDA) and the model is
        whole (under tensor parallelism the ranks would pad alike but step apart); returns
        whether it does. ``pad_rows``: pad steps to the sizes CUDA graphs capture (``None``:
        on CUDA only)."""
        query = torch.empty(1, 1, self.model_config.kv_token_shape[2], dtype=self.dtype)
        layer_cache = self.attention_kv[:, 0]
        if self.device.type == "cpu":
            served = paged_decode_kernel.serves(query, layer_cache)
        else:  # the GQA kernel, or MLA's over latent rows
            query = query.to(self.device)
            served = paged_decode_triton.serves(query, layer_cache) or (
                latent_decode_triton.serves(query, layer_cache)
            )
        if not served or self.peers is not None or self.sharded:
            return False
        self.static_decode = StaticDecodeBatch(
            max_rows,
            max_queries,
            max_position,
            self.block_size,
            self.num_slots,
            self.model_config.kv_token_shape[0],
            self.group_windows,
            self.layer_slots,
            self.device,
            self.device.type == "cuda" if pad_rows is None else pad_rows,
        )
        return True

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one step; float32 logits, ``chunk.num_logit_rows`` rows per chunk in the caller's
        order: the last token's row for a ``sample=True`` chunk, every token's for an
        ``all_logits`` chunk (a prompt whose logprobs were asked for)."""
        if not chunks:
            raise ValueError("execute() needs at least one chunk")
        for chunk in chunks:
            if not chunk.token_ids:
                raise ValueError(f"chunk of request {chunk.request_id!r} has no tokens")
        static = self.static_decode
        if static is not None and static.takes(chunks):
            step = static.fill(chunks)
            replayed = None
            if self.decode_graphs is not None:
                replayed = self.decode_graphs.replay(step.padded, step.queries)
            if replayed is None:
                replayed = self.padded_decode_forward(step.padded, step.queries)
            with torch.inference_mode():  # the chunks' own tokens only reach the head
                if step.real_tokens is None:
                    hidden = replayed[: len(chunks) * step.queries]
                else:
                    hidden = replayed[torch.from_numpy(step.real_tokens).to(self.device)]
                return self.model.compute_logits(hidden).float()
        # Prefills first, decode rows last (stable, so each group keeps its order).
        counts = [len(c.token_ids) for c in chunks]
        is_prefill = [count > 1 and not c.num_draft_tokens for c, count in zip(chunks, counts)]
        order = [i for i, prefill in enumerate(is_prefill) if prefill]
        num_prefills = len(order)
        if order:
            order += [i for i, prefill in enumerate(is_prefill) if not prefill]
            ordered = [chunks[i] for i in order]
            counts = [counts[i] for i in order]
        else:  # a decode-only step keeps the caller's order
            order, ordered = list(range(len(chunks))), chunks
        starts = [c.start_position for c in ordered]
        metadata = StepAttention(
            [
                build_attention_metadata(
                    counts,
                    starts,
                    [c.block_tables[group] for c in ordered],
                    self.block_size,
                    self.num_slots,
                    self.device,
                    window,
                    self.dtype,
                    self.split_kv_keys,
                    self.model_config.kv_token_shape[0],
                    num_prefills,
                )
                for group, window in enumerate(self.group_windows)
            ],
            self.layer_slots,
        )
        if metadata.max_position > self.model_config.max_position_embeddings:
            raise ValueError(
                f"a chunk reaches position {metadata.max_position}, beyond the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )
        input_ids = torch.tensor(
            list(chain.from_iterable(c.token_ids for c in ordered)), dtype=torch.long
        )
        # Row of the last token of each chunk, in the caller's chunk order.
        last_row = [0] * len(chunks)
        row = -1
        for index, count in zip(order, counts):
            row += count
            last_row[index] = row
        sample_rows = [
            r
            for i, c in enumerate(chunks)
            for r in range(last_row[i] - c.num_logit_rows + 1, last_row[i] + 1)
        ]
        lora_step = self._lora_step(ordered, counts)
        if self.peers is None:
            with lora_active(lora_step):
                return self._forward(input_ids, metadata, sample_rows)
        if self._group_lost is not None:  # a new step would pair with the old one's collectives
            raise TensorParallelGroupLost(self._group_lost)
        # The peers run the same step; their collectives wait for ours.
        self.peers.send(chunks, self._lora_for_peers())
        try:
            with lora_active(lora_step):
                return self._forward(input_ids, metadata, sample_rows)
        except BaseException as error:  # the ranks are out of step now: the group is done
            self._group_lost = self.peers.failure() or f"rank 0's step failed: {error!r}"
            if not isinstance(error, Exception):  # a KeyboardInterrupt stays one
                raise
            raise TensorParallelGroupLost(self._group_lost) from error

    def _lora_for_peers(self) -> dict[str, tuple[str, str]] | None:
        """The adapters in memory (digest → name, folder) when they changed since the last
        step sent to the peers, else None (``hold_lora_adapters`` on their side)."""
        digests = frozenset(self.lora_adapters)
        if digests == self._peer_lora_digests:
            return None
        self._peer_lora_digests = digests
        return {digest: (a.name, a.path) for digest, a in self.lora_adapters.items()}

    def hold_lora_adapters(self, wanted: dict[str, tuple[str, str]], max_rank: int) -> None:
        """A tensor-parallel peer keeps the adapters rank 0 holds, each read from its folder
        for this rank's slice. Files that no longer hold the weights rank 0 read fail the
        step: no rank computes with other weights than the others."""
        kept: dict[str, LoRAAdapter] = {}
        for digest, (name, path) in wanted.items():
            adapter = self.lora_adapters.get(digest)
            if adapter is None:
                adapter = LoRAAdapter.load(name, path, self.model, max_rank)
            if adapter.digest != digest:
                raise ValueError(
                    f"LoRA adapter {name!r} at {path} changed on disk: rank 0 read weights "
                    f"{digest[:12]}, this rank {adapter.digest[:12]}"
                )
            kept[digest] = adapter
        self.lora_adapters = kept

    def _lora_step(self, ordered: list[ScheduledChunk], counts: list[int]) -> LoRAStep | None:
        """The step's rows of each adapter its chunks run (``model/lora/lora_step.py``), in the
        step's row order; None where every chunk runs the base model."""
        if all(chunk.lora_id is None for chunk in ordered):
            return None
        rows: dict[str, list[int]] = {}
        start = 0
        for chunk, count in zip(ordered, counts):
            if chunk.lora_id is not None:
                rows.setdefault(chunk.lora_id, []).extend(range(start, start + count))
            start += count
        groups = [(self.lora_adapters[digest], indices) for digest, indices in rows.items()]
        return LoRAStep(groups, sum(counts), self._lora_stacks, self.device)

    def padded_decode_forward(self, padded: int, queries: int) -> torch.Tensor:
        """The static decode step over the buffers as last filled: the final hidden states of
        every padded row's queries. Its tensors depend only on ``(padded, queries)``: the
        function a CUDA graph captures (``engine/decode_graphs.py``). The LM head runs after
        it on the real rows (``execute``), so a graph holds no padded row's logits."""
        static = self.static_decode
        assert static is not None, "padded_decode_forward needs enable_static_decode"
        metadata = static.metadata(padded, queries)
        with torch.inference_mode():
            return self.model.forward(
                static.input_ids(padded, queries), metadata.positions, self.attention_kv, metadata
            )

    def _forward(
        self, input_ids: torch.Tensor, metadata: StepAttention, sample_rows: list[int]
    ) -> torch.Tensor:
        with torch.inference_mode():
            # .forward, not __call__: no hooks on the hot path (models/llama.py module doc).
            hidden = self.model.forward(
                input_ids.to(self.device), metadata.positions, self.attention_kv, metadata
            )
            if sample_rows != list(range(input_ids.shape[0])):  # else every row, in order
                hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)]
            return self.model.compute_logits(hidden).float()
