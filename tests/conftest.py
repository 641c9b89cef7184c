"""Shared fixtures: paths to the official spec examples and our example fleet."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.pgkit import fresh_database, shared_postgres

from tools.postgres import PostgresServer

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
