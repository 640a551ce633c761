"""The CPU's RMSNorm kernel (``model/rms_norm_kernel.py``) equals torch's ``rms_norm`` within
float32 rounding on every layout a model hands it (rows, strided head views, Gemma's offset),
and RMSNorm falls back to torch's operations, with one warning, where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model import rms_norm_kernel
from pdserve.model.architectures.layers import RMSNorm


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, eps=eps) * (weight + offset)


@pytest.fixture(scope="module")
def kernel() -> None:
    if rms_norm_kernel.build() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built")


@settings(max_examples=60, deadline=None)
@given(
    outer=st.integers(1, 4),
    inner=st.integers(0, 5),
    columns=st.integers(1, 200),
    spare=st.integers(0, 3),
    dims=st.sampled_from([1, 2, 3]),
    offset=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_equals_torch_on_rows_and_strided_views(
    kernel, outer, inner, columns, spare, dims, offset, seed
):
    """``x`` is a view of a wider buffer (``spare`` heads and columns more, as q or k in a
    fused qkv), with 1, 2 or 3 dimensions."""
    generator = torch.Generator().manual_seed(seed)
    buffer = 4 * torch.randn(outer, inner + spare + 1, columns + spare, generator=generator)
    x = {3: buffer[:, :inner, :columns], 2: buffer[0, :inner, :columns], 1: buffer[0, 0, :columns]}[
        dims
    ]
    weight = torch.randn(columns, generator=generator)
    before = buffer.clone()
    with torch.inference_mode():
        assert rms_norm_kernel.serves(x, weight)
        normed = rms_norm_kernel.rms_norm(x, weight, 1e-6, offset)
        expected = torch_rms_norm(x, weight, 1e-6, offset)
    assert normed.shape == x.shape
    torch.testing.assert_close(normed, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(buffer, before)  # nothing written into the input


def test_it_serves_float32_cpu_rows_in_inference_only(kernel):
    weight = torch.ones(8)
    rows = torch.randn(3, 8)
    with torch.inference_mode():
        assert rms_norm_kernel.serves(rows, weight)
        assert not rms_norm_kernel.serves(rows.bfloat16(), weight)
        assert not rms_norm_kernel.serves(rows.t(), torch.ones(3))  # columns not contiguous
        assert not rms_norm_kernel.serves(rows.view(1, 1, 3, 8), weight)
        with pytest.raises(ValueError, match="width 4 given rows of 8"):
            rms_norm_kernel.rms_norm(rows, torch.ones(4), 1e-6, 0.0)
    assert not rms_norm_kernel.serves(rows, weight)  # grad enabled: torch's ops, with autograd


def test_without_a_compiler_one_warning_says_so_and_torch_serves(monkeypatch, caplog, tmp_path):
    """A machine without a compiler: an empty extension cache, and ``CXX`` names none."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(rms_norm_kernel._kernel, "_module", None)
    monkeypatch.setattr(rms_norm_kernel._kernel, "_failed", False)
    norm = RMSNorm(16, 1e-5, weight_offset=1.0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    with caplog.at_level(logging.WARNING, logger=rms_norm_kernel.__name__), torch.inference_mode():
        fallback = norm.forward(x)
        assert norm.forward(x).equal(fallback)
    warnings = [r for r in caplog.records if "is not available" in r.getMessage()]
    assert len(warnings) == 1 and "failed to build" in warnings[0].getMessage()
    monkeypatch.undo()  # the real kernel again, where it is built
    if rms_norm_kernel.build() is None:
        pytest.skip("no C++ compiler here: the kernel's side of the comparison cannot run")
    with torch.inference_mode():
        torch.testing.assert_close(norm.forward(x), fallback, rtol=1e-6, atol=1e-6)
