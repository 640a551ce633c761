"""A GGUF tensor's quantized blocks read into the packed form that multiplies them.

llama.cpp's block types, each affine in groups of 32 inputs (``int4_planes.py`` runs
``w = scale * code + offset``); ``d``, ``m``, ``dmin`` are float16::

    type   block (inputs / bytes)        code bits   per group of 32: scale, offset
    Q4_0   32 / 18: d, 16 B nibbles      4           d,              -8 d
    Q4_1   32 / 20: d, m, nibbles        4           d,              m
    Q5_0   32 / 22: d, 4 B high bits,    5           d,              -16 d
           16 B nibbles (bit i: input i)
    Q5_1   32 / 24: d, m, high bits, …   5           d,              m
    Q8_0   32 / 34: d, 32 int8           8           d,              -128 d  (code = q + 128)
    Q4_K   256 / 144: d, dmin, 12 B of   4           d * sc_i,       -dmin * m_i
           6-bit (sc, m) for 8 groups, 128 B nibbles (low: group 2c, high: 2c + 1)
    Q5_K   256 / 176: Q4_K's and 32 B    5           d * sc_i,       -dmin * m_i
           of high bits (bit i: group i)
    Q6_K   256 / 210: 128 B low nibbles, 64 B high 2 bits, 16 int8 scales (one per 16
           inputs), d: scales per 16 the int4 kernel's groups of 32 cannot hold, so it is
           dequantized and requantized to int8 per row (``int8_channels.py``: lossy)

Nibbles of a 32-input block: the low nibbles are inputs 0-15, the high ones 16-31 (K-types:
32 bytes per pair of groups). The layouts are llama.cpp's (``ggml-quants.c``), as the
``gguf`` package dequantizes them; ``tests/model/test_quantized_weight.py`` checks every
type against that dequantizer.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Quant
from gguf.quants import dequantize

from pdserve.model.quantization.int4_planes import Int4PlanesWeight
from pdserve.model.quantization.int8_channels import Int8ChannelWeight
from pdserve.model.quantization.quantized_weight import QuantizedWeight

# (codes, scale, offset) of each group of 32, per block: codes [blocks, inputs]; an int
# offset c is -c * scale (the symmetric types: kept exact, ``int4_planes.py``).
Affine = tuple[np.ndarray, np.ndarray, np.ndarray | int]


def gguf_weight(tensor_type: Quant, data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """The packed weight of a GGUF tensor: ``data`` its raw bytes (``ReaderTensor.data``),
    ``shape`` ``(rows, inputs)``."""
    rows, inputs = shape
    if tensor_type == Quant.Q6_K:
        values = dequantize(np.asarray(data), tensor_type).reshape(rows, inputs)
        return Int8ChannelWeight.from_float(torch.from_numpy(values), scheme="Q6_K")
    if tensor_type not in _READERS:
        raise ValueError(f"GGUF type {tensor_type.name} is not run packed")
    block_inputs, block_bytes = GGML_QUANT_SIZES[tensor_type]
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes)
    read, bits = _READERS[tensor_type]
    codes, scale, offset = read(blocks)
    groups = (rows, inputs // 32)
    return Int4PlanesWeight.from_affine(
        tensor_type.name,
        torch.from_numpy(codes.reshape(rows, inputs)),
        torch.from_numpy(scale.reshape(groups).astype(np.float32)),
        offset if isinstance(offset, int) else torch.from_numpy(offset.reshape(groups)),
        bits,
    )


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[blocks, n]`` bytes to ``[blocks, 2n]`` codes: the low nibbles, then the high."""
    return np.concatenate([packed & 15, packed >> 4], axis=1)


def _high_bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Bit ``i`` of a little-endian bit field, for ``i < count``: ``[blocks, count]``."""
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :count]


def _q4_0(blocks: np.ndarray) -> Affine:
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, 8


def _q4_1(blocks: np.ndarray) -> Affine:
    return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks: np.ndarray) -> Affine:
    d = _half(blocks, 0)
    codes = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6], 32) << 4)
    return codes, d, 16


def _q5_1(blocks: np.ndarray) -> Affine:
    codes = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8], 32) << 4)
    return codes, _half(blocks, 0), _half(blocks, 2)


def _q8_0(blocks: np.ndarray) -> Affine:
    d = _half(blocks, 0)
    codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, 128


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 groups' (scale, offset) of a Q4_K / Q5_K super-block: 6-bit ``sc`` and ``m``
    packed in 12 bytes (groups 0-3 in the low 6 bits of bytes 0-3 and 4-7; groups 4-7 in
    bytes 8-11's nibbles and the top 2 bits of bytes 0-7)."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    low, mins, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    m = np.concatenate([mins & 0x3F, (mixed >> 4) | ((mins >> 2) & 0x30)], axis=1)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    return d * sc.astype(np.float32), -dmin * m.astype(np.float32)


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """128 bytes to 256 codes: per 32 bytes, the low nibbles are group 2c, the high 2c + 1."""
    chunks = packed.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=2).reshape(-1, 256)


def _q4_k(blocks: np.ndarray) -> Affine:
    scale, offset = _k_scales(blocks)
    return _k_nibbles(blocks[:, 16:144]), scale, offset


def _q5_k(blocks: np.ndarray) -> Affine:
    scale, offset = _k_scales(blocks)
    high = (
        blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    ) & 1
    codes = _k_nibbles(blocks[:, 48:176]) | (high.reshape(-1, 256) << 4)
    return codes, scale, offset


_READERS = {
    Quant.Q4_0: (_q4_0, 4),
    Quant.Q4_1: (_q4_1, 4),
    Quant.Q5_0: (_q5_0, 5),
    Quant.Q5_1: (_q5_1, 5),
    Quant.Q8_0: (_q8_0, 8),
    Quant.Q4_K: (_q4_k, 4),
    Quant.Q5_K: (_q5_k, 5),
}

# The GGUF types kept packed; any other quantized type loads dequantized.
PACKED_TYPES = frozenset({*_READERS, Quant.Q6_K})
