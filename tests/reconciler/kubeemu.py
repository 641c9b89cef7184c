"""A Kubernetes API emulator on loopback for the Helm driver's tests: kmock's
`KubernetesEmulator` (a real aiohttp server, objects kept in memory), run on its own event
loop in a background thread, with a kubeconfig pointing at it.

No real API server can be installed on these machines (see dependency-notes section 2).
Two small fixes make the emulator usable by Helm (client-go):
- `/api/v1` discovery says `groupVersion: "/v1"` instead of `"v1"`, so client-go finds no
  core kinds ("no matches for kind ConfigMap in version v1");
- list responses carry no `kind`, so Helm's readiness watcher cannot decode them and every
  wait times out; with `<Kind>List` a ConfigMap is ready at once.

What it still cannot do (so the tests do not pretend otherwise): no OpenAPI documents and no
server-side apply (the driver's `compat` mode), Secrets and ConfigMaps posted as protobuf are
unreadable (so Helm's records use the `memory` storage driver), nothing runs pods or sets
any status (a Deployment never becomes ready: a wait on it runs into its timeout), and
namespaces need not exist.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.resources
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kmock
import yaml

__all__ = ["Emulator", "running_emulator", "write_kubeconfig"]


class _FixedEmulator(kmock.KubernetesEmulator):
    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            payload["groupVersion"] = request.resource.version  # "v1", not "/v1"
        return payload

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        resource = request.resource
        if resource is not None and resource in self.resources:
            kind = self.resources[resource].kind or str(resource.plural).capitalize()
            payload["kind"] = f"{kind}List"
            payload["apiVersion"] = (f"{resource.group}/{resource.version}" if resource.group
                                     else str(resource.version))
        return payload


def write_kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig with one context `emulator` for `server` (no credentials)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {}}],
        "contexts": [{"name": "emulator",
                      "context": {"cluster": "emulator", "user": "emulator"}}],
    }))
    return path


class Emulator:
    """A running emulator: `url`, `kubeconfig`, and read access to the objects it holds."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._handler: _FixedEmulator | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    def objects(self, resource: str) -> dict[tuple[str | None, str], dict[str, Any]]:
        """Current (not deleted) objects of `resource` (`v1/configmaps`,
        `apps/v1/deployments`) as `(namespace, name) -> object`."""
        async def snapshot() -> dict[tuple[str | None, str], dict[str, Any]]:
            assert self._handler is not None
            wanted = kmock.resource(resource)
            return {(namespace, name): obj.raw
                    for (kind, namespace, name), obj in self._handler.objects.items()
                    if kind == wanted and not obj.deleted}
        assert self._loop is not None, "the emulator is not running"
        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(timeout=10)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One current object, or None."""
        return self.objects(resource).get((namespace, name))

    # --- lifecycle -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # asyncio.run cancels and awaits whatever is left (open watch streams) on exit.
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._failure = exc
        finally:
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._handler = _FixedEmulator()
        # kmock's bundled k3s 1.26 resource list (what `load_bundled()` reads, without its
        # deprecated importlib call, which the test run's warnings filter would turn fatal).
        bundled = importlib.resources.files("kmock._internal") / "resources.json.gz"
        self._handler.resources.load_data(gzip.decompress(bundled.read_bytes()))
        async with self._handler, kmock.Server(self._handler) as server:
            self.url = str(server.url).rstrip("/")
            write_kubeconfig(self.kubeconfig, self.url)
            self._started.set()
            await self._stop.wait()
            # Helm's readiness watcher leaves watch streams open, which never end by
            # themselves; aiohttp would wait a minute for them at shutdown. Cut them now.
            runner = server.server.runner
            if runner is not None and runner.server is not None:
                await runner.server.shutdown(0.05)

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(timeout=20) or self._failure is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._failure!r}")

    def stop(self) -> None:
        if self._stop is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=20)


@contextmanager
def running_emulator(tmp: Path) -> Iterator[Emulator]:
    """Start an emulator, write `tmp/kubeconfig` for it, stop it afterwards."""
    tmp.mkdir(parents=True, exist_ok=True)
    emulator = Emulator(tmp / "kubeconfig")
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()
