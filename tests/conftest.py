"""Shared fixtures: paths to the official spec examples and our example fleet; and how the
suite shares the machine when pytest-xdist runs it on several workers (`make test`)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.pgkit import fresh_database, shared_postgres

from tools.postgres import PostgresServer
from wfm.store.database import Database
from wfm.store.opening import open_database

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SPEC_EXAMPLES = FIXTURES / "spec-examples"

# Tests that need one of these session fixtures run on one worker: each stands for a
# machine-wide part that is costly to start twice (a Kubernetes control plane, real
# Kubernetes nodes), or whose copies would collide (two Docker engines allocate the same
# bridge subnets).
_ONE_WORKER = {"control_plane": "kubernetes", "real_nodes": "kubernetes-real",
               "docker_engine": "docker"}


def _private_temp_folder() -> None:
    """Give an xdist worker its own temporary folder (it and the processes it starts):
    tests that check they leave nothing behind in it must not see another worker's files."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    folder = tempfile.mkdtemp(prefix=f"margo-{worker}-")
    os.chmod(folder, 0o1777)  # like /tmp: PostgreSQL runs as its own user (tools/postgres)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_private_temp_folder()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `-n N --dist loadgroup`, pin the tests of each shared part to one worker."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = next((g for f, g in _ONE_WORKER.items()
                      if f in getattr(item, "fixturenames", ())), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


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
