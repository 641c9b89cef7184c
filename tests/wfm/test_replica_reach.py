"""Whether a replica reaches its database (`Coordinator.database_reached`), which decides
whether it may answer a current device's manifest poll from memory (`wfm.http.manifests`):
a real PostgreSQL reached through a real TCP proxy whose link is cut (connections closed)
or silenced (nothing gets through, nothing is closed), or whose packets the kernel drops
(a partition: `CuttableProxy.drop`), then restored. What a cut-off replica answers a device
is tested end to end in tests/reconciler/test_device_failover.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
from kits.netkit import CuttableProxy, cuttable_proxy

from tools.polling import poll_until
from wfm.store.database import DatabaseUnavailable
from wfm.store.opening import open_database
from wfm.store.pgdb import PostgresDatabase

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator


@pytest.fixture
def linked(pg_url: str, tmp_path: Path) -> Iterator[tuple[CuttableProxy, Coordinator]]:
    """A replica's coordinator whose every connection to PostgreSQL crosses the proxy."""
    from wfm.fleet.coordination import Coordinator

    port = urlsplit(pg_url).port
    with cuttable_proxy(port) as link:
        db = open_database(pg_url.replace(f":{port}/", f":{link.port}/"))
        assert isinstance(db, PostgresDatabase)
        coordinator = Coordinator(db, tmp_path / "data", poll=0.05, name="reach")
        try:
            yield link, coordinator
        finally:
            link.restore()
            coordinator.stop()
            db.close()


def test_a_replica_reaches_its_database_only_while_its_loop_reads_it(
        linked: tuple[CuttableProxy, Coordinator]) -> None:
    from wfm.fleet.coordination import REACHED_FOR

    link, coordinator = linked
    assert not coordinator.database_reached  # its loop has not looked yet
    coordinator.start()
    poll_until("the first look", lambda: coordinator.database_reached, timeout=10)
    link.cut()
    poll_until("the cut noticed", lambda: not coordinator.database_reached, timeout=3)
    link.restore()
    poll_until("the link back", lambda: coordinator.database_reached, timeout=30)
    link.silence()  # its reads hang: only time tells
    poll_until("the silence noticed", lambda: not coordinator.database_reached,
               timeout=REACHED_FOR + 3)
    link.cut()  # the silent link dropped at last (what the silence swallowed is lost)
    link.restore()
    poll_until("the link back again", lambda: coordinator.database_reached, timeout=30)


def through(link: CuttableProxy, pg_url: str) -> str:
    port = urlsplit(pg_url).port
    return pg_url.replace(f":{port}/", f":{link.port}/")


def test_a_statement_over_a_partitioned_link_fails_within_the_link_timeout(
        pg_url: str) -> None:
    """Packets dropped mid-session (a partition): a read in flight fails within the link
    timeout (`tcp_user_timeout`), as DatabaseUnavailable, instead of waiting out TCP's own
    give-up (about fifteen minutes); once the link is back, reads work again with no
    restart."""
    with cuttable_proxy(urlsplit(pg_url).port) as link:
        db = PostgresDatabase(through(link, pg_url), pool_size=1, link_timeout=2)
        try:
            assert db.read(lambda conn: conn.execute("SELECT 1").fetchone()) == (1,)
            link.drop()
            outcome: list[BaseException | None] = []

            def read() -> None:
                try:
                    db.read(lambda conn: conn.execute("SELECT 1").fetchone())
                    outcome.append(None)
                except BaseException as exc:  # (the outcome is asserted)
                    outcome.append(exc)

            started = time.monotonic()
            reader = threading.Thread(target=read, daemon=True)  # (hangs without the fix)
            reader.start()
            reader.join(timeout=30)
            assert outcome, "the read over the dropped link still waits after 30 s"
            assert isinstance(outcome[0], DatabaseUnavailable), outcome
            assert time.monotonic() - started < 15
            link.restore()
            poll_until("reads through the restored link", lambda: _reads(db), timeout=30)
        finally:
            link.restore()
            db.close()


def test_a_replica_notices_a_partition_and_comes_back_without_a_restart(
        pg_url: str, tmp_path: Path) -> None:
    """The coordination loop's reads and its listening session over a link whose packets
    are dropped: the replica stops counting on the database, and reaches it again once the
    link is back, with nothing closed by hand (a silenced link, above, needs a cut)."""
    from wfm.fleet.coordination import REACHED_FOR, Coordinator

    with cuttable_proxy(urlsplit(pg_url).port) as link:
        db = PostgresDatabase(through(link, pg_url), link_timeout=2)
        coordinator = Coordinator(db, tmp_path / "data", poll=0.05, name="partition")
        try:
            coordinator.start()
            poll_until("the first look", lambda: coordinator.database_reached, timeout=10)
            link.drop()
            poll_until("the partition noticed", lambda: not coordinator.database_reached,
                       timeout=REACHED_FOR + 3)
            time.sleep(3)  # long enough for every connection in flight to have timed out
            link.restore()
            poll_until("the link back", lambda: coordinator.database_reached, timeout=30)
        finally:
            link.restore()
            coordinator.stop()
            db.close()


def _reads(db: PostgresDatabase) -> bool:
    try:
        return db.read(lambda conn: conn.execute("SELECT 1").fetchone()) == (1,)
    except DatabaseUnavailable:
        return False
