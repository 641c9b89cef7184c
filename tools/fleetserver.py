"""A real `margo serve` with a fleet of our choosing, one client and its devices: for the
tests (`tests/kits/fleetserver.py` starts it on the suite's store) and the benchmarks.

    with fleet_server(tmp_path, fleet=write_fleet(tmp_path / "fleet")) as server:
        server.put_capabilities(capabilities("k8s-cluster-gpu"))
        manifest = server.wait_for_deployments(3)
        server.edit_intent("hello-everywhere", text)      # recompiled: --watch-source
        server.wait_for_change(manifest_etag)

The server runs in its own process on loopback (`tools.margoserver`, on SQLite; the tests
pass their own `start` and `register`) and is started with `--watch-source`, so an edited
intent reaches the device branches without anyone acting, as in development. Waiting is by
polling with a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tools.margoserver import running_margo
from tools.polling import poll_until

__all__ = ["CAPABILITIES", "EXAMPLE_FLEET", "MANIFEST", "FleetServer", "add_client",
           "capabilities", "fleet_server", "write_fleet"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_FLEET = ROOT / "examples" / "fleet"
CAPABILITIES = ROOT / "examples" / "capabilities"
MANIFEST = "application/vnd.margo.manifest.v1+json"
#: The registry the example applications name; `write_fleet(registry=...)` replaces it.
EXAMPLE_REGISTRY = "127.0.0.1:5000"

T = TypeVar("T")
#: Starts `margo serve --data DATA ARGS...` and yields its base URL.
Start = Callable[..., AbstractContextManager[str]]
#: Registers a client in a data directory; its token.
Register = Callable[[Path, str], str]


def add_client(data: Path, client_id: str, *, database: str | None = None) -> str:
    """`margo clients add` on the data directory's SQLite store (or on the PostgreSQL
    `database`); the client's token."""
    store = ["--database", database] if database is not None else []
    done = subprocess.run([sys.executable, "-m", "margo_cli.main", "clients", "add", client_id,
                           "--data", str(data), "--json", *store], capture_output=True,
                          text=True, check=True, timeout=60)
    token: str = json.loads(done.stdout)["token"]
    return token


def capabilities(example: str, device_id: str | None = None) -> dict[str, Any]:
    """An examples/capabilities document, optionally for another device id."""
    doc: dict[str, Any] = json.loads((CAPABILITIES / f"{example}.json").read_text())
    if device_id is not None:
        doc["properties"]["id"] = device_id
    return doc


def write_fleet(dest: Path, *, registry: str | None = None,
                intents: dict[str, str] | None = None) -> Path:
    """A fleet source at `dest`: the example applications and intents, with the example
    registry host replaced by `registry` (e.g. the session's real registry) and, when
    `intents` is given, exactly those intents (`{name: yaml text}`) instead of the examples."""
    shutil.copytree(EXAMPLE_FLEET, dest)
    if registry is not None:
        for description in dest.glob("apps/*/**/margo.yaml"):
            text = description.read_text()
            description.write_text(text.replace(EXAMPLE_REGISTRY, registry))
    if intents is not None:
        for old in (dest / "deployments").glob("*.yaml"):
            old.unlink()
        for name, text in intents.items():
            (dest / "deployments" / f"{name}.yaml").write_text(text)
    return dest


@dataclass
class FleetServer:
    """A running server and one registered client (`client_id`, `token`)."""

    base: str
    client_id: str
    token: str
    source_dir: Path | None
    data_dir: Path
    _http: httpx.Client = field(repr=False)
    _register: Register = field(repr=False, default=add_client)

    # --- the device side ---------------------------------------------------------------------

    def client(self, *, token: str | None = None, **kwargs: Any) -> httpx.Client:
        """A new device HTTP client (bearer token, base URL); the caller closes it."""
        kwargs.setdefault("timeout", 10)
        headers = {"Authorization": f"Bearer {token or self.token}", **kwargs.pop("headers", {})}
        return httpx.Client(base_url=self.base, headers=headers, **kwargs)

    def git_url(self, device_id: str) -> str:
        """The device's repository (HTTP basic: client id and token)."""
        return f"{self.base}/git/devices/{device_id}.git"

    def put_capabilities(self, doc: dict[str, Any], *, oct_2024: bool = False) -> None:
        """Report a device's capabilities (rc.3 PUT, or Oct-2024's, which makes the server
        write the device's documents in that shape); fails the test unless 200/201."""
        device_id = doc["properties"]["id"]
        path = (f"/device/{device_id}/capabilities" if oct_2024
                else f"/api/v1/capabilities/{device_id}")
        response = self._http.put(path, json=doc)
        assert response.status_code in (200, 201), response.text

    def manifest(self) -> tuple[dict[str, Any], str]:
        """The client's current manifest and its ETag."""
        response = self._http.get("/api/v1/deployments", headers={"Accept": MANIFEST})
        assert response.status_code == 200, response.text
        return response.json(), response.headers["etag"]

    def add_client(self, client_id: str) -> str:
        """Register another client while the server runs; its token."""
        return self._register(self.data_dir, client_id)

    # --- the operator side -------------------------------------------------------------------

    def edit_intent(self, name: str, text: str) -> None:
        """Write `deployments/<name>.yaml` atomically (the watcher never sees half a file)."""
        self._write(self._source() / "deployments" / f"{name}.yaml", text)

    def remove_intent(self, name: str) -> None:
        (self._source() / "deployments" / f"{name}.yaml").unlink()

    def intent(self, name: str) -> str:
        return (self._source() / "deployments" / f"{name}.yaml").read_text()

    def set_parameter(self, intent: str, parameter: str, value: str) -> None:
        """Change one `parameters:` line of an intent (`  name: value`)."""
        text = self.intent(intent)
        pattern = re.compile(rf"^(\s+{re.escape(parameter)}:).*$", re.MULTILINE)
        changed, count = pattern.subn(lambda m: f"{m.group(1)} {value}", text, count=1)
        assert count == 1, f"no parameter {parameter!r} in intent {intent!r}"
        self.edit_intent(intent, changed)

    def device(self, device_id: str) -> dict[str, Any]:
        """GET /api/fleet/devices/{id}: capabilities, deployments with status, history."""
        response = self._http.get(f"/api/fleet/devices/{device_id}")
        assert response.status_code == 200, response.text
        doc: dict[str, Any] = response.json()
        return doc

    def statuses(self, deployment_id: str) -> dict[str, Any] | None:
        """What the server holds for a deployment (`state`, `components`, `error`,
        `reportedAt`, `digest`), from the read API; None if no device has it."""
        devices = self._http.get("/api/fleet/devices").json()["devices"]
        for summary in devices:
            for deployment in self.device(summary["deviceId"])["deployments"]:
                if deployment["deploymentId"] == deployment_id:
                    found: dict[str, Any] = deployment
                    return found
        return None

    # --- waiting -----------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], T], timeout: float = 20.0,
                 what: str = "the condition") -> T:
        """Poll `predicate` until it returns something truthy; return that."""
        return poll_until(what, predicate, timeout=timeout, interval=0.05)

    def wait_for_deployments(self, count: int, device_id: str | None = None,
                             timeout: float = 20.0) -> dict[str, Any]:
        """Wait until the manifest lists `count` deployments (or, with `device_id`, that
        device's branch holds `count`); the manifest then."""
        def ready() -> dict[str, Any] | None:
            manifest, _ = self.manifest()
            held = (len(self.device(device_id)["deployments"]) if device_id is not None
                    else len(manifest["deployments"]))
            return manifest if held == count else None

        what = f"{count} deployments" + (f" on {device_id}" if device_id else "")
        return self.wait_for(ready, timeout, what)

    def wait_for_change(self, etag: str, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until the manifest's ETag is no longer `etag` (a recompile landed)."""
        def changed() -> dict[str, Any] | None:
            manifest, current = self.manifest()
            return manifest if current != etag else None

        return self.wait_for(changed, timeout, "the manifest to change")

    # --- helpers -----------------------------------------------------------------------------

    def _source(self) -> Path:
        assert self.source_dir is not None, "this server has no fleet source directory"
        return self.source_dir

    @staticmethod
    def _write(path: Path, text: str) -> None:
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(text)
        os.replace(temporary, path)


@contextmanager
def fleet_server(workdir: Path, *, fleet: Path | None = None, client_id: str = "edge",
                 extra_args: Sequence[str] = (), start: Start = running_margo,
                 register: Register = add_client) -> Iterator[FleetServer]:
    """Start `margo serve` (data in `workdir/data`) on the fleet source `fleet` (watched),
    or on no source at all when it is None (every device then gets an empty branch), with
    one client registered; stop it afterwards."""
    data = workdir / "data"
    token = register(data, client_id)
    args = ["--source", str(fleet), "--watch-source"] if fleet is not None else []
    with start(data, *args, *extra_args) as base, httpx.Client(
            base_url=base, timeout=10,
            headers={"Authorization": f"Bearer {token}"}) as http:
        yield FleetServer(base=base, client_id=client_id, token=token, source_dir=fleet,
                          data_dir=data, _http=http, _register=register)

