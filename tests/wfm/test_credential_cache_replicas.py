"""The running-server test of test_credential_cache.py on two replicas behind a round-robin
balancer: a retirement or a new token written through PostgreSQL reaches both replicas'
remembered lookups."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_credential_cache import (  # noqa: F401 - collected again here
    test_a_retired_client_and_a_replaced_token_are_refused_within_seconds,
)


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
