"""The GPU's packed-weight kernels (``model/quantization/packed_matmul_triton.py``) and the
weights that run them (``grouped_int4_weight.py``, ``fp8_weight.py``), checked in Triton's
interpreter on CPU tensors: no GPU is lent to this machine, so the interpreter stands in for
one. Every product equals ``x @ dequantize().T`` but for float32's order of sums, and the
weights' rows and columns are taken and fused as the float matrix's.

Run by ``test_packed_matmul_triton.py`` in a pytest of its own with ``TRITON_INTERPRET=1``
set before Triton is imported (Triton decides at import whether its own library functions
are interpreted), hence the name outside ``test_*``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model.loader import check_model, load_model
from pdserve.model.quantization import packed_matmul_triton
from pdserve.model.quantization.fp8_weight import Fp8Weight
from pdserve.model.quantization.grouped_int4_weight import GroupedInt4Weight
from pdserve.model.quantization.int4_checkpoints import AffineGroups
from pdserve.model.quantization.quantized_weight import concat_rows, packed_weight
from tests.model.test_quantized_checkpoints import (
    FORMATS,
    dequantized_load_logits,
    fp8_block_linear,
    fp8_channel_linear,
    last_logits,
    random_llama,
    write_quantized,
)

EXAMPLES = settings(max_examples=12, deadline=None)


def assert_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``y = x @ weight.T`` within float32's rounding of the sums (bfloat16's for a bfloat16
    x, whose products the kernels make in bfloat16 as a tensor core would)."""
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = (1e-5 if x.dtype == torch.float32 else 2e-2) * magnitude + 1e-6
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().max()


def random_groups(outs: int, inputs: int, group: int, seed: int) -> AffineGroups:
    generator = torch.Generator().manual_seed(seed)
    groups = -(-inputs // group)
    return AffineGroups(
        "AWQ",
        torch.randint(0, 16, (outs, inputs), generator=generator, dtype=torch.uint8),
        torch.rand(outs, groups, generator=generator) / 50,
        torch.randint(0, 16, (outs, groups), generator=generator, dtype=torch.int16),
        torch.arange(inputs) // group,
        bits=4,
    )


@EXAMPLES
@given(
    outs=st.integers(1, 150),
    groups=st.integers(1, 3),
    group=st.sampled_from([32, 64, 128]),
    rows=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_int4_groups_multiply_as_their_dequantized_matrix(outs, groups, group, rows, dtype, seed):
    source = random_groups(outs, groups * group, group, seed)
    weight = GroupedInt4Weight.from_groups(source, torch.device("cpu"))
    torch.testing.assert_close(weight.dequantize(), source.dequantize(), rtol=1e-6, atol=1e-6)
    x = torch.randn(rows, groups * group, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = weight.matmul(x)
    assert y.shape == (rows, outs) and y.dtype == dtype
    assert_product(
        y, x, weight.dequantize().to(dtype) if dtype != torch.float32 else weight.dequantize()
    )


def fp8_case(outs: int, inputs: int, granularity: str, seed: int):
    """An fp8 weight and scale of ``granularity`` and the float32 matrix they describe."""
    generator = torch.Generator().manual_seed(seed)
    fp8 = (torch.randn(outs, inputs, generator=generator) * 100).to(torch.float8_e4m3fn)
    block = None
    if granularity == "tensor":
        scale = torch.rand((), generator=generator)
        expanded = scale.expand(outs, inputs)
    elif granularity == "channel":
        scale = torch.rand(outs, 1, generator=generator)
        expanded = scale.expand(outs, inputs)
    else:
        block = (32, 64)
        scale = torch.rand(-(-outs // 32), -(-inputs // 64), generator=generator)
        expanded = scale.repeat_interleave(32, 0).repeat_interleave(64, 1)[:outs, :inputs]
    return fp8, scale, block, fp8.float() * expanded


@EXAMPLES
@given(
    outs=st.integers(1, 150),
    inputs=st.integers(1, 200),
    granularity=st.sampled_from(["tensor", "channel", "block"]),
    rows=st.integers(1, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fp8_weights_multiply_as_their_dequantized_matrix(
    outs, inputs, granularity, rows, dtype, seed
):
    """Per tensor, per channel and in blocks (ragged at both edges)."""
    fp8, scale, block, expected = fp8_case(outs, inputs, granularity, seed)
    weight = Fp8Weight.from_checkpoint(fp8, scale, block, torch.device("cpu"))
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)).to(dtype)
    y = weight.matmul(x)
    assert y.shape == (rows, outs) and y.dtype == dtype
    assert_product(y, x, expected.to(dtype) if dtype != torch.float32 else expected)


def test_every_fp8_byte_decodes_as_torch_reads_it():
    """The kernel decodes the bits itself (no ``float8e4nv``: module doc): all 256 bytes,
    subnormals and negative zero included (NaN, which no checkpoint stores, aside)."""
    every = torch.arange(256, dtype=torch.uint8)
    values = every.view(torch.float8_e4m3fn).float()
    finite = ~values.isnan()
    weight = Fp8Weight(every[finite].view(-1, 1).contiguous(), torch.ones(int(finite.sum()), 1), 1)
    decoded = weight.matmul(torch.ones(1, 1))[0]
    assert torch.equal(decoded, values[finite])


def test_rows_columns_and_fusions_are_the_dequantized_matrixs():
    """What the loader and tensor parallelism do to a weight: rows taken (a rank's share of
    q/k/v), whole groups or blocks of inputs taken (o_proj's), parts fused (q/k/v)."""
    int4 = GroupedInt4Weight.from_groups(random_groups(40, 256, 128, 1), torch.device("cpu"))
    fp8 = Fp8Weight.from_checkpoint(*fp8_case(40, 256, "block", 2)[:3], torch.device("cpu"))
    rows = torch.tensor([39, 0, 7, 8, 31, 32])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    for weight in (int4, fp8):
        full = weight.dequantize()
        torch.testing.assert_close(weight.take_rows(rows).dequantize(), full[rows])
        torch.testing.assert_close(weight.embedding_rows(rows), full[rows])
        half = weight.take_columns(128, 256)
        torch.testing.assert_close(half.dequantize(), full[:, 128:])
        assert_product(half.matmul(x), x, full[:, 128:])
        fused = concat_rows([weight.take_rows(rows[:2]), weight.take_rows(rows[2:])])
        assert type(fused) is type(weight)
        torch.testing.assert_close(fused.dequantize(), full[rows])
        with pytest.raises(ValueError, match="split its"):
            weight.take_columns(32, 256)


def test_the_kernels_serve_cuda_tensors_and_interpreted_ones_only(monkeypatch):
    x = torch.ones(1, 8)
    assert packed_matmul_triton.serves(x)
    assert packed_matmul_triton.builds_gpu_formats("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not packed_matmul_triton.serves(x)
    assert not packed_matmul_triton.builds_gpu_formats("cpu")
    assert packed_matmul_triton.builds_gpu_formats("cuda")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("float"))


@pytest.mark.parametrize(
    "name, config, linear",
    [
        ("AWQ", *FORMATS["AWQ"]),
        ("GPTQ", *FORMATS["GPTQ"]),
        ("fp8", {"quant_method": "fp8", "weight_block_size": [64, 64]}, fp8_block_linear),
        (
            "fp8",
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}},
            },
            fp8_channel_linear,
        ),
    ],
    ids=["AWQ", "GPTQ", "fp8-block", "compressed-tensors-channel"],
)
def test_a_quantized_folder_runs_packed_in_the_gpus_formats(
    tmp_path, reference, name, config, linear
):
    """The loader builds the GPU's formats (here, under the interpreter, on the CPU) and the
    model computes the logits of the weights the checkpoint describes."""
    expected = write_quantized(tmp_path, reference, config, linear)
    want = dequantized_load_logits(tmp_path, reference, expected)
    model, model_config, _ = load_model(str(tmp_path), quantization="auto")
    assert model_config.quantization == name
    q_proj = packed_weight(model.model.layers[0].self_attn.q_proj)
    assert isinstance(q_proj, Fp8Weight if name == "fp8" else GroupedInt4Weight)
    got = last_logits(model, model_config)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert check_model(str(tmp_path), quantization="auto").quantization == name


def test_an_8_bit_gptq_is_refused_packed_on_the_gpu_naming_what_serves(tmp_path, reference):
    write_quantized(tmp_path, reference, *FORMATS["GPTQ-8bit-v2"])
    with pytest.raises(ValueError, match="8-bit GPTQ weights have no kernel.*--quantization none"):
        check_model(str(tmp_path), quantization="auto")
