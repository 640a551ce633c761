"""What two workers must agree on before one may read the other's KV blocks.

A block travels as raw bytes: one page of the KV tensor

    kv_cache: [num_blocks, num_layers, entries, block_size, num_kv_heads, head_size]
               └──────────── one page = page_bytes ───────────────────────┘

(``entries``: 2 for K and V; 1 for a latent-attention model's one row per token)

so a page from a peer with another layer count, head shape, dtype or block size would land
as garbage that no checksum catches (the checksum is of the sender's bytes), and so would a
page of another model of the very same shape (``model``: architecture and a digest of its
config). The hash algorithm and seed must match too, or a block hash names different tokens
on each side.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pdserve.proto import kv_transfer_pb2


class LayoutMismatchError(ValueError):
    """Two workers' KV layouts differ, so their blocks cannot be exchanged."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    hash_algorithm: str
    hash_seed: int
    model: str = ""  # ModelConfig.fingerprint; "" in unit tests that move raw tensors
    kv_entries: int = 2

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block: all layers, K and V (or the latent), every token slot of the block."""
        return (
            self.num_layers
            * self.kv_entries
            * self.block_size
            * self.num_kv_heads
            * self.head_size
            * self.itemsize
        )

    @classmethod
    def from_kv_cache(
        cls, kv_cache: torch.Tensor, hash_algorithm: str, hash_seed: int, model: str = ""
    ) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 1 or 2, block_size, num_kv_heads, "
                f"head_size]; got shape {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous: a block is moved as one page")
        _, num_layers, kv_entries, block_size, num_kv_heads, head_size = kv_cache.shape
        return cls(
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            hash_algorithm=hash_algorithm,
            hash_seed=hash_seed,
            model=model,
            kv_entries=kv_entries,
        )

    def to_proto(self) -> kv_transfer_pb2.KvLayout:
        return kv_transfer_pb2.KvLayout(**{f.name: getattr(self, f.name) for f in fields(self)})

    @classmethod
    def from_proto(cls, message: kv_transfer_pb2.KvLayout) -> KVLayout:
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ``LayoutMismatchError`` naming every field on which the two layouts differ."""
    differences = [
        f"{f.name}: local={getattr(local, f.name)!r} remote={getattr(remote, f.name)!r}"
        for f in fields(KVLayout)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    if differences:
        raise LayoutMismatchError(
            "KV layouts differ, blocks cannot be exchanged ("
            + "; ".join(differences)
            + "); run both workers with the same model, dtype, block size and hash config"
        )
