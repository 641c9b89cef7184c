"""The fleet server the CLI tests ask (`kits.clikit`): one per session, its state only
added to (a test that adds a device gives it labels no other test selects)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kits.clikit import CliFleet, cli_fleet_server


@pytest.fixture(scope="session")
def cli_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliFleet]:
    with cli_fleet_server(tmp_path_factory.mktemp("cli-fleet")) as served:
        yield served
