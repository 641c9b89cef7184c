"""uvicorn as `margo serve` runs it: one change to how it stops.

uvicorn stops by closing its listening sockets, then waits for every request in flight to
be answered, and only then runs the app's lifespan shutdown. A waiting poll
(`wfm.fleet.waiters`) is a request in flight for up to a minute, so 10,000 of them would
hold the stop that long, and a SIGKILL after the orchestrator's grace period would cut them
all at once. So the server, once it stops accepting connections, answers every held
request at once (304, never a 5xx; `wfm.fleet.waiters`), and the devices come back with
jitter (`reconciler.sources.waiting`).

And one change to how it idles: uvicorn's main loop wakes ten times a second to see whether
it should stop and, every tenth time, to refresh the Date header. On an idle server those
wakes were the event loop's whole work (53.8 ms of CPU in 30 s, 330 wakes, `perf stat`), and
under 10,000 held polls each wake comes between the seconds on whose grid held polls end
(`wfm.fleet.waiters`). Here it wakes once a second, at the second (the Date header changes
then), and at once when told to stop (a signal, or `should_exit` set from another thread).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["STARTUP_FAILURE", "serve"]

#: uvicorn's exit status when the server did not start (`uvicorn.run` exits with it too).
STARTUP_FAILURE = 3
#: A second, and the couple of milliseconds a loop's timer may fire early by (uvloop's timers
#: count whole milliseconds): the Date header is refreshed in its new second.
_TO_NEXT_SECOND = 1.002


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, release: Callable[[], None]) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.Future[None] | None = None
        self._exiting = False
        super().__init__(config)
        self._release = release

    @property
    def should_exit(self) -> bool:
        return self._exiting

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set by uvicorn's signal handler, by a failed startup, or by another thread: a
        stop wakes the main loop now rather than at its next second."""
        self._exiting = value
        loop, tick = self._loop, self._tick
        if value and loop is not None and tick is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, tick)

    async def main_loop(self) -> None:
        """uvicorn's `main_loop`, woken at each second instead of each tenth (module
        docstring); `on_tick` is told every time that its second has come."""
        loop = self._loop = asyncio.get_running_loop()
        while not await self.on_tick(0):  # (0: refresh the Date header)
            tick = self._tick = loop.create_future()
            timer = loop.call_later(_TO_NEXT_SECOND - time.time() % 1.0, _resolve, tick)
            if not self._exiting:  # (set before this tick's future could be woken)
                await tick
            timer.cancel()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections first (uvicorn's own shutdown does it too)
        self._release()
        await super().shutdown(sockets)


def _resolve(tick: asyncio.Future[None]) -> None:
    if not tick.done():
        tick.set_result(None)


def serve(app: Any, *, release: Callable[[], None], **options: Any) -> None:
    """`uvicorn.run(app, **options)` with `release()` called as the server stops (module
    docstring)."""
    server = _Server(uvicorn.Config(app, **options), release)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
