"""Run a call inline when it is small, on a worker thread when it is large.

The gateway's event loop serves every stream of its process and must not stall on one request's CPU work, but a thread hop costs up to milliseconds on a
busy 2-core machine, far more than a small call itself. So the caller states the work's
size and the largest size worth doing inline:

    size <= inline_limit   → called here, on the loop (microseconds)
    size >  inline_limit   → asyncio.to_thread (the loop keeps serving the other streams)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def call_by_size(
    size: int, inline_limit: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """``fn(*args, **kwargs)``, inline when ``size <= inline_limit``, else on a thread."""
    if size <= inline_limit:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
