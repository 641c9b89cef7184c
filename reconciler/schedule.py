"""When the device client may talk to its fleet manager.

The Margo management-interface requirements ask for three user settings: the polling
*rate* (how often), the polling *period* (the hours of the day in which the client checks)
and *downtime* (known periods of no connectivity: no checks, no retries, and communication
errors ignored). A schedule answers two questions for the runner: may I contact the
server now, and when should I next wake up.

Windows are written the way operators say them:

* daily: `"06:00-22:00"` (wrapping past midnight is allowed: `"22:00-06:00"`);
* on given weekdays: `"Sat,Sun 00:00-24:00"`, `"Mon-Fri 08:00-18:00"`;
* one-off (downtime only): `"2026-12-24T00:00:00Z/2026-12-27T06:00:00Z"` (ISO 8601 interval).

Recurring windows are read in the schedule's time zone (IANA name, default UTC), so a plant
that stops every Sunday at 02:00 local time says exactly that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

__all__ = ["DAYS", "OneOffWindow", "RecurringWindow", "Schedule", "now_utc", "parse_window"]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_RECURRING = re.compile(
    r"^(?:(?P<days>[A-Za-z]{3}(?:\s*[-,]\s*[A-Za-z]{3})*)\s+)?"
    r"(?P<start>\d{1,2}:\d{2})\s*-\s*(?P<end>\d{1,2}:\d{2})$")


def _clock(text: str) -> int:
    """`HH:MM` in minutes after midnight; `24:00` is allowed as an end."""
    hours, minutes = (int(part) for part in text.split(":"))
    if minutes > 59 or hours > 24 or (hours == 24 and minutes):
        raise ValueError(f"{text!r} is not a time of day (00:00 to 24:00)")
    return hours * 60 + minutes


def _days(text: str | None) -> frozenset[int]:
    if not text:
        return frozenset(range(7))
    chosen: set[int] = set()
    for part in re.split(r"\s*,\s*", text.lower()):
        first, _, last = (p.strip() for p in part.partition("-"))
        for name in (first, last or first):
            if name not in DAYS:
                raise ValueError(f"unknown weekday {name!r} (use {', '.join(DAYS)})")
        start, end = DAYS.index(first), DAYS.index(last or first)
        index = start
        while True:
            chosen.add(index)
            if index == end:
                break
            index = (index + 1) % 7
    return frozenset(chosen)


@dataclass(frozen=True)
class RecurringWindow:
    """Minutes `[start, end)` of the day on the given weekdays (0 = Monday). A window
    with end <= start wraps past midnight and belongs to the day it starts on."""

    text: str
    days: frozenset[int]
    start: int
    end: int

    def contains(self, local: datetime) -> bool:
        minute = local.hour * 60 + local.minute
        if self.start < self.end:
            return local.weekday() in self.days and self.start <= minute < self.end
        started_today = local.weekday() in self.days and minute >= self.start
        started_yesterday = (local.weekday() - 1) % 7 in self.days and minute < self.end
        return started_today or started_yesterday


@dataclass(frozen=True)
class OneOffWindow:
    text: str
    start: datetime
    end: datetime

    def contains(self, local: datetime) -> bool:
        return self.start <= local < self.end


Window = RecurringWindow | OneOffWindow


def _instant(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError(f"{text!r} needs a UTC offset (e.g. 'Z' or '+01:00')")
    return value


def parse_window(text: str, *, one_off: bool = False) -> Window:
    """Parse one window; `ValueError` says what is wrong and what is accepted."""
    text = text.strip()
    if "/" in text:
        if not one_off:
            raise ValueError(f"{text!r}: one-off intervals are only allowed for downtime")
        first, _, second = text.partition("/")
        start, end = _instant(first), _instant(second)
        if end <= start:
            raise ValueError(f"{text!r}: the interval ends before it starts")
        return OneOffWindow(text, start, end)
    match = _RECURRING.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a window: use 'HH:MM-HH:MM', 'Mon-Fri HH:MM-HH:MM'"
                         + (" or an ISO interval 'START/END'" if one_off else ""))
    opens, closes = _clock(match["start"]), _clock(match["end"])
    if opens == closes:
        raise ValueError(f"{text!r} is empty (start equals end)")
    return RecurringWindow(text, _days(match["days"]), opens, closes)


@dataclass(frozen=True)
class Schedule:
    """Polling rate, polling windows (empty: always) and downtime windows."""

    interval: float = 30.0
    polling: tuple[RecurringWindow, ...] = ()
    downtime: tuple[Window, ...] = ()
    timezone: str = "UTC"
    #: Seconds between re-assertions of every deployment's true state (0: never), so a
    #: status report that was lost, or one somebody forged, does not stand for long.
    resync: float = 600.0
    #: The most seconds a poll asks the server to hold it until the desired state changes
    #: (RFC 7240 `Prefer: wait`; 0: plain polls): `reconciler.sources.waiting`.
    wait: float = 60.0

    def _local(self, when: datetime) -> datetime:
        return when.astimezone(ZoneInfo(self.timezone))

    def in_downtime(self, when: datetime) -> bool:
        local = self._local(when)
        return any(w.contains(local) for w in self.downtime)

    def in_polling_window(self, when: datetime) -> bool:
        local = self._local(when)
        return not self.polling or any(w.contains(local) for w in self.polling)

    def may_contact(self, when: datetime) -> bool:
        """True inside a polling window and outside downtime."""
        return self.in_polling_window(when) and not self.in_downtime(when)

    def open_for(self, when: datetime, horizon: float) -> float:
        """Seconds from `when` (at most `horizon`) during which contact stays allowed: a
        held poll must not run into downtime or past its polling window. Windows have
        minute resolution, so the minutes ahead are probed."""
        if not self.may_contact(when):
            return 0.0
        probe = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
        end = when + timedelta(seconds=horizon)
        while probe < end:
            if not self.may_contact(probe):
                return (probe - when).total_seconds()
            probe += timedelta(minutes=1)
        return horizon

    def next_check(self, after: datetime) -> datetime:
        """The first allowed moment at least one interval after `after`. Searched minute by
        minute for up to two weeks (windows have minute resolution); a schedule that never
        allows contact returns `after + interval` and the runner simply sleeps again."""
        candidate = after + timedelta(seconds=self.interval)
        if self.may_contact(candidate):
            return candidate
        probe = candidate.replace(second=0, microsecond=0) + timedelta(minutes=1)
        for _ in range(14 * 24 * 60):
            if self.may_contact(probe):
                return probe
            probe += timedelta(minutes=1)
        return candidate


def now_utc() -> datetime:
    return datetime.now(UTC)


