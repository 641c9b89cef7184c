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

from kits.serverkit import add_client, running_server, use_store
from tools import fleetserver as _kit
from tools.devices import intent
from tools.fleetserver import (
    CAPABILITIES,
    EXAMPLE_FLEET,
    MANIFEST,
    FleetServer,
    capabilities,
    write_fleet,
)

__all__ = ["CAPABILITIES", "EXAMPLE_FLEET", "MANIFEST", "FleetServer", "capabilities",
           "fleet_server", "one_device_server", "write_fleet"]


@contextmanager
def fleet_server(workdir: Path, *, fleet: Path | None = None, client_id: str = "edge",
                 extra_args: Sequence[str] = ()) -> Iterator[FleetServer]:
    """`tools.fleetserver.fleet_server` on the suite's store."""
    with _kit.fleet_server(workdir, fleet=fleet, client_id=client_id, extra_args=extra_args,
                           start=running_server, register=add_client) as server:
        yield server


@contextmanager
def one_device_server(workdir: Path, device: str, *, store: str = "sqlite",
                      extra_args: Sequence[str] = ()) -> Iterator[FleetServer]:
    """`fleet_server` on `store` (`kits.serverkit.use_store`), its fleet one intent for
    `device` (a single-node k8s device that reported its capabilities), once its
    deployment is compiled: what the waiting-poll tests poll."""
    with use_store(store), fleet_server(
            workdir, fleet=write_fleet(workdir / "fleet", intents={}),
            extra_args=extra_args) as running:
        running.put_capabilities(capabilities("k8s-single-amd64", device))
        running.edit_intent(device, intent(device))
        running.wait_for_deployments(1)
        yield running
