"""Test kit: fleet server replicas on one PostgreSQL database, each reached directly (no
balancer), for devices that fail over between server URLs (docs/device.md, "Several server
URLs").

    with replica_pair(workdir, registry=registry) as pair:
        first, second = pair.replicas
        device = new_device(pair.servers[1], "edge-1", url=first.base)   # kits.devicekit
        set_fallbacks(device, [second.base])
        first.kill()                                   # SIGKILL: its port refuses from now on

The replicas, the running device and the read API's view of its one deployment are
`tools.replicas` and `tools.devices`, which the benchmarks use too; here the pair is started
on a new database of the suite's PostgreSQL server (`kits.pgkit`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from kits.devicekit import Device
from kits.pgkit import database_for
from tools import replicas as _replicas
from tools.devices import current, new_digest, running_device
from tools.replicas import Replica, ReplicaPair

__all__ = ["Replica", "ReplicaPair", "current", "new_digest", "replica_pair", "running_device",
           "set_fallbacks"]


@contextmanager
def replica_pair(workdir: Path, *, registry: str | None = None,
                 client_id: str = "edge") -> Iterator[ReplicaPair]:
    """`tools.replicas.replica_pair` on a new database of the suite's PostgreSQL server
    (data in `workdir/data/replica-<i>`)."""
    with _replicas.replica_pair(workdir, database=database_for(workdir / "data"),
                                registry=registry, client_id=client_id) as pair:
        yield pair


def set_fallbacks(device: Device, urls: list[str], **server: Any) -> None:
    """Give a device (`kits.devicekit`) further server URLs, and other `server:` settings."""
    config = yaml.safe_load(device.config.read_text())
    config["server"].update({"fallbackUrls": urls, **server})
    device.config.write_text(yaml.safe_dump(config))
