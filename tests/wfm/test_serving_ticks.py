"""`margo serve`'s uvicorn wakes once a second when idle, not ten times (wfm.server.serving).

A real uvicorn on loopback in a thread, serving a minimal ASGI app: its main loop's ticks
are counted while nothing happens, its Date header read, and it is stopped from another
thread as the test kits stop theirs.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from tools.polling import poll_until
from wfm.server.serving import _Server


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


class _CountingServer(_Server):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


@contextlib.contextmanager
def _running() -> Iterator[tuple[_CountingServer, int, threading.Thread]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = _CountingServer(uvicorn.Config(_hello, lifespan="off", log_level="warning",
                                            access_log=False), release=lambda: None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        poll_until("uvicorn to start", lambda: server.started or not thread.is_alive(),
                   timeout=10, interval=0.01)
        assert server.started
        yield server, sock.getsockname()[1], thread
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _date(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/")
    answer = conn.getresponse()
    answer.read()
    conn.close()
    return email.utils.parsedate_to_datetime(answer.headers["Date"]).timestamp()


def test_an_idle_server_ticks_once_a_second_and_dates_its_answers_in_the_current_second(
) -> None:
    with _running() as (server, port, _):
        first, before = server.ticks, time.time()
        time.sleep(2.5)
        ticks = server.ticks - first
        # uvicorn's own loop would have ticked about 25 times.
        assert 1 <= ticks <= 4, ticks
        dated, now = _date(port), time.time()
        assert int(now) - 1 <= dated <= now, (dated, now, before)


def test_a_stop_set_from_another_thread_ends_the_main_loop() -> None:
    with _running() as (server, _, thread):
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert server.should_exit
