"""Packed matmul (``model/quantization/``) against float32 ``torch.mm`` on the dequantized
matrix, per scheme, on one thread, at smollm2's shapes, side by side in one process.

Each shape is held ``--layers`` times (distinct copies, as a model's 30 layers are), and a
timing runs one matmul per copy, so the weights stream from memory as in a decode step
instead of sitting in the cache. Printed: milliseconds per pass over the copies and the
speed-up ``float32 / packed`` (median of ``--repeats``).

Measured here (Sapphire Rapids with AMX, 2 cores shared with other jobs (load average
2-3: the figures are noisy, about +-30 %), torch 2.13 CPU, one thread, 30 copies; speed-up
of the packed matmul over float32 ``mm`` at 1 / 16 / 512 rows of x)::

    scheme  bits/w  576->3072 gate+up  1536->576 down   576->960 qkv     576->576 o
    Q4_0     5.00   4.0 / 2.2 / 2.0    2.3 / 1.7 / 1.4  8.4 / 1.5 / 1.3  3.7 / 2.1 / 1.3
    Q4_1     5.00   3.6 / 2.1 / 1.5    2.4 / 1.6 / 1.5  5.8 / 1.8 / 1.4  4.4 / 1.4 / 1.4
    Q5_0    10.00   1.9 / 1.5 / 1.0    1.4 / 1.3 / 1.5  2.6 / 1.4 / 1.0  2.0 / 1.2 / 1.0
    Q5_1    10.00   1.8 / 1.6 / 1.0    1.9 / 1.3 / 1.1  2.4 / 1.4 / 1.0  2.1 / 0.9 / 1.0
    Q8_0    10.00   2.0 / 1.5 / 1.0    1.4 / 1.2 / 1.0  3.4 / 1.5 / 1.0  2.4 / 1.2 / 0.9
    Q4_K     5.00   2.6 / 2.0 / 1.4    4.7 / 1.6 / 1.2  4.3 / 2.0 / 1.6  3.7 / 1.6 / 1.3
    Q5_K    10.00   2.0 / 1.5 / 0.7    0.9 / 1.4 / 1.0  3.2 / 1.3 / 1.0  1.8 / 1.1 / 0.9
    Q6_K     8.03   1.8 / 1.2 / 1.4    1.6 / 1.0 / 3.8  1.2 / 2.2 / 2.1  2.0 / 0.9 / 2.4
    int8     8.03   2.0 / 1.6 / 3.6    1.8 / 0.6 / 2.8  4.6 / 0.6 / 3.5  1.1 / 1.2 / 2.6

1 and 16 rows of float32 x: the C++ kernel (``int4_tiles_kernel.py``) for the group types,
torch's ``_weight_int8pack_mm`` for Q6_K and int8; 512 rows: dequantized, bfloat16 ``mm``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Quant
from gguf.quants import quantize

from pdserve.model.quantization import QuantizedWeight, gguf_weight, int8_weight

SHAPES = {  # name: (out, in)
    "576->3072 gate+up": (3072, 576),
    "1536->576 down": (576, 1536),
    "576->960 q+k+v": (960, 576),
    "576->576 o": (576, 576),
}
SCHEMES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "int8"]
K_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def packed_weight(scheme: str, rows: int, columns: int) -> QuantizedWeight:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((rows, columns)).astype(np.float32) * 0.05
    if scheme == "int8":
        return int8_weight(torch.from_numpy(values))
    quant = Quant[scheme]
    if scheme in K_SCALE_FIELDS:  # the gguf package does not quantize K-types
        block_inputs, block_bytes = GGML_QUANT_SIZES[quant]
        count = rows * columns // block_inputs
        raw = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
        start, fields = K_SCALE_FIELDS[scheme]
        scales = rng.uniform(1e-4, 1e-2, (count, fields)).astype(np.float16)
        raw[:, start : start + 2 * fields] = scales.view(np.uint8)
    else:
        raw = quantize(values, quant)
    return gguf_weight(quant, raw, (rows, columns))


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_both(
    floats: list[torch.Tensor], packed: list[QuantizedWeight], x: torch.Tensor, repeats: int
) -> tuple[float, float]:
    """Seconds of a pass of ``x`` over every copy: float32 ``mm``, then the packed matmul."""
    f32 = median_seconds(lambda: [torch.mm(x, weight.t()) for weight in floats], repeats)
    ours = median_seconds(lambda: [weight.matmul(x) for weight in packed], repeats)
    return f32, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="*", default=SCHEMES)
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 16, 512])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"{'scheme':7} {'shape':20} {'bits/w':>6} "
        + " ".join(f"{f'{rows} rows: f32 / packed ms':>28}" for rows in args.rows)
    )
    for scheme in args.schemes:
        for name, (out_features, in_features) in SHAPES.items():
            weight = packed_weight(scheme, out_features, in_features)
            packed = [copy.deepcopy(weight) for _ in range(args.layers)]
            floats = [weight.dequantize().clone() for _ in range(args.layers)]
            bits = 8 * weight.nbytes / (out_features * in_features)
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, in_features)
                f32, ours = time_both(floats, packed, x, args.repeats)
                cells.append(f"{f32 * 1e3:8.2f} / {ours * 1e3:7.2f} = {f32 / ours:4.1f}x")
            print(f"{scheme:7} {name:20} {bits:6.2f} " + " ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
