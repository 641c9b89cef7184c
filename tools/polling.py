"""Waiting for something to become true, the one way tests, benchmarks and the demo do it:
poll with a deadline, never sleep a fixed time.

`poll_until(what, predicate)` calls `predicate` until it returns something truthy and
returns that; after `timeout` seconds it raises `TimeoutError` naming `what` (and, with
`describe`, what the last poll saw). `each` runs before every poll, for loops that must keep
something moving while they wait (a device client's cycles). Exceptions listed in `not_yet`
count as "not yet" (a server still starting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["poll_until"]

T = TypeVar("T")


def poll_until(what: str, predicate: Callable[[], T], *, timeout: float = 30.0,
               interval: float = 0.1, each: Callable[[], Any] | None = None,
               not_yet: tuple[type[BaseException], ...] = (),
               describe: Callable[[], str] | None = None) -> T:
    deadline = time.monotonic() + timeout
    while True:
        if each is not None:
            each()
        try:
            value = predicate()
        except not_yet:
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"; {describe()}" if describe is not None else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(interval)
