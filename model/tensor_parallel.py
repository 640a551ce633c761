"""Tensor parallelism inside one worker: which slice of a model a rank holds, and the
collectives that join the slices (Megatron's split, as vLLM's ``parallel_state`` applies it).

A worker of degree ``k`` is ``k`` processes joined in one ``torch.distributed`` group (gloo
on CPU, NCCL on CUDA). Each rank holds

```
q / k / v / gate / up   column-parallel: its heads' (its intermediate slice's) output rows
o / down                row-parallel:    the matching input columns; outputs all-reduced
embedding, LM head      vocab-parallel:  its vocabulary rows; lookups all-reduced, logits
                                         all-gathered
norms, RoPE             replicated
```

KV heads split like query heads when there are at least ``k`` of them; with fewer, each KV
head is replicated on the ``k / kv_heads`` ranks whose query heads read it, so every rank's
queries find their KV head locally (the GQA grouping ``query head // (heads / kv_heads)`` is
preserved by construction). The model code calls :meth:`TensorParallel.all_reduce` /
:meth:`TensorParallel.gather_vocab` where a sliced output must be joined; an unsharded model
calls neither.

A LoRA adapter's weights are cut as the layer they adapt (``LinearShard``): on a
column-parallel linear, A whole (the input is whole) and B's rows of this rank's outputs; on
a row-parallel one, A's columns of this rank's inputs and B whole, so that each rank's
``x_r A_r^T B^T`` is a partial sum the layer's all-reduce completes with the base output's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from pdserve.model.quantization.quantized_weight import attach_packed_weight, packed_weight

# The loopback address every rank of a worker binds its group's connections to: the ranks
# of one worker are processes of one node.
GROUP_HOST = "127.0.0.1"


class Collectives(Protocol):
    """The two collectives a sliced model needs, as a c10d backend (gloo's, NCCL's) has
    them; torch's stubs leave them off the backends' classes."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]
    ) -> dist.Work: ...


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Rank ``rank`` of ``world_size``, joined to the other ranks by ``group``.

    The group is passed, not the process's default group, so that a process may host more
    than one engine (tests do) and no global state is set.
    """

    rank: int
    world_size: int
    group: Collectives

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} of world_size {self.world_size}: need 0 <= rank < world_size"
            )

    @classmethod
    def layout_only(cls, world_size: int) -> TensorParallel:
        """Rank 0 of ``world_size`` without a group: to shard a model built on the ``meta``
        device and learn whether the split fits (``model/loader.py: check_tensor_parallel``;
        every rank's split is refused alike). Sharding calls no collective; a forward would,
        so such a model never runs one."""
        return cls(0, world_size, cast(Collectives, None))

    def split(self, size: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``size`` equal parts (``what`` names them in errors)."""
        if size % self.world_size:
            raise ValueError(
                f"tensor parallel size {self.world_size} does not divide the model's {size} {what}"
            )
        part = size // self.world_size
        return self.rank * part, (self.rank + 1) * part

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's KV heads: a split when there are enough, else the one head its query
        heads share (replicated on ``world_size / num_kv_heads`` ranks)."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, "KV heads")
        if self.world_size % num_kv_heads:
            raise ValueError(
                f"tensor parallel size {self.world_size} is neither a divisor nor a multiple "
                f"of the model's {num_kv_heads} KV heads"
            )
        head = self.rank // (self.world_size // num_kv_heads)
        return head, head + 1

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's vocabulary rows: equal parts rounded up, the last rank's shorter."""
        part = -(-vocab_size // self.world_size)
        return min(self.rank * part, vocab_size), min((self.rank + 1) * part, vocab_size)

    def all_reduce(self, partial: torch.Tensor) -> None:
        """Sum ``partial`` over the ranks, in place."""
        self.group.allreduce([partial]).wait()

    def gather_vocab(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's ``[rows, its vocabulary]`` logits joined to ``[rows, vocab_size]``."""
        part = -(-vocab_size // self.world_size)
        padded = local_logits.new_zeros(local_logits.shape[0], part)
        padded[:, : local_logits.shape[1]] = local_logits
        pieces = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.group.allgather([pieces], [padded]).wait()
        return torch.cat(pieces, dim=1)[:, :vocab_size]


def join_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> TensorParallel:
    """Rank ``rank``'s gloo group of ``world_size`` ranks, met through ``store``.

    ``timeout`` bounds every collective: a rank that stops answering fails the others'
    next step within it rather than hanging them (a rank that dies fails them at once, its
    connections being reset).
    """
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # untyped in torch
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=GROUP_HOST)]
    options._timeout = timeout
    group = dist.ProcessGroupGloo(store, rank, world_size, options)
    return TensorParallel(rank, world_size, cast(Collectives, group))


@dataclass(frozen=True, slots=True)
class LinearShard:
    """What a sharded linear kept of the whole: its output rows ``[start, end)`` (column
    parallelism) or its input columns (row parallelism). Weights made for the whole linear
    (a LoRA adapter's) are cut the same way."""

    whole_out: int
    whole_in: int
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None


def shard_of(linear: torch.nn.Linear) -> LinearShard | None:
    """The slice ``linear`` kept (None: whole)."""
    return getattr(linear, "tensor_parallel_shard", None)


def _mark_shard(linear: torch.nn.Linear, shard: LinearShard) -> None:
    # A plain attribute (Module.__setattr__ is typed for tensors and modules only).
    object.__setattr__(linear, "tensor_parallel_shard", shard)


def keep_output_rows(linear: torch.nn.Linear, start: int, end: int) -> None:
    """Column parallelism: ``linear`` keeps output features ``[start, end)`` (and their bias);
    a packed weight keeps its rows packed."""
    _mark_shard(linear, LinearShard(linear.out_features, linear.in_features, rows=(start, end)))
    packed = packed_weight(linear)
    if packed is not None:
        attach_packed_weight(linear, packed.take_rows(torch.arange(start, end)))
    else:
        linear.weight = torch.nn.Parameter(linear.weight.detach()[start:end].clone(), False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[start:end].clone(), False)
    linear.out_features = end - start


def keep_input_columns(linear: torch.nn.Linear, start: int, end: int, keep_bias: bool) -> None:
    """Row parallelism: ``linear`` keeps input features ``[start, end)``; its bias stays on
    one rank only (``keep_bias``), since the partial outputs are summed."""
    _mark_shard(linear, LinearShard(linear.out_features, linear.in_features, columns=(start, end)))
    packed = packed_weight(linear)
    if packed is not None:
        attach_packed_weight(linear, packed.take_columns(start, end))
    else:
        linear.weight = torch.nn.Parameter(linear.weight.detach()[:, start:end].clone(), False)
    if linear.bias is not None and not keep_bias:
        linear.register_parameter("bias", None)
    linear.in_features = end - start
