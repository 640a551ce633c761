"""What one worker's model will hold in memory, known before a weight is read.

``pdserve up`` refuses a model that cannot fit before it deploys (``deploy/preflight.py``):
loaded, a 7B model dequantized to float32 (≈ 30 GB) is killed by the OOM killer inside a
Ray worker, which reads as a worker that never starts. The estimate counts what the load
will allocate::

    worker bytes = weights at the size they run + the KV pool
    weights      = each tensor: packed → its bytes in the file (a GGUF quantized type), or
                                   the int4 planes' 5 / 10 bits a weight (AWQ, GPTQ)
                                   int8  → a byte a weight, 10 a row (int8_channels.py)
                                   float → its elements × the dtype's bytes

The packed formats keep a GGUF type's blocks at about the file's size (``model/quantization``);
the KV pool is ``num_kv_blocks`` pages, else ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from pdserve.checkpoint.gguf_file import open_gguf
from pdserve.checkpoint.model_source import resolve_model
from pdserve.messages.engine_config import EngineConfig
from pdserve.model.gguf_loader import FLOAT_TYPES
from pdserve.model.model_config import ModelConfig, resolve_device, resolve_dtype
from pdserve.model.quantization.checkpoint_format import checkpoint_quantization
from pdserve.model.quantization.int8_channels import INT8_ROW_BYTES

_SAFETENSORS_HEADER_LENGTH = 8  # a little-endian u64, then the JSON header


def weights_bytes(engine: EngineConfig, config: ModelConfig, packable: set[str]) -> int:
    """The bytes ``engine``'s model holds once loaded, with ``packable`` (the names the
    architecture may pack) packed as ``engine.quantization`` says."""
    element_bytes = resolve_dtype(engine.dtype).itemsize
    source = resolve_model(engine.model)
    if source.kind in ("tiny", "sim"):
        return 0  # a few MB, or none: never the one that does not fit
    if source.kind == "gguf":
        total = 0
        reader = open_gguf(source.file_path())
        for tensor in reader.tensors:
            elements = int(math.prod(int(dim) for dim in tensor.shape))
            packed = engine.quantization != "none" and tensor.tensor_type not in FLOAT_TYPES
            if packed:
                total += int(tensor.n_bytes)
            elif engine.quantization == "int8" and len(tensor.shape) == 2:
                total += elements + INT8_ROW_BYTES * int(tensor.shape[1])
            else:
                total += elements * element_bytes
        return total
    shapes = _safetensors_shapes(source.file_path())
    stored = checkpoint_quantization(source.file_path())
    kind = torch.device(resolve_device(engine.device)).type
    packed_by_checkpoint: set[str] = set()
    if stored is not None:
        for module in stored.linears(shapes):
            logical = stored.logical_shape(shapes, module)
            shapes = {n: s for n, s in shapes.items() if not n.startswith(f"{module}.")}
            shapes[f"{module}.weight"] = logical
            if engine.quantization != "none" and stored.runs_packed_on(kind):
                packed_by_checkpoint.add(f"{module}.weight")
    total = 0
    for name, shape in shapes.items():
        elements = math.prod(shape)
        if name in packed_by_checkpoint and name in packable and stored is not None:
            total += int(elements * stored.bits_held_on(kind) / 8)
        elif engine.quantization == "int8" and name in packable:
            total += elements + INT8_ROW_BYTES * shape[0]
        else:
            total += elements * element_bytes
    return total


def kv_pool_bytes(engine: EngineConfig, bytes_per_block: int) -> int:
    """The KV pool the engine allocates: its blocks' pages, else its memory budget."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks * bytes_per_block
    return engine.kv_cache_memory_bytes


def _safetensors_shapes(directory: Path) -> dict[str, list[int]]:
    """Every tensor's shape from the safetensors headers (the first few KB of each file)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(_SAFETENSORS_HEADER_LENGTH))
            header = json.loads(file.read(length))
        shapes.update(
            (name, entry["shape"]) for name, entry in header.items() if name != "__metadata__"
        )
    return shapes
