"""The staged-rollout suite (test_rollouts.py) against two replicas on one PostgreSQL
database behind a round-robin balancer: reports, operator actions and the rollout's
evaluation may each happen on a different replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_rollouts import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
