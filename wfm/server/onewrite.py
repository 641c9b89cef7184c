"""A response's head and body leave in one write: one system call, one TCP segment.

uvicorn's httptools protocol writes a response's status line and headers as soon as the app
sends `http.response.start`, and its body at `http.response.body`: two writes, each a
`send()` that on loopback also runs the receiver's side of TCP, for every status report's
200, every new manifest and every deployment's YAML. This mixin gives each request cycle a
transport that holds the head until the body's first write and sends both together. Bytes
leave in the order they were written; the head waits only for what the app sends next:
* uvicorn writes every body message (an empty one too), except for HEAD: a HEAD request's
  head is not held;
* a streamed body (Git's packs): its first chunk;
* an app that fails, or ends without a body: uvicorn closes the connection, and the head
  goes first;
* a request that expects `100 Continue` is not held at all: that interim answer must leave
  before the client sends its body.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["one_write_protocol"]

#: A held head goes out with a body chunk up to this size in one buffer (copied once);
#: larger chunks go as two buffers of one `writelines`.
_JOIN_BELOW = 64 * 1024


class _HeadWithBody:
    """The transport one request cycle writes to (module docstring). Everything but
    writing and closing is the connection's transport itself."""

    __slots__ = ("_held", "_transport", "_written")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._written = False

    def write(self, data: bytes) -> None:
        if self._written:
            self._transport.write(data)
        elif self._held is None:
            self._held = data
        else:
            held, self._held, self._written = self._held, None, True
            if self._transport.is_closing():
                return
            if len(data) < _JOIN_BELOW:
                self._transport.write(held + data)
            else:
                self._transport.writelines((held, data))

    def close(self) -> None:
        held, self._held, self._written = self._held, None, True
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _OneWrite:
    """A mixin for uvicorn's httptools protocol: each request cycle (but HEAD's, and one
    expecting `100 Continue`) writes through a `_HeadWithBody`."""

    cycle: Any
    transport: asyncio.Transport

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()  # type: ignore[misc]
        cycle = self.cycle
        if cycle is None or cycle is before:  # an upgrade: no new cycle
            return
        self.cycle_made(cycle)

    def cycle_made(self, cycle: Any) -> None:
        """Each request cycle made (by uvicorn, or a renewal's: `wfm.server.wire`) writes
        through a `_HeadWithBody` (but HEAD's, and one expecting `100 Continue`)."""
        if cycle.scope["method"] != "HEAD" and not cycle.waiting_for_100_continue:
            cycle.transport = _HeadWithBody(self.transport)


def one_write_protocol(base: type) -> type:
    """`base`, an httptools protocol class of uvicorn's, writing each response's head
    together with its body (module docstring)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if not issubclass(base, HttpToolsProtocol):
        raise TypeError(f"{base.__name__} is not uvicorn's httptools protocol")
    return type(f"OneWrite{base.__name__}", (_OneWrite, base), {})
