"""The dashboard's roles and rollout actions (test_dashboard_actions.py) against two replicas
on one PostgreSQL database behind a round-robin balancer: a session opened on one replica
is used on the other (the sealing key comes from the store), a form's token made by one is
checked by the other, and a revocation reaches both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_dashboard_actions import *  # noqa: F403 - the same tests, collected again here

pytestmark = pytest.mark.xdist_group("dashboard-actions-replicas")


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
