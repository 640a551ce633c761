"""A digest of a checkpoint's weights: what makes two workers' KV pages interchangeable
beyond their model's config.

Two checkpoints with one ``config.json`` (a fine-tune and its base, two seeds of one
architecture, a rolling update to new weights) have pages of the same shape, whose bytes
mean different things: a decode worker that pulled the other's pages would decode them as
its own and return wrong tokens, every checksum verifying. ``ModelConfig.fingerprint``,
which the KV plane's handshake compares, therefore covers this digest too.

It is taken over the weight files as stored (every byte, in the loader's file order, each
file's size first), not the tensors as loaded: the same checkpoint in two directories, or
loaded at another dtype or tensor-parallel degree, has one digest. xxh3-128 reads the
memory-mapped file, and the load that follows reads the same pages from the page cache:
smollm2's 98 MB GGUF took 30 ms here (about 3 GB/s, so half a minute for a 100 GB
checkpoint, beside the load's own read of it).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path

import torch
import xxhash


def weights_digest(files: Sequence[Path]) -> str:
    """32 hex digits over ``files``' sizes and bytes, in the order given."""
    digest = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        digest.update(size.to_bytes(8, "little"))
        if size == 0:  # mmap refuses an empty file
            continue
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            digest.update(view)
    return digest.hexdigest()


def parameters_digest(model: torch.nn.Module) -> str:
    """32 hex digits over a generated model's parameters (``tiny``, which has no files):
    each one's name and bytes, in the model's own order."""
    digest = xxhash.xxh3_128()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()
