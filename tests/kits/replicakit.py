"""One replica's coordinator on a real PostgreSQL database, holding the compile lease, for
tests that drive its compiles and publications by hand (`prepare`, `publish`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tools.polling import poll_until
from wfm.store.opening import open_database
from wfm.store.pgdb import PostgresDatabase

if TYPE_CHECKING:  # psycopg loads only when PostgreSQL is there
    from wfm.fleet.coordination import Coordinator

__all__ = ["lease_holder"]


@contextlib.contextmanager
def lease_holder(url: str, data: Path) -> Iterator[tuple[PostgresDatabase, Coordinator]]:
    """The database at `url` and a started coordinator on it (data in `data`) once it
    holds the compile lease; both closed after."""
    from wfm.fleet.coordination import Coordinator

    db = open_database(url)
    assert isinstance(db, PostgresDatabase)
    coordinator = Coordinator(db, data, poll=0.05, name="holder")
    coordinator.start()
    try:
        poll_until("the compile lease", lambda: coordinator.holding, timeout=10)
        yield db, coordinator
    finally:
        coordinator.stop()
        db.close()
