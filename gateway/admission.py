"""An admitted HTTP request's in-flight slot, held for the request's whole ASGI life.

A streamed completion returns its response object long before its body is sent; releasing
the slot in the body generator's ``finally`` ties it to how the server happens to drive the
body (a body that never starts never runs its ``finally``, and enough such requests make the
gateway answer 429 forever). The slot is released instead by ``ReleaseSlotsAtRequestEnd``,
the outermost ASGI layer, when the request's call returns or is cancelled, however far the
body got:

    ASGI call ──▶ middleware ──▶ route: admit, hold_until_request_ends(slot) ──▶ response
                   finally: slot.end()  ◀── body sent, failed, never started, cancelled
                   (closes the token stream, then frees the place)
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]
_SLOTS_KEY = "pdserve.admission_slots"


class AdmissionSlot:
    """One place in the bounded in-flight queue, and the request's token stream: ``end``
    closes the stream (cancelling its worker streams) and frees the place, once."""

    def __init__(
        self, release: Callable[[], None], stream: AsyncGenerator[Any, None] | None = None
    ) -> None:
        self._release = release
        self.stream = stream
        self.released = False

    async def end(self) -> None:
        try:
            if self.stream is not None:
                await self.stream.aclose()  # a no-op once the body closed it
        finally:
            self.release()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release()


class ReleaseSlotsAtRequestEnd:
    """ASGI middleware: releases every slot a route registered when the request ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slots: list[AdmissionSlot] = []
        scope[_SLOTS_KEY] = slots
        try:
            await self.app(scope, receive, send)
        finally:
            for slot in slots:
                await slot.end()


def hold_until_request_ends(scope: Scope, slot: AdmissionSlot) -> None:
    """Ties ``slot`` to the request of ``scope``; its app must run the middleware."""
    slots = scope.get(_SLOTS_KEY)
    if slots is None:
        slot.release()
        raise RuntimeError(
            "the app does not run ReleaseSlotsAtRequestEnd: add it with "
            "app.add_middleware(ReleaseSlotsAtRequestEnd)"
        )
    slots.append(slot)
