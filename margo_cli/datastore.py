"""The commands that work on a server's store beside it (`margo clients`, `margo trust`,
`margo operators`, `margo audit`): which store (`--data`, `--database`), opened and closed,
and the audit trail's actor for what they change (`local:<OS user>`).

SQLite in WAL mode takes them while the server runs; on PostgreSQL any replica's store is
the fleet's. The server notices what they change within seconds (the credentials epoch,
`wfm.identity.credentialcache`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from margo_cli.usage import UsageError

if TYPE_CHECKING:  # the server's modules load only when a command runs
    from wfm.store.database import Database

__all__ = ["audited", "data_options", "opened_store"]


def data_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="wfm-data", metavar="DIR",
                        help="the server's state directory (default: ./wfm-data)")
    parser.add_argument("--database", metavar="URL",
                        help="the servers' PostgreSQL database (postgresql://...), when they "
                             "run with --database; default: <data>/wfm.sqlite")


@contextmanager
def opened_store(args: argparse.Namespace) -> Iterator[Database]:
    """The store `--data`/`--database` name; UsageError when it cannot be opened (the
    message says what to do)."""
    from wfm.store.database import DatabaseUnavailable
    from wfm.store.opening import open_database
    from wfm.store.sqlitedb import DatabaseDamaged

    try:
        db = open_database(args.database or Path(args.data) / "wfm.sqlite")
    except (DatabaseDamaged, DatabaseUnavailable) as exc:
        raise UsageError(f"margo: {exc}") from None
    try:
        yield db
    finally:
        db.close()


def audited(db: Database, action: str, target: str, detail: str | None = None) -> None:
    """Record a change this command made in the audit trail, as `local:<OS user>`."""
    from wfm.fleet.audit import local_operator, record_sync

    record_sync(db, local_operator(), action, target, detail=detail)
