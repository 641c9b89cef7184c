"""Waiting polls, the device's side: a conditional poll that asks the server to hold it until
the desired state changes (RFC 7240 `Prefer: wait=N`), and when the next cycle comes.

Both sources use it for their conditional poll: the REST manifest (`If-None-Match` with the
adopted ETag) and the Git ref advertisement (`reconciler.sources.git_refs`). A server that
knows the extension (docs/server.md, "Waiting polls") answers when the state changes, or
after N seconds, saying `Preference-Applied: wait=N`; one that does not answers at once, as
it always did, and the device polls on its interval as it always did.

N is the configured `schedule.wait`, cut to what is left of the current interval (and of the
contact window): the interval stays the most time between two cycles, so drift checks,
retries and capability reports keep their pace, and a change arrives within a second
instead of at the next cycle. Only the loop of `margo device run` waits (`active`); one
cycle (`margo device once`, the tests' cycles) never does.

When the next cycle comes (`next_delay`):

* at once after a held answer (the wait was the pause between cycles), after a new state
  was adopted (the next poll waits for the change after it), and after an answer whose
  validator moved although nothing was adopted (the state had reached the device another
  way, a Git fetch that found a newer tip than the advertisement): the next poll names the
  new validator and can be held. Not more than `QUICK` times in a row without a held
  answer: a server that makes up validators cannot make the client poll every second;
* after a random delay, growing with each failure, when a waiting poll got no answer (cut
  by a proxy or a restart, timed out, refused, a 502/503/504), or when a server that held
  polls before answered one without holding it (it sheds load): devices cut off together
  come back spread out, not as one herd. The delay is uniform in [0, w], w = 2^(k-1) s for
  the k-th failure in a row ("full jitter"); once w reaches the interval, in [interval/2,
  interval], so a long outage costs no more than about a poll per interval. A server that
  stops answers its held polls at once, as held: the next poll goes out at once, finds the
  port closed (or, behind a balancer, another replica) and backs off from there;
* otherwise on the schedule, as without waiting polls.

A held request runs in a thread of its own, so SIGTERM stops the client at once rather than
after the wait (`run`).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TypeVar

import httpx

__all__ = ["BACKOFF_FIRST", "MIN_CYCLE", "QUICK", "Interrupted", "WaitingPolls",
           "applied_wait"]

log = logging.getLogger("margo.device")

T = TypeVar("T")
#: The first back-off window (seconds) after waiting polls stopped being held; doubled per
#: failure in a row, up to the polling interval.
BACKOFF_FIRST = 1.0
#: The shortest time between the starts of two cycles that follow each other at once.
MIN_CYCLE = 1.0
#: Answers with a new validator but nothing adopted followed at once, in a row.
QUICK = 3
#: How often a held request's caller looks whether the client is stopping (seconds).
_STOP_CHECK = 0.5


class Interrupted(Exception):
    """The client is stopping: the held request was abandoned (nothing changed)."""


def applied_wait(headers: httpx.Headers) -> int | None:
    """The wait a server says it applied (`Preference-Applied: wait=N`), None without one.
    Tolerant: a malformed value is no value."""
    for value in headers.get_list("preference-applied"):
        for preference in value.split(","):
            name, _, argument = preference.split(";", 1)[0].partition("=")
            digits = argument.strip().strip('"')
            if name.strip().lower() == "wait" and digits.isascii() and digits.isdigit():
                return int(digits[:9])
    return None


class WaitingPolls:
    """One device's waiting polls (module docstring); shared by its source and its loop."""

    def __init__(self, seconds: float, *, jitter: Callable[[float, float], float] =
                 random.uniform) -> None:
        self.seconds = max(0.0, seconds)
        #: Set by the loop of `margo device run` for its lifetime; never for one cycle.
        self.active = False
        #: The loop's stop event (`Reconciler.stopping`): a held request is abandoned then.
        self.stopping: threading.Event | None = None
        self._jitter = jitter
        self._allowed = 0
        self._outcome: str | None = None  # this cycle's: held | plain | cut
        self._supported = False  # the server held a poll before
        self._failures = 0
        self._quick = 0  # answers with a new validator followed at once, since a held one

    # --- before the poll (the loop, then the source) -------------------------------------

    def allow(self, seconds: float) -> None:
        """The most this cycle's poll may wait: what is left of the interval and of the
        contact window (the loop says, before each cycle)."""
        self._allowed = int(min(self.seconds, max(0.0, seconds))) if self.active else 0
        self._outcome = None

    def wait(self) -> int:
        """Whole seconds this cycle's conditional poll asks to be held (0: none)."""
        return self._allowed

    def headers(self) -> dict[str, str]:
        wait = self.wait()
        return {"Prefer": f"wait={wait}"} if wait else {}

    def timeout(self, base: httpx.Timeout) -> httpx.Timeout:
        """`base` with the wait added to its read timeout (the server answers late by
        design)."""
        read = (base.read or 0.0) + self.wait()
        return httpx.Timeout(connect=base.connect, read=read, write=base.write,
                             pool=base.pool)

    # --- after the poll (the source) -----------------------------------------------------

    def answered(self, headers: httpx.Headers, *, moved: bool = False) -> None:
        """The waiting poll was answered (200 or 304); `moved`: with another validator than
        the one it named."""
        if applied_wait(headers) is not None:
            self._outcome, self._supported, self._failures, self._quick = "held", True, 0, 0
        else:
            self._outcome = "moved" if moved else "plain"

    def cut(self) -> None:
        """The waiting poll got no answer (cut, timed out, refused, or a 5xx)."""
        self._outcome = "cut"

    def run(self, request: Callable[[], T]) -> T:
        """`request()` (a waiting poll), abandoned with `Interrupted` when the client
        stops meanwhile: it runs in a daemon thread, the caller watches `stopping`."""
        stopping = self.stopping
        if stopping is None or not self.wait():
            return request()
        done = threading.Event()
        result: list[T] = []
        failure: list[BaseException] = []

        def call() -> None:
            try:
                result.append(request())
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)
            finally:
                done.set()

        threading.Thread(target=call, name="margo-waiting-poll", daemon=True).start()
        while not done.wait(_STOP_CHECK):
            if stopping.is_set():
                raise Interrupted
        if failure:
            raise failure[0]
        return result[0]

    # --- the next cycle (the loop) ---------------------------------------------------------

    def next_delay(self, scheduled: float, interval: float, *, adopted: bool,
                   elapsed: float) -> float:
        """Seconds until the next cycle (module docstring); `scheduled`: what the schedule
        says, `adopted`: the cycle adopted a new state, `elapsed`: the cycle's length. At
        once means at least `MIN_CYCLE` after the last cycle began: a server that answers
        "held" without holding cannot make the client spin."""
        outcome, self._outcome = self._outcome, None
        if not self.active or not self.seconds:
            return scheduled
        if outcome == "moved" and self._quick < QUICK:
            self._quick += 1
            adopted = True
        if outcome == "held" or adopted:
            return min(scheduled, max(0.0, MIN_CYCLE - elapsed))
        if outcome is None or (outcome in ("plain", "moved") and not self._supported):
            return scheduled
        self._failures += 1
        window = BACKOFF_FIRST * 2 ** min(self._failures - 1, 30)
        delay = self._jitter(0.0, window) if window < interval else \
            self._jitter(interval / 2, interval)
        if self._failures == 1:
            log.info("the server stopped holding polls (%s); polling again in %.1f s",
                     "no answer" if outcome == "cut" else "a plain answer", delay)
        return delay
