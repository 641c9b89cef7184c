"""A held waiting poll learns of its client's disconnect from its connection
(`wfm.server.closing`, what `margo serve` gives every request) or, served without one, from
its ASGI receive (`wfm.fleet.waiters`); either way its place is freed at once, and a
connection that closes later calls back nobody that stopped waiting.

The server-level test (a real `margo serve`, a socket closed while its poll is held) is
tests/wfm/test_waiting_polls_server.py; these drive `Waiters` directly on an event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from wfm.fleet.waiters import Outcome, Waiters
from wfm.server.closing import ConnectionClosing, closing_protocol


async def _unchanged() -> tuple[bool, frozenset[str]]:
    return False, frozenset({"client:c"})


class _Receive:
    """An ASGI receive: the GET's one empty body message, then nothing until `disconnect`."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def _hold(waiters: Waiters, receive: _Receive, closing: ConnectionClosing | None,
                seconds: float = 30) -> Outcome:
    return await waiters.hold(frozenset({"client:c"}), seconds, since=waiters.mark(),
                              receive=receive, check=_unchanged, closing=closing)


def test_the_connection_tells_a_held_poll_its_client_left() -> None:
    async def scenario() -> tuple[Outcome, int, int]:
        waiters, receive, closing = Waiters(), _Receive(), ConnectionClosing()
        held = asyncio.ensure_future(_hold(waiters, receive, closing))
        await asyncio.sleep(0.05)
        assert len(waiters) == 1
        closing.close()
        outcome = await asyncio.wait_for(held, 5)
        return outcome, len(waiters), receive.calls

    outcome, left, reads = asyncio.run(scenario())
    assert (outcome, left) == (Outcome.GONE, 0)
    assert reads == 0  # nothing read the request's receive meanwhile


def test_without_a_connection_the_receive_tells_it() -> None:
    async def scenario() -> tuple[Outcome, int]:
        waiters, receive = Waiters(), _Receive()
        held = asyncio.ensure_future(_hold(waiters, receive, None))
        await asyncio.sleep(0.05)
        receive.gone.set()
        return await asyncio.wait_for(held, 5), len(waiters)

    assert asyncio.run(scenario()) == (Outcome.GONE, 0)


def test_a_poll_that_ended_is_not_called_back_when_its_connection_closes() -> None:
    async def scenario() -> tuple[Outcome, Outcome]:
        waiters, closing = Waiters(), ConnectionClosing()
        first = await _hold(waiters, _Receive(), closing, seconds=0.05)
        second = asyncio.ensure_future(_hold(waiters, _Receive(), closing))  # kept alive
        await asyncio.sleep(0.05)
        closing.close()
        return first, await asyncio.wait_for(second, 5)

    assert asyncio.run(scenario()) == (Outcome.TIMEOUT, Outcome.GONE)


def test_a_closed_connection_calls_back_at_once() -> None:
    closing, calls = ConnectionClosing(), []
    closing.close()
    closing.add(lambda: calls.append("late"))
    assert calls == ["late"]


def test_only_uvicorns_httptools_protocol_gets_the_notice() -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert issubclass(closing_protocol(HttpToolsProtocol), HttpToolsProtocol)
    try:
        closing_protocol(H11Protocol)
    except TypeError as exc:
        assert "httptools" in str(exc)
    else:
        raise AssertionError("h11's protocol has other callbacks: refused")
