"""What a wake of many devices costs the event loop is bounded by the requests held, not by
the devices changed (`Waiters._wake_devices`): nothing held, nothing is looked up, yet a
request about to be held still learns of the change; far more devices changed than
requests held, every held request checks its answer again, and one whose answer is
unchanged goes on waiting; a small change wakes only the requests held for its devices.
Driven on an event loop, as tests/wfm/test_held_disconnects.py does."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from wfm.fleet.waiters import Outcome, Waiters, _on_grid, device_key


class _Checks:
    """A request's `check`: counts its calls; the answer changes from call `changes_at`."""

    def __init__(self, key: str, changes_at: int = 10**9) -> None:
        self.key, self.changes_at, self.calls = key, changes_at, 0

    async def __call__(self) -> tuple[bool, frozenset[str]]:
        self.calls += 1
        return self.calls >= self.changes_at, frozenset({self.key})


async def _receive() -> dict[str, Any]:
    await asyncio.Event().wait()  # never disconnects
    raise AssertionError


def _held(waiters: Waiters, device: str, check: _Checks, since: int,
          seconds: float = 30) -> asyncio.Future[Outcome]:
    return asyncio.ensure_future(waiters.hold(frozenset({device_key(device)}), seconds,
                                              since=since, receive=_receive, check=check))


def test_with_nothing_held_a_request_about_to_be_held_still_learns_of_the_change() -> None:
    async def scenario() -> tuple[Outcome, int]:
        waiters = Waiters()
        since = waiters.mark()
        waiters._wake_devices(frozenset(f"d{i}" for i in range(10_000)))
        check = _Checks("device:d1", changes_at=1)
        outcome = await asyncio.wait_for(_held(waiters, "d1", check, since), 5)
        return outcome, check.calls

    assert asyncio.run(scenario()) == (Outcome.CHANGED, 1)


def test_a_change_far_larger_than_what_is_held_has_every_held_request_check_again() -> None:
    async def scenario() -> tuple[int, int, bool, Outcome]:
        waiters = Waiters()
        unchanged, changed = _Checks("device:a"), _Checks("device:b", changes_at=1)
        first = _held(waiters, "a", unchanged, waiters.mark())
        second = _held(waiters, "b", changed, waiters.mark())
        await asyncio.sleep(0.05)
        waiters._wake_devices(frozenset(f"other-{i}" for i in range(1_000)))  # a, b not in it
        outcome = await asyncio.wait_for(second, 5)
        await asyncio.sleep(0.05)
        still_waiting = not first.done()
        first.cancel()
        return unchanged.calls, changed.calls, still_waiting, outcome

    assert asyncio.run(scenario()) == (1, 1, True, Outcome.CHANGED)


def test_a_small_change_wakes_only_the_requests_held_for_its_devices() -> None:
    async def scenario() -> tuple[int, int]:
        waiters = Waiters()
        others = [_Checks(f"device:a{i}") for i in range(3)]
        held = [_held(waiters, f"a{i}", check, waiters.mark()) for i, check in enumerate(others)]
        target = _Checks("device:b")
        held.append(_held(waiters, "b", target, waiters.mark()))
        await asyncio.sleep(0.05)
        waiters._wake_devices(frozenset({"b", "c"}))
        await asyncio.sleep(0.05)
        for future in held:
            future.cancel()
        return sum(check.calls for check in others), target.calls

    assert asyncio.run(scenario()) == (0, 1)


@given(now=st.floats(min_value=0, max_value=1e7, allow_nan=False),
       seconds=st.integers(min_value=1, max_value=3600))  # waits are whole seconds
def test_a_held_requests_deadline_is_brought_forward_onto_the_grid_never_later(
        now: float, seconds: int) -> None:
    """Held requests whose waits end within one step of the grid are answered together
    (`wfm.fleet.waiters._on_grid`): never later than asked, earlier by at most a second
    and at most a twentieth of the wait, on a multiple of the step."""
    deadline = _on_grid(now + seconds, seconds)
    step = min(1.0, seconds / 20)
    assert deadline <= now + seconds
    assert now + seconds - deadline <= step * (1 + 1e-9) + 1e-6
    assert abs(deadline / step - round(deadline / step)) < 1e-3


def test_the_held_polls_gauge_counts_what_every_waiters_holds_when_it_is_read() -> None:
    """`margo_waiting_polls_held` is read from the held requests at scrape time (not set at
    every hold and release), over every `Waiters` of the process."""
    from wfm.telemetry.metrics import HELD_POLLS

    def gauge() -> float:
        [sample] = HELD_POLLS.collect()[0].samples
        return sample.value

    async def scenario() -> tuple[float, float, float]:
        one, two = Waiters(), Waiters()
        before = gauge()
        held = [_held(one, "a", _Checks("device:a"), one.mark()),
                _held(two, "b", _Checks("device:b"), two.mark()),
                _held(two, "c", _Checks("device:c"), two.mark())]
        await asyncio.sleep(0.05)
        during = gauge()
        two.close()
        await asyncio.gather(*held[1:])
        after_close = gauge()
        held[0].cancel()
        return during - before, after_close - before, len(one)

    assert asyncio.run(scenario()) == (3.0, 1.0, 1)
