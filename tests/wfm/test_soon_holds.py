"""A request held without a coroutine (`Waiters.hold_soon`, what `wfm.server.wire` holds a
waiting device's renewal with): it ends in one call of its `then`, exactly once, with the
outcome that ended it; the holds due in the same second share one timer; a wake and the
server's stop are handed back (the caller goes on with `hold`), while a run-out wait and a
gone client are counted here; and a request that cannot be held so (the server stopping,
too many held, a wake since its check) is not. Driven on an event loop, as
tests/wfm/test_waiter_wakes.py does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from wfm.fleet.waiters import Outcome, SoonHold, Waiters, client_key, device_key
from wfm.server.closing import ConnectionClosing
from wfm.telemetry.metrics import HELD_POLL_ENDS

KEYS = frozenset({client_key("edge"), device_key("d1")})


class _Ends:
    """A hold's `then`: the outcomes it was called with, and when (the loop's clock)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Outcome, float]] = []

    def __call__(self, outcome: Outcome) -> None:
        self.calls.append((outcome, asyncio.get_running_loop().time()))


def _ended(outcome: Outcome) -> float:
    return HELD_POLL_ENDS.labels(outcome.value)._value.get()


def _on_loop(scenario: Callable[[Waiters], object]) -> object:
    async def run() -> object:
        waiters = Waiters()
        waiters.mark()  # (what a request does before it is held: the loop is learnt)
        return await scenario(waiters)  # type: ignore[misc]

    return asyncio.run(run())


def _hold(waiters: Waiters, ends: _Ends, seconds: float = 1.0,
          closing: ConnectionClosing | None = None) -> SoonHold | None:
    return waiters.hold_soon(KEYS, seconds, since=waiters.changes,
                             closing=closing or ConnectionClosing(), then=ends)


def test_a_wait_that_runs_out_calls_then_once_on_the_grid_and_is_counted() -> None:
    async def scenario(waiters: Waiters) -> tuple[list[Outcome], bool, int, float]:
        ends, before = _Ends(), _ended(Outcome.TIMEOUT)
        held = _hold(waiters, ends, seconds=1.0)
        assert held is not None and len(waiters) == 1
        await asyncio.sleep(1.2)
        held.resolve(Outcome.CHANGED)  # (ended already: nothing more)
        on_time = all(at >= held.deadline for _, at in ends.calls)
        return ([o for o, _ in ends.calls], on_time, len(waiters),
                _ended(Outcome.TIMEOUT) - before)

    assert _on_loop(scenario) == ([Outcome.TIMEOUT], True, 0, 1)


def test_holds_due_in_the_same_second_share_one_timer() -> None:
    async def scenario(waiters: Waiters) -> tuple[int, int, list[list[Outcome]]]:
        all_ends = [_Ends() for _ in range(50)]
        holds = [_hold(waiters, ends, seconds=1.0) for ends in all_ends]
        deadlines = {held.deadline for held in holds if held is not None}
        timers = len(waiters._due)  # (one `call_at` for each)
        await asyncio.sleep(1.2)
        return len(deadlines), timers, [[o for o, _ in e.calls] for e in all_ends]

    deadlines, timers, outcomes = _on_loop(scenario)  # type: ignore[misc]
    assert deadlines in (1, 2) and timers == deadlines  # (two if a step began meanwhile)
    assert outcomes == [[Outcome.TIMEOUT]] * 50


def test_a_wake_is_handed_back_uncounted_and_the_hold_is_gone_from_the_index() -> None:
    async def scenario(waiters: Waiters) -> tuple[list[Outcome], int, dict[str, object]]:
        ends, before = _Ends(), _ended(Outcome.CHANGED)
        assert _hold(waiters, ends, seconds=30) is not None
        waiters.wake_devices(["d1"])
        await asyncio.sleep(0.05)
        assert _ended(Outcome.CHANGED) == before  # (the `hold` that goes on counts it)
        return [o for o, _ in ends.calls], len(waiters), waiters._index

    assert _on_loop(scenario) == ([Outcome.CHANGED], 0, {})


def test_a_client_gone_ends_its_hold_at_once_and_is_counted() -> None:
    async def scenario(waiters: Waiters) -> tuple[list[Outcome], int, float]:
        ends, closing, before = _Ends(), ConnectionClosing(), _ended(Outcome.GONE)
        assert _hold(waiters, ends, seconds=30, closing=closing) is not None
        closing.close()
        return [o for o, _ in ends.calls], len(waiters), _ended(Outcome.GONE) - before

    assert _on_loop(scenario) == ([Outcome.GONE], 0, 1)


def test_a_released_hold_never_calls_then() -> None:
    async def scenario(waiters: Waiters) -> tuple[list[Outcome], int]:
        ends, closing = _Ends(), ConnectionClosing()
        held = _hold(waiters, ends, seconds=1.0, closing=closing)
        assert held is not None
        held.release()
        closing.close()
        waiters.wake_all()
        await asyncio.sleep(1.2)
        return [o for o, _ in ends.calls], len(waiters)

    assert _on_loop(scenario) == ([], 0)


@pytest.mark.parametrize("why", ["stopping", "woken since its check", "too many held"])
def test_a_request_that_cannot_be_held_so_is_left_to_hold(why: str) -> None:
    async def scenario(waiters: Waiters) -> tuple[SoonHold | None, list[Outcome]]:
        ends = _Ends()
        since = waiters.changes
        if why == "stopping":
            waiters.close()
        elif why == "woken since its check":
            waiters.wake_devices(["elsewhere"])
            await asyncio.sleep(0.05)
        else:
            waiters.limit = 0
        held = waiters.hold_soon(KEYS, 30, since=since, closing=ConnectionClosing(),
                                 then=ends)
        return held, [o for o, _ in ends.calls]

    assert _on_loop(scenario) == (None, [])
