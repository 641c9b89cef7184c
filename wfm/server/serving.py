"""uvicorn as `margo serve` runs it: one change to how it stops.

uvicorn stops by closing its listening sockets, then waits for every request in flight to
be answered, and only then runs the app's lifespan shutdown. A waiting poll
(`wfm.fleet.waiters`) is a request in flight for up to a minute, so 10,000 of them would
hold the stop that long, and a SIGKILL after the orchestrator's grace period would cut them
all at once. So the server, once it stops accepting connections, answers every held
request at once (304, never a 5xx; `wfm.fleet.waiters`), and the devices come back with
jitter (`reconciler.sources.waiting`).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

__all__ = ["STARTUP_FAILURE", "serve"]

#: uvicorn's exit status when the server did not start (`uvicorn.run` exits with it too).
STARTUP_FAILURE = 3


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, release: Callable[[], None]) -> None:
        super().__init__(config)
        self._release = release

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections first (uvicorn's own shutdown does it too)
        self._release()
        await super().shutdown(sockets)


def serve(app: Any, *, release: Callable[[], None], **options: Any) -> None:
    """`uvicorn.run(app, **options)` with `release()` called as the server stops (module
    docstring)."""
    server = _Server(uvicorn.Config(app, **options), release)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
