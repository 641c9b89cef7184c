"""Waiting polls, the device's decisions (`reconciler.sources.waiting`): how long a poll asks
to be held, when the next cycle comes after each kind of answer, what a server's
`Preference-Applied` says, and what a ref advertisement names. Pure functions and one
object's state; the end-to-end behaviour is tests/reconciler/test_waiting_polls.py's."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import httpx
import pytest

from reconciler.schedule import Schedule, parse_window
from reconciler.sources.git_refs import Unusable, head_of
from reconciler.sources.waiting import WaitingPolls, applied_wait

TIP = "0123456789abcdef0123456789abcdef01234567"


def pkt(text: bytes) -> bytes:
    return f"{len(text) + 4:04x}".encode() + text


def lowest(low: float, high: float) -> float:
    """A jitter that always picks the low end (and records nothing else)."""
    return low


def highest(low: float, high: float) -> float:
    return high


def polls(seconds: float = 60,
          jitter: Callable[[float, float], float] = highest) -> WaitingPolls:
    """Waiting polls as the loop of `margo device run` has them."""
    waiting = WaitingPolls(seconds, jitter=jitter)
    waiting.active = True
    return waiting


@pytest.mark.parametrize(("values", "expected"), [
    (["wait=5"], 5),
    (["wait=5, respond-async"], 5),
    (["respond-async;x=1, WAIT = 7 ;y"], 7),
    (['wait="9"'], 9),
    (["wait=5", "wait=6"], 5),  # the first counts
    (["wait=soon"], None),
    (["wait=1.5"], None),
    (["wait=-1"], None),
    (["wait"], None),
    (["handling=lenient"], None),
    ([], None),
])
def test_what_the_server_says_it_applied(values: list[str], expected: int | None) -> None:
    headers = httpx.Headers([("Preference-Applied", v) for v in values])
    assert applied_wait(headers) == expected


def test_a_poll_asks_for_at_most_what_is_left_and_only_in_the_loop() -> None:
    waiting = WaitingPolls(60)
    waiting.allow(30)
    assert (waiting.wait(), waiting.headers()) == (0, {})  # one cycle never waits
    waiting.active = True
    waiting.allow(30.9)
    assert (waiting.wait(), waiting.headers()) == (30, {"Prefer": "wait=30"})
    waiting.allow(600)
    assert waiting.wait() == 60
    waiting.allow(0.5)
    assert waiting.headers() == {}
    timeout = WaitingPolls(60)
    timeout.active = True
    timeout.allow(45)
    assert timeout.timeout(httpx.Timeout(5.0)).read == 50.0


def test_after_a_held_answer_or_a_new_state_the_next_cycle_comes_at_once() -> None:
    waiting = polls()
    waiting.allow(30)
    waiting.answered(httpx.Headers({"Preference-Applied": "wait=30"}))
    assert waiting.next_delay(0.0, 30, adopted=False, elapsed=30) == 0.0
    waiting.allow(30)  # (nothing asked: an unconditional poll that adopted a state)
    assert waiting.next_delay(29.0, 30, adopted=True, elapsed=0.2) == pytest.approx(0.8)


def test_a_moved_validator_is_polled_again_at_once_but_not_forever() -> None:
    """The state reached the device another way (a Git fetch found a newer tip than the
    advertisement): the next poll names the new validator and can be held. A server that
    makes up validators gets `QUICK` such polls, then the schedule."""
    waiting = polls()
    delays = []
    for _ in range(5):
        waiting.allow(30)
        waiting.answered(httpx.Headers(), moved=True)
        delays.append(waiting.next_delay(29.0, 30, adopted=False, elapsed=2))
    assert delays == [0.0, 0.0, 0.0, 29.0, 29.0]
    waiting.allow(30)
    waiting.answered(httpx.Headers({"Preference-Applied": "wait=30"}))  # held: counted anew
    waiting.next_delay(0.0, 30, adopted=False, elapsed=30)
    waiting.allow(30)
    waiting.answered(httpx.Headers(), moved=True)
    assert waiting.next_delay(29.0, 30, adopted=False, elapsed=2) == 0.0


def test_a_server_that_never_held_a_poll_is_polled_on_the_schedule() -> None:
    waiting = polls()
    waiting.allow(30)
    waiting.answered(httpx.Headers())  # a plain 304: this server does not hold polls
    assert waiting.next_delay(29.0, 30, adopted=False, elapsed=1) == 29.0


def test_polls_that_stop_being_held_come_back_with_growing_jitter() -> None:
    waiting = polls(jitter=highest)
    waiting.allow(30)
    waiting.answered(httpx.Headers({"Preference-Applied": "wait=30"}))
    waiting.next_delay(0.0, 30, adopted=False, elapsed=30)
    windows = []
    for outcome in ("cut", "plain", "cut", "cut", "cut", "cut", "cut"):
        waiting.allow(30)
        if outcome == "cut":
            waiting.cut()
        else:
            waiting.answered(httpx.Headers())
        windows.append(waiting.next_delay(25.0, 30, adopted=False, elapsed=5))
    assert windows == [1, 2, 4, 8, 16, 30, 30]
    low = polls(jitter=lowest)
    for _ in range(6):
        low.allow(30)
        low.cut()
        last = low.next_delay(25.0, 30, adopted=False, elapsed=5)
    assert last == 15.0  # past the interval: in [interval/2, interval]
    low.allow(30)
    low.answered(httpx.Headers({"Preference-Applied": "wait=30"}))  # held again: reset
    low.next_delay(0.0, 30, adopted=False, elapsed=30)
    low.allow(30)
    low.cut()
    assert low.next_delay(25.0, 30, adopted=False, elapsed=5) == 0.0


def test_a_cycle_without_a_waiting_poll_keeps_the_schedule() -> None:
    waiting = polls()
    waiting.allow(30)
    assert waiting.next_delay(12.0, 30, adopted=False, elapsed=1) == 12.0
    off = WaitingPolls(60)  # not in the loop (margo device once)
    off.cut()
    assert off.next_delay(12.0, 30, adopted=True, elapsed=1) == 12.0


def test_a_held_poll_stops_before_downtime_and_outside_its_window() -> None:
    schedule = Schedule(downtime=(parse_window("10:00-11:00", one_off=True),))
    assert schedule.open_for(datetime(2026, 1, 5, 9, 59, 30, tzinfo=UTC), 60) == 30.0
    assert schedule.open_for(datetime(2026, 1, 5, 9, 0, 0, tzinfo=UTC), 60) == 60
    assert schedule.open_for(datetime(2026, 1, 5, 10, 30, tzinfo=UTC), 60) == 0.0
    windows = Schedule(polling=(parse_window("06:00-22:00"),))
    assert windows.open_for(datetime(2026, 1, 5, 21, 59, 10, tzinfo=UTC), 60) == 50.0


def test_the_advertised_tip_is_what_head_names() -> None:
    body = (pkt(b"# service=git-upload-pack\n") + b"0000"
            + pkt(TIP.encode() + b" HEAD\0multi_ack symref=HEAD:refs/heads/x\n")
            + pkt(TIP.encode() + b" refs/heads/x\n") + b"0000")
    assert head_of(body) == TIP
    empty = (pkt(b"# service=git-upload-pack\n") + b"0000"
             + pkt(b"0" * 40 + b" capabilities^{}\0multi_ack\n") + b"0000")
    assert head_of(empty) is None
    for broken in (b"<html>", pkt(b"# service=git-upload-pack\n")[:-3],
                   pkt(b"nothex HEAD\n"), b"0002"):
        with pytest.raises(Unusable):
            head_of(broken)
