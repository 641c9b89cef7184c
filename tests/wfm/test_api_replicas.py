"""The API suite (test_api.py), run against two replicas on one PostgreSQL database behind a
round-robin balancer: every request may reach either replica, and the answers must be those
of one SQLite process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_api import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
