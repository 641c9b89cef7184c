"""The read API, push hook and hosted-source suite (test_fleet_api.py), against two replicas
on one PostgreSQL database behind a round-robin balancer: every request may reach either
replica (a push's advertisement and its pack included)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_fleet_api import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
