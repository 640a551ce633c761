"""A packed weight is the GGUF tensor it was read from: it dequantizes to what the ``gguf``
package's own dequantizer gives (exactly, or within the float16 rounding of a K-type's
product scales), multiplies as
``x @ dequantize().T`` does (within bfloat16 activations' rounding), and its rows looked up,
reordered and stacked are those of the dequantized matrix.

Raw blocks come from ``gguf.quants.quantize`` where the package quantizes the type; for the
K-types it does not, so they are random bytes with sane float16 scale fields.
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Quant
from gguf.quants import dequantize, quantize
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdserve.model.quantization import (
    PACKED_TYPES,
    Int4PlanesWeight,
    QuantizedWeight,
    concat_rows,
    gguf_weight,
    int4_tiles_kernel,
    int8_rows_kernel,
    int8_weight,
)
from pdserve.model.quantization.int4_planes import dequantize_plan, halves_tile
from pdserve.model.quantization.quantized_weight import ConcatenatedWeight

TYPES = sorted(PACKED_TYPES, key=lambda quant: quant.name)
K_TYPES = {Quant.Q4_K, Quant.Q5_K, Quant.Q6_K}
# Where the float16 scales sit in a K-type super-block: (byte offset, count).
K_SCALE_FIELDS = {Quant.Q4_K: (0, 2), Quant.Q5_K: (0, 2), Quant.Q6_K: (208, 1)}
BF16_BOUND = 2.0**-6  # int4_planes.py: |y - x W^T| <= 2^-6 sum |x| |w|
EXACT_BOUND = 1e-4  # float32 activations through the C++ kernel
REQUANTIZED_BOUND = 1 / 254 + 2.0**-8  # int8_channels.py: half a step, a bfloat16 scale
EXAMPLES = settings(max_examples=40, deadline=None)
# Rows of x: the kernels' few, and the first count the whole weight is dequantized at.
ROW_COUNTS = st.integers(1, 40) | st.just(dequantize_plan()[0])


def raw_tensor(quant: Quant, rows: int, columns: int, seed: int) -> np.ndarray:
    """A GGUF tensor's bytes ``[rows, row bytes]``, as ``ReaderTensor.data`` holds them."""
    rng = np.random.default_rng(seed)
    if quant not in K_TYPES:
        values = rng.standard_normal((rows, columns)).astype(np.float32)
        return quantize(values * rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32), quant)
    block_inputs, block_bytes = GGML_QUANT_SIZES[quant]
    blocks = rng.integers(0, 256, (rows * columns // block_inputs, block_bytes), dtype=np.uint8)
    start, count = K_SCALE_FIELDS[quant]
    scales = rng.uniform(1e-4, 1e-2, (len(blocks), count)).astype(np.float16)
    blocks[:, start : start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(quant: Quant, data: np.ndarray, rows: int, columns: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, quant).reshape(rows, columns))


def none() -> None:
    """``int4_tiles_kernel.build`` where the kernel is not built."""


def assert_product_close(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bound: float = BF16_BOUND
) -> None:
    """``|y - x W^T| <= bound * |x| |W|^T``, elementwise (``int4_planes.py``'s docstring)."""
    x, reference = x.double(), weight.double()
    magnitude = x.abs() @ reference.abs().T
    excess = (y.double() - x @ reference.T).abs() - bound * magnitude - 1e-6
    assert excess.max().item() <= 0, f"product off by {excess.max().item()} past the bound"


def quantized_cases():
    """(type, rows, columns, seed): rows ragged (tiles of 64 padded), columns whole blocks."""
    return st.tuples(
        st.sampled_from(TYPES), st.integers(1, 130), st.integers(1, 3), st.integers(0, 2**31)
    ).map(lambda c: (c[0], c[1], c[2] * GGML_QUANT_SIZES[c[0]][0], c[3]))


@EXAMPLES
@given(quantized_cases())
def test_a_packed_tensor_dequantizes_to_the_files_values(case):
    """Types whose scales and offsets are the file's float16 fields: the file's values
    exactly. K-types (a float16 times a 6-bit factor, rounded to float16): each weight within
    2^-6 of its group's largest. Q6_K, requantized per row: within half an int8 step of its
    row's largest."""
    quant, rows, columns, seed = case
    data = raw_tensor(quant, rows, columns, seed)
    expected = reference(quant, data, rows, columns)
    weight = gguf_weight(quant, data, (rows, columns))
    assert (weight.scheme, weight.out_features, weight.in_features) == (quant.name, rows, columns)
    if quant == Quant.Q6_K:
        bound = REQUANTIZED_BOUND * expected.abs().amax(dim=1, keepdim=True)
    elif quant in K_TYPES:
        group_max = expected.abs().view(rows, -1, 32).amax(dim=2, keepdim=True)
        bound = BF16_BOUND * group_max.expand(-1, -1, 32).reshape(rows, columns)
    else:
        bound = torch.zeros(())
    assert ((weight.dequantize() - expected).abs() <= bound + 1e-7).all()


def dot_bound(x: torch.Tensor, weight: Int4PlanesWeight) -> torch.Tensor:
    """``int4_tiles_kernel.py``'s bound for x rounded to 16 bits per group of 32: half a step
    (``max |x_g| / (2 * 127 * 254)``) times the group's ``sum |w - Z|`` (the codes times their scale),
    for each output ``[tokens, rows]``."""
    offsets = sum(
        scales_zeros[:, : weight.out_features, 1].t().double() for _, scales_zeros in weight.planes
    )
    scaled_codes = weight.dequantize().double() - offsets.repeat_interleave(32, dim=1)
    per_group = scaled_codes.abs().view(weight.out_features, -1, 32).sum(dim=2)
    half_steps = x.double().abs().view(len(x), -1, 32).amax(dim=2) / (2 * 127 * 254)
    return half_steps @ per_group.T


def assert_matmul_close(
    y: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, kernel: bool = True
) -> None:
    """``y = weight.matmul(x)`` within the bound of the path it took (``int4_planes.py``):
    float32 rows of planes through the integer-dot kernel where it is built (any count),
    within the rounding of x to 16 bits; under ``dequantize_plan()``'s count through the exact
    kernel, within 1e-4 relative; every other path within bfloat16's bound. A concatenation
    of several formats, part by part."""
    if isinstance(weight, ConcatenatedWeight):
        for start, part in starts(weight.parts):
            assert_matmul_close(y[:, start : start + part.out_features], x, part, kernel)
        return
    planes = kernel and x.dtype == torch.float32 and isinstance(weight, Int4PlanesWeight)
    if planes and int4_tiles_kernel.dots_tiles_of(halves_tile() or 0):
        assert isinstance(weight, Int4PlanesWeight)
        reference = weight.dequantize().double()
        error = (y.double() - x.double() @ reference.T).abs()
        slack = EXACT_BOUND * (x.double().abs() @ reference.abs().T) + 1e-6
        excess = error - dot_bound(x, weight) - slack
        assert excess.max().item() <= 0, f"product off by {excess.max().item()} past the bound"
    else:
        exact = planes and len(x) < dequantize_plan()[0]
        assert_product_close(y, x, weight.dequantize(), EXACT_BOUND if exact else BF16_BOUND)


@EXAMPLES
@given(
    quantized_cases(),
    ROW_COUNTS,
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.booleans(),
)
def test_matmul_is_x_times_the_dequantized_matrix(case, tokens, dtype, kernel_built):
    """Every row count (few rows: the kernel; many: dequantized), both dtypes, with the C++
    kernel and without (torch's), each within its path's bound (``assert_matmul_close``)."""
    quant, rows, columns, seed = case
    weight = gguf_weight(quant, raw_tensor(quant, rows, columns, seed), (rows, columns))
    x = torch.randn(tokens, columns, generator=torch.Generator().manual_seed(seed)).to(dtype)
    kernel = kernel_built and int4_tiles_kernel.reads_tiles_of(halves_tile() or 0)
    with mock.patch.object(int4_tiles_kernel, "build", int4_tiles_kernel.build if kernel else none):
        y = weight.matmul(x)
    assert y.shape == (tokens, rows) and y.dtype == dtype
    assert_matmul_close(y, x, weight, kernel)


@pytest.mark.skipif(
    not int4_tiles_kernel.dots_tiles_of(halves_tile() or 0),
    reason="the integer-dot kernel needs AVX-512 VNNI and VBMI (this CPU, or its build, lacks them)",
)
@EXAMPLES
@given(quantized_cases(), st.integers(1, 40))
def test_the_exact_kernel_serves_beside_the_integer_dot_one(case, tokens):
    """Where the dot variant serves, the float32 kernel is still built beside it (a CPU
    without VNNI runs it): exact to 1e-4 on the same bytes."""
    quant, rows, columns, seed = case
    weight = gguf_weight(quant, raw_tensor(quant, rows, columns, seed), (rows, columns))
    assume(isinstance(weight, Int4PlanesWeight))  # Q6_K packs as int8 rows
    x = torch.randn(tokens, columns, generator=torch.Generator().manual_seed(seed))
    y = int4_tiles_kernel.int4_tiles_mm(x, weight.kernel_planes, halves_tile() or 0)[:, :rows]
    assert_product_close(y, x, weight.dequantize(), EXACT_BOUND)


@EXAMPLES
@given(quantized_cases(), st.data())
def test_embedding_rows_taken_rows_and_columns_are_the_dequantized_ones(case, data):
    quant, rows, columns, seed = case
    weight = gguf_weight(quant, raw_tensor(quant, rows, columns, seed), (rows, columns))
    full = weight.dequantize()
    ids = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=20)))
    torch.testing.assert_close(weight.embedding_rows(ids), full[ids], rtol=0, atol=0)
    order = torch.tensor(data.draw(st.permutations(range(rows))))
    taken = weight.take_rows(order)
    assert (taken.scheme, taken.out_features, taken.in_features) == (quant.name, rows, columns)
    torch.testing.assert_close(taken.dequantize(), full[order], rtol=0, atol=0)
    groups = columns // 32
    start = 32 * data.draw(st.integers(0, groups - 1))
    end = 32 * data.draw(st.integers(start // 32 + 1, groups))
    sliced = weight.take_columns(start, end)  # a row-parallel rank's inputs
    assert (sliced.out_features, sliced.in_features) == (rows, end - start)
    torch.testing.assert_close(sliced.dequantize(), full[:, start:end], rtol=0, atol=0)


@EXAMPLES
@given(st.lists(quantized_cases(), min_size=2, max_size=3), st.integers(1, 40))
def test_concat_rows_stacks_the_weights(cases, tokens):
    """Same columns for all (the first's); one packed matrix where the types pack alike."""
    columns = max(GGML_QUANT_SIZES[quant][0] for quant, *_ in cases)
    parts: list[QuantizedWeight] = [
        gguf_weight(quant, raw_tensor(quant, rows, columns, seed), (rows, columns))
        for quant, rows, _, seed in cases
    ]
    joined = concat_rows(parts)
    expected = torch.cat([part.dequantize() for part in parts])
    assert joined.out_features == sum(part.out_features for part in parts)
    torch.testing.assert_close(joined.dequantize(), expected, rtol=0, atol=0)
    x = torch.randn(tokens, columns)
    assert_matmul_close(joined.matmul(x), x, joined)
    if len({part.scheme for part in parts}) == 1:
        assert type(joined) is type(parts[0])
        assert joined.nbytes <= sum(part.nbytes for part in parts)
    rank_slice = torch.cat(  # a tensor-parallel rank's half of every part, in order
        [torch.arange(start, start + part.out_features // 2 + 1) for start, part in starts(parts)]
    )
    torch.testing.assert_close(
        joined.take_rows(rank_slice).dequantize(), expected[rank_slice], rtol=0, atol=0
    )


def starts(parts: list[QuantizedWeight]) -> list[tuple[int, QuantizedWeight]]:
    """Each part with the row it starts at in their concatenation."""
    offsets = np.cumsum([0] + [part.out_features for part in parts])
    return [(int(offset), part) for offset, part in zip(offsets, parts, strict=False)]


@pytest.mark.parametrize("quant", TYPES, ids=lambda quant: quant.name)
def test_nbytes_counts_the_packed_bits(quant):
    """4-bit types hold 5 bits a weight (scales and zeros included), 5- and 8-bit ones 10
    (two planes), Q6_K 8 and 10 bytes a row (its scale twice, its codes' sum); rows are
    padded to tiles of 64."""
    rows, columns = 128, 512
    weight = gguf_weight(quant, raw_tensor(quant, rows, columns, 0), (rows, columns))
    bits = {"Q4_0": 5, "Q4_1": 5, "Q4_K": 5, "Q6_K": 8}.get(quant.name, 10)
    assert weight.nbytes == rows * columns * bits // 8 + (10 * rows if bits == 8 else 0)


@EXAMPLES
@given(st.integers(1, 70), st.integers(1, 300), ROW_COUNTS, st.integers(0, 2**31))
def test_int8_weight_is_within_half_a_step_per_row(rows, columns, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    original = torch.randn(rows, columns, generator=generator)
    weight = int8_weight(original)
    padded = columns + -columns % 32
    assert (weight.scheme, weight.nbytes) == ("int8", rows * padded + 10 * rows)
    bound = REQUANTIZED_BOUND * original.abs().amax(dim=1, keepdim=True)
    assert ((weight.dequantize() - original).abs() <= bound + 1e-7).all()
    x = torch.randn(tokens, columns, generator=generator)
    y = weight.matmul(x)
    if int8_rows_kernel.build() is not None and tokens < dequantize_plan()[0]:
        # int8_rows_kernel.py: x rounded to 16 bits per row, the integer dot exact.
        reference = weight.dequantize().double()
        half_steps = x.double().abs().amax(dim=1, keepdim=True) / (2 * 127 * 254)
        rounding = half_steps @ reference.abs().sum(dim=1, keepdim=True).T
        slack = EXACT_BOUND * (x.double().abs() @ reference.abs().T) + 1e-6
        error = (y.double() - x.double() @ reference.T).abs()
        assert (error <= rounding + slack).all(), f"{(error - rounding - slack).max()} past"
    else:
        assert_product_close(y, x, weight.dequantize())


@pytest.mark.skipif(
    int8_rows_kernel.build() is None, reason="the int8 rows kernel needs AVX-512 VNNI and BW"
)
def test_int8_rows_kernel_and_torchs_agree_on_rows_of_every_length():
    """Row lengths past and short of the kernel's 64-input chunks and 4-row blocks, with
    torch's kernel (bfloat16 activations) as the second opinion."""
    generator = torch.Generator().manual_seed(11)
    for rows, columns in [(1, 32), (5, 96), (67, 130), (130, 576)]:
        weight = int8_weight(torch.randn(rows, columns, generator=generator))
        x = torch.randn(7, columns, generator=generator)
        dotted = weight.matmul(x)
        with mock.patch.object(int8_rows_kernel, "build", none):
            by_torch = weight.matmul(x)
        assert_product_close(dotted, x, weight.dequantize())
        torch.testing.assert_close(dotted, by_torch, rtol=2e-2, atol=2e-2 * columns**0.5)


LAYOUT_CHECK = """
import torch
from pdserve.model.quantization import Int4PlanesWeight
from pdserve.model.quantization.int4_planes import torch_int4_layout
g = torch.Generator().manual_seed(0)
codes = torch.randint(0, 256, (200, 96), generator=g, dtype=torch.uint8)
scale = (torch.rand(200, 3, generator=g) / 100).half().float()  # held as float16: exact
offset = -torch.rand(200, 3, generator=g).half().float()
weight = Int4PlanesWeight.from_affine("Q8_0", codes, scale, offset, bits=8)
want = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
assert (weight.dequantize() - want).abs().max() < 1e-3, "dequantize"
rows = torch.tensor([199, 0, 63, 64, 31, 32, 150])
assert (weight.take_rows(rows).dequantize() - want[rows]).abs().max() < 1e-3, "take_rows"
x = torch.randn(3, 96, generator=g)
bound = 2.0**-6 * (x.abs() @ want.abs().T)  # torch's bfloat16 kernel's, int4_planes.py
assert ((weight.matmul(x) - x @ want.T).abs() <= bound).all(), "matmul"
print(torch.backends.cpu.get_cpu_capability(), torch_int4_layout().shape[0])
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_each_of_torchs_int4_layouts_reads_back_as_it_was_packed(capability):
    """torch packs int4 differently per CPU capability (``int4_planes.py``); each one this
    CPU can dispatch to (``ATEN_CPU_CAPABILITY`` forces it, in a fresh process) dequantizes,
    looks up rows and multiplies as the codes say."""
    flags = set(open("/proc/cpuinfo").read().split())
    needs = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw"}}
    if not needs[capability] <= flags:
        pytest.skip(f"this CPU has no {capability} (torch would stop on an illegal instruction)")
    environment = os.environ | {"ATEN_CPU_CAPABILITY": capability}
    command = [sys.executable, "-c", LAYOUT_CHECK]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    reached, tile = result.stdout.split()
    if not reached.lower().startswith(capability):
        pytest.skip(f"this CPU cannot dispatch to {capability} (torch chose {reached})")
    assert int(tile) == (64 if capability == "avx512" else 32)
