"""Fleet server replicas on one PostgreSQL database, each reached directly (no balancer),
for devices that fail over between server URLs (docs/device.md, "Several server URLs"): for
the tests (`kits.failoverkit`, on the suite's PostgreSQL) and the benchmarks
(`bench.failover`, on a server of its own: `tools.postgres`).

    with replica_pair(workdir, database=url, registry=registry) as pair:
        first, second = pair.replicas
        device = new_device(pair.servers[1], "edge-1", url=first.base)   # tools.devices
        first.kill()                                   # SIGKILL: its port refuses from now on

Every replica watches the same fleet source directory (`--watch-source`), so an edited
intent is compiled by whichever holds the compile lease; `pair.servers[i]` is a
`FleetServer` talking to replica i (for `tools.devices`). A replica can be killed
(SIGKILL), paused (SIGSTOP: its port accepts connections that are never answered) and
started again on the same port and data directory; replica A reaches the database through a
proxy whose link can be cut (a replica alive but without its database).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tools.fleetserver import ROOT, FleetServer, add_client, write_fleet
from tools.netproxy import CuttableProxy, cuttable_proxy
from tools.processes import free_port, stop, wait_until_ready

__all__ = ["Replica", "ReplicaPair", "replica_pair"]


@dataclass
class Replica:
    """One `margo serve` process on the shared database, on a fixed port (a restart keeps
    the URL devices were given)."""

    data: Path
    args: tuple[str, ...]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    log_level: str = "warning"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.data.parent / f"{self.data.name}.log"

    def start(self) -> Replica:
        self.data.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "margo_cli.main", "serve", "--port", str(self.port),
                 "--data", str(self.data), "--log-level", self.log_level, *self.args],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        wait_until_ready(self.process, lambda: httpx.get(f"{self.base}/readyz", timeout=1)
                         .status_code == 200, f"the replica on port {self.port}", self.log,
                         timeout=60)
        return self

    def kill(self) -> None:
        """SIGKILL: the process is gone at once and its port refuses connections."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections on its port; nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.resume()
            stop(self.process)


@dataclass
class ReplicaPair:
    """Two replicas, one client (`client_id`, `token`) and a `FleetServer` per replica.
    `database_link` is the proxy through which replica A (`replicas[0]`) reaches PostgreSQL:
    cut it, and A is a live replica without its database."""

    replicas: list[Replica]
    servers: list[FleetServer]
    client_id: str
    token: str
    source: Path
    database: str
    database_link: CuttableProxy


@contextmanager
def replica_pair(workdir: Path, *, database: str, registry: str | None = None,
                 client_id: str = "edge") -> Iterator[ReplicaPair]:
    """Two replicas (data in `workdir/data/replica-<i>`) on the PostgreSQL `database` (a
    URL; new and empty), on a watched copy of the example fleet with no intents (charts from
    `registry`)."""
    source = write_fleet(workdir / "fleet", registry=registry, intents={})
    data = workdir / "data"
    token = add_client(data, client_id, database=database)
    with ExitStack() as stack:
        port = urlsplit(database).port
        assert port is not None
        link = stack.enter_context(cuttable_proxy(port))
        watched = ("--source", str(source), "--watch-source")
        replicas = [Replica(data / f"replica-{i}", ("--database", url, *watched))
                    for i, url in enumerate([database.replace(f":{port}/", f":{link.port}/"),
                                             database])]
        for replica in replicas:
            stack.callback(replica.stop)
            replica.start()
        servers = []
        for replica in replicas:
            http = stack.enter_context(httpx.Client(
                base_url=replica.base, timeout=10,
                headers={"Authorization": f"Bearer {token}"}))
            servers.append(FleetServer(base=replica.base, client_id=client_id, token=token,
                                       source_dir=source, data_dir=data, _http=http))
        yield ReplicaPair(replicas, servers, client_id, token, source, database, link)
