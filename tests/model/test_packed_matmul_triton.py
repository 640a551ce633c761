"""Runs ``interpreter_checks_packed_matmul.py`` (the GPU's packed-weight kernels in Triton's
interpreter, on CPU tensors) in a pytest of its own with ``TRITON_INTERPRET=1`` set before
Triton is imported, which the interpreter needs (that module's docstring)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).with_name("interpreter_checks_packed_matmul.py")


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton runs the kernels' interpreter: pip install -e '.[test]'",
)
def test_the_gpu_packed_weight_kernels_in_tritons_interpreter():
    checked = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout[-6000:] + checked.stderr[-2000:]
    assert " passed" in checked.stdout and " failed" not in checked.stdout
