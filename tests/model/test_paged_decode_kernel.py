"""The CPU's paged decode kernel falls back cleanly: where it cannot be built (no C++
compiler), one warning says so and decode rows take the torch path, with the same result.
Its results themselves are checked in ``test_split_kv.py`` (both paths, against dense
attention)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.cpp_extension

from pdserve.model import paged_decode_kernel
from pdserve.model.split_kv import plan_split_kv, split_kv_attention


def test_without_a_compiler_one_warning_says_so_and_the_torch_path_serves(monkeypatch, caplog):
    def no_compiler(**_: object) -> None:
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(paged_decode_kernel, "_built", None)
    monkeypatch.setattr(paged_decode_kernel, "_failed", False)
    generator = torch.Generator().manual_seed(3)
    layer_cache = torch.randn(9, 2, 4, 2, 8, generator=generator)
    query = torch.randn(2, 4, 8, generator=generator)
    plan = plan_split_kv(
        0, [9, 20], [[3, 1, 7], [2, 8, 4, 6, 5, 1]], 4, torch.device("cpu"), torch.float32, None, 8
    )
    with caplog.at_level(logging.WARNING, logger=paged_decode_kernel.__name__):
        assert paged_decode_kernel.build() is None and paged_decode_kernel.build() is None
        attended = split_kv_attention(query, layer_cache, plan)
    warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "command not found" in warnings[0].getMessage()
    assert not paged_decode_kernel.serves(query, layer_cache)
    monkeypatch.undo()  # the real kernel again, where it is built
    if paged_decode_kernel.build() is None:
        pytest.skip("no C++ compiler here: the kernel's side of the comparison cannot run")
    torch.testing.assert_close(split_kv_attention(query, layer_cache, plan), attended)
