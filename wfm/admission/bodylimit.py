"""Request body limits, enforced while the body streams in, and a deadline for it.

Handlers that call `request.body()` buffer the whole body before they can look at its
size, and the push hook and onboarding do so before anyone is authenticated: one 300 MB
body cost 735 MiB of memory, and bodies that were announced but never finished held their
connections open for ever. This ASGI middleware sits in front of every route:

- a declared ``Content-Length`` above the path's limit is answered 413 at once, without
  reading a byte of the body;
- a body without one (chunked) is counted as its chunks arrive, and the request is refused
  with 413 as soon as it passes the limit, so no more than one chunk past the limit is ever
  held;
- the whole body must arrive within the path's deadline after the headers did: a
  half-sent body gets 408 (drip-feeding a byte now and then does not reset the clock);
- every response sent before its request's body was complete (413, 408, or a handler that
  answered without reading, such as a 401) says ``Connection: close``, so uvicorn closes the
  connection instead of waiting for the rest of a body nobody will read.

With a `wfm.admission.budgets.Ledger`, every body is also admitted against the bytes in flight of
its route class and of its client address when it is first read (`BodyLimit.budget` names
the class; refusals are 413, 429 or 503 like the ones above), and its charge is given back
when the request's handling ends.

The limits are per path prefix (`BodyLimit`): the hosted fleet source takes pushes up to
`wfm.git.sourcehost.MAX_PUSH_BYTES`, device Git requests up to
`wfm.git.upload_gate.MAX_REQUEST_BYTES`, the push hook what GitHub may send
(`wfm.http.webhooks.MAX_BODY_BYTES`), and everything else the Margo API's
`wfm.http.request_parts.MAX_BODY`. The handlers keep their own checks as a second line.

Before any of that, uvicorn must have a complete request head, and it sets no deadline
for one: `HeadDeadline` (installed by `margo serve` as uvicorn's protocol class) closes a
connection whose request line and headers are not complete within `--header-timeout`
seconds of connecting (or of the request's first byte), and answers 400 to a head over
`MAX_HEADER_BYTES`.

Refusals are `ProblemError`s raised from `receive`, so the app's problem handler renders
them like every other error; one that escapes the app (raised under another middleware)
is rendered here, and one raised after the response started just ends the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from wfm.admission.budgets import SCOPE_KEY, BudgetRefused, Ledger, Ticket
from wfm.problems import ProblemError, problem_response

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_HEADER_TIMEOUT", "MAX_HEADER_BYTES", "BodyLimit",
           "BodyLimitMiddleware", "BodyRefused", "HeadDeadline", "head_deadline_protocol"]

#: Seconds a request body may take to arrive, once its headers did.
DEFAULT_BODY_TIMEOUT = 30.0

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class BodyLimit:
    """The largest body (bytes) and the longest time to receive it (seconds) for the paths
    starting with `prefix` ("" matches every path), and the route class whose budget its
    bodies count against (`wfm.admission.budgets.Ticket`)."""

    prefix: str
    max_bytes: int
    timeout: float = DEFAULT_BODY_TIMEOUT
    budget: str = "device"


class BodyRefused(ProblemError):
    """413 or 408 for a body over its limit or not complete in time; the connection is
    closed after the answer (the rest of the body is never read)."""

    def __init__(self, status: int, detail: str):
        super().__init__(status, detail, headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Enforce `rules` (first matching prefix wins, the last rule should be the catch-all
    "") and, with a `ledger`, the body budgets on every HTTP request; see the module
    docstring."""

    def __init__(self, app: Asgi, *, rules: Sequence[BodyLimit], ledger: Ledger | None = None):
        if not rules or rules[-1].prefix != "":
            raise ValueError("the last body limit must be the catch-all prefix ''")
        self.app, self.rules, self.ledger = app, tuple(rules), ledger

    def rule_for(self, path: str) -> BodyLimit:
        for rule in self.rules:  # (asked per request: a plain loop, no generator)
            if path.startswith(rule.prefix):
                return rule
        return self.rules[-1]

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive,
                       send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rule = self.rule_for(scope.get("path", ""))
        declared, chunked = _framing(scope.get("headers") or [])
        if declared is not None and declared > rule.max_bytes:
            await _answer(BodyRefused(413, f"request bodies here are limited to "
                                           f"{rule.max_bytes} bytes; this one declares "
                                           f"{declared}"), scope, send)
            return
        if not chunked and not declared:
            await self.app(scope, receive, send)  # no body: nothing to guard
            return
        ticket = None
        if self.ledger is not None:
            client = scope.get("client")
            ticket = Ticket(self.ledger, rule.budget, client[0] if client else "")
            scope = {**scope, SCOPE_KEY: ticket}
        guard = _Guard(rule, receive, ticket, None if chunked else declared)

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                guard.started = True
                if not guard.complete:
                    message = {**message, "headers": [
                        *[(k, v) for k, v in message.get("headers") or []
                          if k.lower() != b"connection"], (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, guard.receive, guarded_send)
        except (BodyRefused, BudgetRefused) as refusal:
            if guard.started:
                return  # the answer is under way: ending it closes the connection
            await _answer(refusal, scope, send)
        finally:
            if ticket is not None:
                ticket.release()


class _Guard:
    """One request's body: bytes so far, the deadline, whether it is complete, and its
    share of the budgets (`ticket`: charged the `declared` length at the first read, else
    each chunk as it arrives)."""

    def __init__(self, rule: BodyLimit, receive: Receive, ticket: Ticket | None = None,
                 declared: int | None = None):
        self.rule, self._receive = rule, receive
        self.ticket, self.declared = ticket, declared
        self.deadline = asyncio.get_running_loop().time() + rule.timeout
        self.size = 0
        self.complete = False
        self.refused = False
        self.started = False
        self.admitted = ticket is None

    async def receive(self) -> Message:
        if self.complete:
            return await self._receive()  # disconnect listeners wait here, unbounded
        if self.refused:
            return {"type": "http.disconnect"}
        if not self.admitted:
            self._admit()
        try:
            async with asyncio.timeout_at(self.deadline):  # no task per chunk, unlike wait_for
                message = await self._receive()
        except TimeoutError:
            self.refused = True
            raise BodyRefused(408, f"the request body did not arrive within "
                                   f"{self.rule.timeout:g} seconds") from None
        if message["type"] == "http.request":
            size = len(message.get("body", b""))
            self.size += size
            if self.size > self.rule.max_bytes:
                self.refused = True
                raise BodyRefused(413, f"request bodies here are limited to "
                                       f"{self.rule.max_bytes} bytes")
            if self.declared is None and size and self.ticket is not None:
                self._charge(size)
            self.complete = not message.get("more_body", False)
        return message

    def _admit(self) -> None:
        """Before the first byte is read: the budgets take the request, or it is refused."""
        assert self.ticket is not None
        self.admitted = True
        try:
            self.ticket.admit(self.declared)
        except BudgetRefused:
            self.refused = True
            raise

    def _charge(self, size: int) -> None:
        assert self.ticket is not None
        try:
            self.ticket.charge(size)
        except BudgetRefused:
            self.refused = True
            raise


def _framing(headers: Sequence[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """The declared Content-Length (None without one, or when it is not a number: the HTTP
    parser answers that itself) and whether the body is chunked."""
    declared, chunked = None, False
    for name, value in headers:
        name = name.lower()
        if name == b"content-length" and value.strip().isdigit():
            declared = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return declared, chunked


async def _answer(refusal: ProblemError, scope: MutableMapping[str, Any], send: Send) -> None:
    async def no_body() -> Message:
        return {"type": "http.disconnect"}

    response = problem_response(refusal, instance=scope.get("path"))
    await response(scope, no_body, send)


# --- before the app: the request head ---------------------------------------------------------

#: Seconds a connection may take to send a request's headers, from the connection or from
#: the request's first byte: uvicorn has no such limit, so a client that connects and then
#: sends nothing (or a header line now and then) held its connection for ever.
DEFAULT_HEADER_TIMEOUT = 30.0
#: The most bytes a request line and its headers may take (uvicorn's httptools protocol
#: keeps every header it is sent); past it the request is answered 400 and closed.
MAX_HEADER_BYTES = 64 * 1024


class _HeadRefused(Exception):
    """Raised from a parser callback: httptools reports it as a parse error, and uvicorn
    answers 400 and closes the connection."""


class HeadDeadline:
    """A mixin for uvicorn's httptools protocol (`head_deadline_protocol` builds the class):
    the request head must be complete within `header_timeout` seconds and
    `MAX_HEADER_BYTES`, else the connection is closed. Between requests uvicorn's own
    keep-alive timeout applies; the clock starts again with the next request's first byte."""

    header_timeout = DEFAULT_HEADER_TIMEOUT
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()
        super().on_message_begin()  # type: ignore[misc]

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)  # type: ignore[misc]

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()  # type: ignore[misc]

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEADER_BYTES:
            raise _HeadRefused(f"request head over {MAX_HEADER_BYTES} bytes")

    def _arm_head_timer(self) -> None:
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(base: type | None = None,
                           header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> type | None:
    """uvicorn's HTTP protocol class (`base`, default its auto choice) with `HeadDeadline`;
    None when that is not the httptools protocol (h11 bounds its head by size itself, and
    its callbacks differ), so uvicorn keeps its default."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    base = base or AutoHTTPProtocol
    if not issubclass(base, HttpToolsProtocol):
        return None
    return type(f"HeadDeadline{base.__name__}", (HeadDeadline, base),
                {"header_timeout": header_timeout})
