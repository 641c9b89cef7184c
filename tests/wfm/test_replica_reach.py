"""Whether a replica reaches its database (`Coordinator.database_reached`), which decides
whether it may answer a current device's manifest poll from memory (`wfm.http.manifests`):
a real PostgreSQL reached through a real TCP proxy whose link is cut (connections closed)
or silenced (nothing gets through, nothing is closed), then restored. What a cut-off
replica answers a device is tested end to end in tests/reconciler/test_device_failover.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import pytest
from kits.netkit import CuttableProxy, cuttable_proxy

from tools.polling import poll_until
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
