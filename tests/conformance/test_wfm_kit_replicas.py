"""The official conformance kit's WFM suite (test_wfm_kit.py), against two replicas on one
PostgreSQL database behind a TCP balancer that sends each connection to the next replica."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.serverkit import use_store
from test_wfm_kit import *  # noqa: F403 - the same tests, collected again here


@pytest.fixture(scope="module", autouse=True)
def _on_replicas() -> Iterator[None]:
    with use_store("replicas"):
        yield
