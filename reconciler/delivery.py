"""Delivering the status journal to the server, in order, without losing or wedging it.

`Reporter.deliver` sends the oldest journal entries one by one:
- 2xx: delivered, removed from the journal;
- 429, 503, other 5xx or no connection: the server may take it later, so delivery stops
  (later entries must not overtake) and the entry is deferred: to the server's `Retry-After`
  (seconds or HTTP-date) when given, else the problem's `retryAfterSeconds`, else an
  exponential backoff with jitter capped at five minutes; a problem body's `backoffStrategy`
  (`none`, `fixed`, `exponential`) chooses how the delay grows;
- 401/403: a credentials problem that no retry of this entry can fix; delivery stops and the
  entry stays as it is (the runner sees `stopped == "unauthorized"`);
- any other 4xx (422: the server no longer knows the deployment): the entry is poison; it is
  dead-lettered with the problem's detail and delivery CONTINUES, so one bad entry can never
  block every later report.
A problem body's `retryable` overrides the status class when present (a 503 that says
`retryable: false` is not retried; a 409 that says `retryable: true` is).

Our own backoff guesses when the server will be back; once another request has been
answered (a poll, a capability report), it is back, and `Reporter.resume` makes deferred
entries due at once with their backoff started over. Otherwise reports queued during an
outage would wait out a delay that grew while the server was away (up to five minutes)
after it returned. A delay the server asked for (Retry-After, `retryAfterSeconds`) is a
request, not a guess: it is kept (in the state's keys and values, so across restarts).

`send_json` is the same classification for one request (capabilities use it). Nothing here
raises httpx errors: every outcome is a value.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from reconciler.http_answers import MAX_RETRY_AFTER_SECONDS, parse_retry_after, problem_of
from reconciler.state import DeviceState, JournalEntry

__all__ = ["MAX_BACKOFF_SECONDS", "DeliveryResult", "Outcome", "Reporter", "backoff_delay",
           "classify", "send_json"]

MAX_BACKOFF_SECONDS = 300.0
BASE_BACKOFF_SECONDS = 1.0
#: The state key holding when the server's own requested delay ends (wall clock).
_SERVER_DELAY_KEY = "delivery.server-delay-until"

DELIVERED, RETRY, REJECTED, UNAUTHORIZED, UNCHANGED = (
    "delivered", "retry", "rejected", "unauthorized", "unchanged")


@dataclass(frozen=True)
class Outcome:
    """What became of one request.

    `kind`: `delivered` (2xx), `retry` (try again later), `rejected` (the server refused this
    request for good), `unauthorized` (401/403), or `unchanged` (nothing was sent because
    nothing changed; capabilities only). `retry_after` is the server's explicit delay in
    seconds (header or problem body), `backoff` the problem's `backoffStrategy`."""

    kind: str
    status: int | None = None
    detail: str = ""
    retry_after: float | None = None
    backoff: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind in (DELIVERED, UNCHANGED)

    @property
    def sent(self) -> bool:
        return self.kind != UNCHANGED


@dataclass(frozen=True)
class DeliveryResult:
    """One `deliver` call. `stopped`: `empty` (journal drained), `waiting` (the next entry
    is deferred until `next_attempt`), `retry` (the server asked to retry later), `unauthorized`,
    or `budget` (time ran out with entries left)."""

    delivered: int
    dead_lettered: int
    remaining: int
    stopped: str
    next_attempt: float | None = None
    last: Outcome | None = None


def _describe(response: httpx.Response, problem: Mapping[str, Any]) -> str:
    for key in ("detail", "title"):
        value = problem.get(key)
        if isinstance(value, str) and value:
            return f"HTTP {response.status_code}: {value}"
    text = response.text.strip()[:200] if response.content else ""
    return f"HTTP {response.status_code}" + (f": {text}" if text else "")


def classify(response: httpx.Response, *, now: float) -> Outcome:
    """Classify a response (see the module docstring for the rules)."""
    status = response.status_code
    problem = problem_of(response)
    detail = _describe(response, problem)
    retry_after = parse_retry_after(response.headers.get("retry-after"), now)
    advisory = problem.get("retryAfterSeconds")
    if retry_after is None and isinstance(advisory, int | float) and not isinstance(
            advisory, bool) and math.isfinite(advisory):
        retry_after = min(max(float(advisory), 0.0), MAX_RETRY_AFTER_SECONDS)
    strategy = problem.get("backoffStrategy")
    backoff = strategy if strategy in ("none", "fixed", "exponential") else None
    if 200 <= status < 300:
        return Outcome(DELIVERED, status, detail)
    if status in (401, 403):
        return Outcome(UNAUTHORIZED, status, detail)
    retryable = problem.get("retryable")
    if not isinstance(retryable, bool):
        retryable = status in (408, 425, 429) or status >= 500
    kind = RETRY if retryable else REJECTED
    return Outcome(kind, status, detail, retry_after, backoff)


def send_json(client: httpx.Client, method: str, path: str, body: bytes | Mapping[str, Any], *,
              now: float | None = None) -> Outcome:
    """Send one JSON request and classify the answer; transport errors become `retry`."""
    data = body if isinstance(body, bytes) else json.dumps(
        body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    try:
        response = client.request(method, path, content=data,
                                  headers={"Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        return Outcome(RETRY, None, f"{type(exc).__name__}: {exc}", None, "exponential")
    return classify(response, now=time.time() if now is None else now)


def backoff_delay(outcome: Outcome, attempts: int, rng: random.Random) -> float:
    """Seconds to wait before retrying an entry that has now failed `attempts` times.

    An explicit delay from the server wins. Otherwise `exponential` (the default) doubles
    from one second per attempt up to five minutes, with "equal jitter" (half fixed, half
    random) so that a fleet that lost the server together does not return together; `fixed`
    keeps the base delay; `none` retries at the next delivery round."""
    if outcome.retry_after is not None:
        return outcome.retry_after
    if outcome.backoff == "none":
        return 0.0
    if outcome.backoff == "fixed":
        ceiling = BASE_BACKOFF_SECONDS * 5
    else:
        ceiling = min(MAX_BACKOFF_SECONDS, BASE_BACKOFF_SECONDS * 2 ** min(attempts - 1, 30))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


class Reporter:
    """Drains the journal of a `DeviceState` to the server, strictly in order."""

    def __init__(self, client: httpx.Client, state: DeviceState, *,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 batch: int = 32) -> None:
        self.client = client
        self.state = state
        self.clock = clock
        self.rng = rng or random.Random()
        self.batch = batch

    def deliver(self, budget_seconds: float = 5.0) -> DeliveryResult:
        """Send entries until the journal is empty, an entry must wait, the server asks for
        a pause, credentials fail, or `budget_seconds` (monotonic) are spent."""
        deadline = time.monotonic() + budget_seconds
        delivered = dead = 0
        last: Outcome | None = None
        while True:
            entries = self.state.pending(self.batch)
            if not entries:
                return DeliveryResult(delivered, dead, 0, "empty", None, last)
            for entry in entries:
                if time.monotonic() >= deadline:
                    return self._result(delivered, dead, "budget", None, last)
                now = self.clock()
                if entry.not_before > now:
                    return self._result(delivered, dead, "waiting", entry.not_before, last)
                last = send_json(self.client, entry.method, entry.path, entry.body, now=now)
                if last.kind == DELIVERED:
                    self.state.delivered(entry.seq)
                    delivered += 1
                elif last.kind == REJECTED:
                    self.state.dead_letter(entry.seq, last.detail)
                    dead += 1
                elif last.kind == UNAUTHORIZED:
                    return self._result(delivered, dead, "unauthorized", None, last)
                else:
                    retry_at = self._defer(entry, last, now)
                    return self._result(delivered, dead, "retry", retry_at, last)

    def resume(self) -> int:
        """The server answered another request: entries waiting out our own backoff are due
        now and their backoff starts over (see the module docstring); a delay the server
        asked for still holds until it ends. Returns how many entries were made due."""
        requested = self.state.get(_SERVER_DELAY_KEY)
        held_until = float(requested) if requested else 0.0
        due = held_until if held_until > self.clock() else 0.0
        return self.state.resume_deferred(due)

    def _defer(self, entry: JournalEntry, outcome: Outcome, now: float) -> float:
        attempts = entry.attempts + 1
        retry_at = now + backoff_delay(outcome, attempts, self.rng)
        if outcome.retry_after is not None:
            self.state.set(_SERVER_DELAY_KEY, repr(retry_at))
        self.state.deferred(entry.seq, retry_at, attempts)
        return retry_at

    def _result(self, delivered: int, dead: int, stopped: str, next_attempt: float | None,
                last: Outcome | None) -> DeliveryResult:
        return DeliveryResult(delivered, dead, self.state.journal_size(), stopped,
                              next_attempt, last)
