"""Test kit: a real `margo serve` with a fleet of our choosing, one client and its devices
(`tools.fleetserver`, which the benchmarks use too), started on the suite's store
(`kits.serverkit`: SQLite, or replicas on PostgreSQL).

    with fleet_server(tmp_path, fleet=write_fleet(tmp_path / "fleet")) as server:
        server.put_capabilities(capabilities("k8s-cluster-gpu"))
        manifest = server.wait_for_deployments(3)
        server.edit_intent("hello-everywhere", text)      # recompiled: --watch-source
        server.wait_for_change(manifest_etag)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kits.serverkit import add_client, running_server
from tools import fleetserver as _kit
from tools.fleetserver import (
    CAPABILITIES,
    EXAMPLE_FLEET,
    MANIFEST,
    FleetServer,
    capabilities,
    write_fleet,
)

__all__ = ["CAPABILITIES", "EXAMPLE_FLEET", "MANIFEST", "FleetServer", "capabilities",
           "fleet_server", "write_fleet"]


@contextmanager
def fleet_server(workdir: Path, *, fleet: Path | None = None, client_id: str = "edge",
                 extra_args: Sequence[str] = ()) -> Iterator[FleetServer]:
    """`tools.fleetserver.fleet_server` on the suite's store."""
    with _kit.fleet_server(workdir, fleet=fleet, client_id=client_id, extra_args=extra_args,
                           start=running_server, register=add_client) as server:
        yield server
