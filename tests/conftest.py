"""Shared fixtures: paths to the official spec examples and our example fleet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.pgkit import fresh_database, shared_postgres

from tools.postgres import PostgresServer
from wfm.db import Database, open_database

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SPEC_EXAMPLES = FIXTURES / "spec-examples"


@pytest.fixture
def spec_examples() -> Path:
    return SPEC_EXAMPLES


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A private PostgreSQL server (Debian's packages), started once per session."""
    yield shared_postgres()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> str:
    """A new, empty database on the session's server."""
    return fresh_database(postgres)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The server's store, once on SQLite and once on PostgreSQL: the record functions
    must answer alike on both."""
    if request.param == "sqlite":
        db = open_database(tmp_path / "wfm.sqlite")
    else:
        db = open_database(request.getfixturevalue("pg_url"))
    try:
        yield db
    finally:
        db.close()
