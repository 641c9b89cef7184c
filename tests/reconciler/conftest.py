"""Session fixtures for the device client's tests: one real OCI registry for all of them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The fleet server's test kit (running `margo serve`, adding clients) is shared with tests/wfm.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "wfm"))

from registrykit import running_registry


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`127.0.0.1:<port>` of a running docker-registry (plain HTTP)."""
    with running_registry(tmp_path_factory.mktemp("registry")) as host:
        yield host
