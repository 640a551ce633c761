"""The GPU suite: every test here needs CUDA and is skipped, saying so, without it.

Run them all on a GPU machine with ``tests/gpu/run_gpu_checks.sh``.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        item.add_marker(skip)
