"""The device's REST source suite (test_rest_source.py), against two replicas on one PostgreSQL
database behind a round-robin balancer: every request may reach either replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_rest_source import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
