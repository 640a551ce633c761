"""Waiting inside a test's event loop for something another task makes true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Returns once ``condition()`` holds; fails the test after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "waited in vain"
        await asyncio.sleep(0.005)
