"""Compile requests between replicas (`wfm.fleet.coordination`, real PostgreSQL): one made
for a single event (a push, a webhook's fetch, a rollout action: `request_compile(settle=
False)`) is counted as urgent, and the lease holder its news wakes starts its compile
without the debounce; any other request goes through the debounce. A request for a compile at once
whose news was lost (written without it, as when the holder's listening session dropped)
is still answered at once, from its count. Each request is checked by the urgency the
holder's callback is given, so a request that lost its urgency fails here."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kits.replicakit import lease_holder

from tools.polling import poll_until
from wfm.store import replica_rows

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator
    from wfm.store.pgdb import PostgresDatabase


@pytest.fixture
def held(pg_url: str, tmp_path: Path) -> Iterator[tuple[PostgresDatabase, Coordinator]]:
    with lease_holder(pg_url, tmp_path / "data") as (db, coordinator):
        yield db, coordinator


@pytest.fixture
def holder(held: tuple[PostgresDatabase, Coordinator]) -> Coordinator:
    return held[1]


def _calls(coordinator: Coordinator) -> list[str]:
    """Which callback each compile request the holder answers from now on ends in (after
    the compile a new holder asks for once, at its first look: `poll` is 0.05 s)."""
    calls: list[str] = []
    coordinator.on_compile_due = lambda *, settle=True: calls.append(
        "debounced" if settle else "now")
    time.sleep(0.5)
    calls.clear()
    return calls


@pytest.mark.parametrize("settle, expected", [(False, "now"), (True, "debounced")])
def test_a_request_reaches_the_holder_with_its_urgency(holder: Coordinator, settle: bool,
                                                       expected: str) -> None:
    calls = _calls(holder)
    holder.request_compile(settle=settle)
    poll_until("the holder answered the request", lambda: calls, timeout=10)
    assert calls == [expected]


def test_requests_in_turn_each_keep_their_own_urgency(holder: Coordinator) -> None:
    calls = _calls(holder)
    for settle, count in ((True, 1), (False, 2), (True, 3)):
        holder.request_compile(settle=settle)
        poll_until("the holder answered the request", lambda n=count: len(calls) >= n,
                   timeout=10)
    assert calls == ["debounced", "now", "debounced"]


@pytest.mark.parametrize("at_once, expected", [(True, "now"), (False, "debounced")])
def test_a_request_whose_news_was_lost_keeps_its_urgency(
        held: tuple[PostgresDatabase, Coordinator], at_once: bool, expected: str) -> None:
    db, coordinator = held
    calls = _calls(coordinator)
    # Counted, never announced: the holder sees it only at its periodic look.
    db.write_sync(lambda conn: replica_rows.request_compile(conn, at_once=at_once))
    poll_until("the holder answered the request", lambda: calls, timeout=10)
    assert calls == [expected]
