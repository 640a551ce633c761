"""The CPU's paged decode kernel falls back cleanly: where it cannot be built (no C++
compiler), one warning says so and decode rows take the torch path, with the same result.
Its results themselves are checked in ``test_split_kv.py`` (both paths, against dense
attention)."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.model import paged_decode_kernel
from pdserve.model.split_kv import plan_split_kv, split_kv_attention


def test_without_a_compiler_one_warning_says_so_and_the_torch_path_serves(
    monkeypatch, caplog, tmp_path
):
    """A machine without a compiler: an empty extension cache, and ``CXX`` names none."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(paged_decode_kernel._kernel, "_module", None)
    monkeypatch.setattr(paged_decode_kernel._kernel, "_failed", False)
    generator = torch.Generator().manual_seed(3)
    layer_cache = torch.randn(9, 2, 4, 2, 8, generator=generator)
    query = torch.randn(2, 4, 8, generator=generator)
    plan = plan_split_kv(
        0, [9, 20], [[3, 1, 7], [2, 8, 4, 6, 5, 1]], 4, torch.device("cpu"), torch.float32, None, 8
    )
    with caplog.at_level(logging.WARNING, logger=paged_decode_kernel.__name__):
        assert paged_decode_kernel.build() is None and paged_decode_kernel.build() is None
        attended = split_kv_attention(query, layer_cache, plan)
    warnings = [r for r in caplog.records if "is not available" in r.getMessage()]
    assert len(warnings) == 1 and "failed to build" in warnings[0].getMessage()
    assert not paged_decode_kernel.serves(query, layer_cache)
    monkeypatch.undo()  # the real kernel again, where it is built
    if paged_decode_kernel.build() is None:
        pytest.skip("no C++ compiler here: the kernel's side of the comparison cannot run")
    torch.testing.assert_close(split_kv_attention(query, layer_cache, plan), attended)


@pytest.mark.parametrize("width", [64, 24, 7], ids=["rows-of-64", "rows-of-24", "rows-of-7"])
@pytest.mark.parametrize("page_dtype", [torch.float16, torch.bfloat16])
def test_every_finite_16_bit_value_is_widened_exactly(page_dtype, width):
    """A row that sees one key returns that key's value row as read: every finite float16 or
    bfloat16 bit pattern (subnormals and signed zeros too) equals torch's widening of it.
    float16 rows are converted 16 at a time where the CPU has AVX-512 (rows of 64), then 8
    at a time with F16C (rows of 24: 16 + 8), and the rest element by element in portable
    operations (rows of 7, a head size the kernel knows only at run time)."""
    if paged_decode_kernel.build() is None:
        pytest.skip("the paged decode kernel cannot be built here (no C++ compiler)")
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(page_dtype)
    values = values[torch.isfinite(values.float())]
    values = torch.cat([values, values[: (-len(values)) % width]])  # whole rows
    rows = values.view(-1, width)
    batch = rows.shape[0]
    pages = torch.zeros(batch + 1, 2, 1, 1, width, dtype=page_dtype)  # one-slot pages, one head
    pages[1:, 1, 0, 0] = rows
    attended = paged_decode_kernel.paged_decode(
        torch.zeros(batch, 1, width),
        pages,
        torch.arange(1, batch + 1).view(batch, 1),
        torch.arange(batch + 1),  # a token per row
        torch.zeros(batch, dtype=torch.long),
        torch.ones(batch, dtype=torch.long),
        None,
    )
    assert torch.equal(attended[:, 0], rows.float())
