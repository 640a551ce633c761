"""Runs each ``interpreter_checks_*.py`` beside this file (the GPU's Triton kernels in
Triton's interpreter, on CPU tensors: the packed-weight matmuls, the paged decode kernel as
the static decode step calls it) in a pytest of its own with ``TRITON_INTERPRET=1`` set before
Triton is imported, which the interpreter needs (each module's docstring)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = sorted(Path(__file__).parent.glob("interpreter_checks_*.py"))


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton runs the kernels' interpreter: pip install -e '.[test]'",
)
@pytest.mark.parametrize("checks", CHECKS, ids=[path.stem for path in CHECKS])
def test_the_gpu_kernels_in_tritons_interpreter(checks: Path):
    checked = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout[-6000:] + checked.stderr[-2000:]
    assert " passed" in checked.stdout and " failed" not in checked.stdout
