"""The operators and roles suite (test_operators.py) against two replicas on one PostgreSQL
database behind a round-robin balancer: an operator added, rotated or revoked beside them
is known to both within seconds, and the trail is one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_operators import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
