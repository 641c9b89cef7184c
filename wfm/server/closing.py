"""Each request's connection, in its scope, calling back when it closes: how a held waiting
poll (`wfm.fleet.waiters`) learns that its client went away.

ASGI tells an app of a disconnect only through `receive`, so a held request needed a task
of its own reading it for as long as it was held: measured in-process, 26.5 µs of CPU per
hold with it, 16.3 µs without, on the request 10,000 devices each send once a minute
while nothing changes (at the fleet's scale the difference is within the noise of
`bench/fleet.py`: docs/benchmarks.md). uvicorn's HTTP protocol
knows when the connection is lost; this mixin hands every request of the connection a
`Closing` under `CLOSING_SCOPE_KEY`, which calls back whoever registered when it is.
A request served without it (another server, a test client) watches `receive` as before.
The same object is the connection `wfm.admission.parking` keeps a held answer's renewal on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from wfm.admission.parking import Connection
from wfm.fleet.waiters import CLOSING_SCOPE_KEY

__all__ = ["ConnectionClosing", "closing_protocol"]


class ConnectionClosing(Connection):
    """One connection's callbacks, called once when it closes (at once for one registered
    after it closed)."""

    __slots__ = ("_callbacks", "closed")

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: set[Callable[[], None]] = set()
        self.closed = False

    def add(self, callback: Callable[[], None]) -> None:
        if self.closed:
            callback()
        else:
            self._callbacks.add(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        self._callbacks.discard(callback)

    def keep(self, kept: Any) -> None:
        # Closed already (while the answer that keeps it was made): nothing comes next, and
        # what it kept refers back to it (a held poll's `Closing`): a cycle for the collector.
        super().keep(None if self.closed else kept)

    def close(self) -> None:
        self.closed = True
        self.kept = None
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()


class _ClosingNotice:
    """A mixin for uvicorn's httptools protocol: each request's scope gets the connection's
    `ConnectionClosing`, closed once the connection is lost."""

    scope: dict[str, Any]

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._closing = ConnectionClosing()
        super().connection_made(transport)  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # type: ignore[misc]
        self._closing.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self.scope[CLOSING_SCOPE_KEY] = self._closing


def closing_protocol(base: type) -> type:
    """`base`, an httptools protocol class of uvicorn's, telling each request of its
    connections when the connection closes (module docstring)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if not issubclass(base, HttpToolsProtocol):
        raise TypeError(f"{base.__name__} is not uvicorn's httptools protocol")
    return type(f"Closing{base.__name__}", (_ClosingNotice, base), {})
