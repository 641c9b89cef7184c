"""A Kubernetes API emulator on loopback for capability discovery and doctor tests: kmock's
`KubernetesEmulator` (a real aiohttp server, objects kept in memory), run on its own event
loop in a background thread, with a kubeconfig pointing at it.

The real control plane (tools/kube, tests/reconciler/kubekit.py) is what the Helm driver,
discovery and the doctor are tested against; this emulator stays for what that one cannot
produce on demand: recorded clusters of other distributions (their `/version`, discovery
documents and node objects, served as recorded) and faults such as expired continue tokens.

It serves recorded objects (`load`, `remove`), recorded `/version`, `/api` and `/apis`
bodies (`set_version`, `set_discovery`), answers 403 like RBAC for chosen resources or paths
(`forbid`, `allow`), honours `limit`/`continue` pagination and the `field=value` /
`field!=value` field selectors the real server offers for pods, and expires continue tokens
(410) on demand. `set_text` serves plain-text answers such as the API server's /livez and
/readyz (kmock answers 404 for them). It has no RBAC, scheduler or controllers: nothing it
serves changes unless a test changes it.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.resources
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import yaml

__all__ = ["Emulator", "running_emulator", "write_kubeconfig"]


def _field(obj: Mapping[str, Any], dotted: str) -> str:
    node: Any = obj
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return "" if node is None else str(node)


def _selected(obj: Mapping[str, Any], selector: str) -> bool:
    """`a.b=x,c!=y` as the API server reads field selectors (all terms must hold)."""
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if _field(obj, key) == value:
                return False
        else:
            key, value = term.split("==" if "==" in term else "=", 1)
            if _field(obj, key) != value:
                return False
    return True


def _verb(request: kmock.Request) -> str:
    action = request.action
    return str(action.value).lower() if action is not None else "get"


class _FixedEmulator(kmock.KubernetesEmulator):
    # Discovery extras (plain attributes; set through `Emulator`).
    version_info: dict[str, Any] | None = None
    api_versions: dict[str, Any] | None = None
    api_groups: dict[str, Any] | None = None
    forbidden: frozenset[Any] = frozenset()
    expire_continue: bool = False
    texts: dict[str, tuple[int, str]] | None = None

    def _denied(self, request: kmock.Request) -> bool:
        path = request.url.path
        return any(path == target if isinstance(target, str) else request.resource == target
                   for target in self.forbidden)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._denied(request):
            what = request.resource.plural if request.resource is not None else request.url.path
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "reason": "Forbidden", "code": 403,
                "message": f'{what} is forbidden: User "system:serviceaccount:margo:device" '
                           f"cannot {_verb(request)} {what} at the cluster scope"},
                status=403)
        if self.texts and request.url.path in self.texts:
            status, text = self.texts[request.url.path]
            return aiohttp.web.Response(status=status, text=text)
        if self.expire_continue and request.params.get("continue"):
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "reason": "Expired", "code": 410,
                "message": "The provided continue parameter is too old"}, status=410)
        return await super()._handle(request)

    async def _serve_server_version(self, request: kmock.Request) -> Any:
        if self.version_info is not None:
            return self.version_info
        return await super()._serve_server_version(request)

    async def _serve_api(self, request: kmock.Request) -> Any:
        if self.api_versions is not None:
            return self.api_versions
        return await super()._serve_api(request)

    async def _serve_apis(self, request: kmock.Request) -> Any:
        if self.api_groups is not None:
            return self.api_groups
        return await super()._serve_apis(request)

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        selector = request.params.get("fieldSelector")
        if selector:
            payload["items"] = [i for i in payload["items"] if _selected(i, selector)]
        limit = request.params.get("limit")
        if limit and int(limit) > 0:
            start = int(request.params.get("continue") or 0)
            end = start + int(limit)
            everything = payload["items"]
            payload["items"] = everything[start:end]
            if end < len(everything):
                payload["metadata"] = {**payload.get("metadata", {}), "continue": str(end)}
        return payload


def _target(text: str) -> Any:
    return text if text.startswith("/") else kmock.resource(text)


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
    """A running emulator: `url`, `kubeconfig`, and the means to change what it serves."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._handler: _FixedEmulator | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)

    # --- serving recorded clusters ----------------------------------------------------------

    def _call(self, change: Any) -> Any:
        """Run `change(handler)` on the emulator's loop, under its object lock."""
        async def run() -> Any:
            assert self._handler is not None
            async with self._handler._lock:
                return change(self._handler)
        assert self._loop is not None, "the emulator is not running"
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def load(self, resource: str, *documents: Mapping[str, Any]) -> list[str]:
        """Store objects of `resource` (`v1/nodes`, `apps/v1/daemonsets`): each document is
        an object or a list (`NodeList`, `kubectl get -o json`'s `List`) whose items are
        stored. Replaces objects of the same name. Returns the names stored."""
        objects = [item for doc in documents
                   for item in (doc.get("items") or [] if "items" in doc else [doc])]

        def store(handler: _FixedEmulator) -> list[str]:
            names = []
            for obj in objects:
                metadata = obj.get("metadata") or {}
                key = (resource, metadata.get("namespace"), metadata["name"])
                handler.objects[key] = dict(obj)
                names.append(metadata["name"])
            return names
        return list(self._call(store))

    def remove(self, resource: str, name: str, namespace: str | None = None) -> None:
        """Delete one stored object (as if `kubectl delete` had removed it)."""
        def drop(handler: _FixedEmulator) -> None:
            handler.objects[resource, namespace, name].delete()
        self._call(drop)

    def set_version(self, info: Mapping[str, Any] | None) -> None:
        """Serve `info` at /version (None: kmock's own k3s 1.26 answer)."""
        self._require().version_info = None if info is None else dict(info)

    def set_discovery(self, *, api: Mapping[str, Any] | None = None,
                      apis: Mapping[str, Any] | None = None) -> None:
        """Serve recorded `/api` (APIVersions) and `/apis` (APIGroupList) bodies."""
        handler = self._require()
        handler.api_versions = None if api is None else dict(api)
        handler.api_groups = None if apis is None else dict(apis)

    def forbid(self, *targets: str) -> None:
        """Answer 403 Forbidden for these resources (`v1/pods`) or exact paths (`/apis`)."""
        handler = self._require()
        handler.forbidden = handler.forbidden | {_target(t) for t in targets}

    def allow(self, *targets: str) -> None:
        """Undo `forbid` for these targets."""
        handler = self._require()
        handler.forbidden = handler.forbidden - {_target(t) for t in targets}

    def set_text(self, path: str, status: int, text: str) -> None:
        """Answer GET `path` (any query) with `status` and a text/plain body, as the API
        server's health endpoints do; `forbid(path)` still answers 403 first."""
        handler = self._require()
        handler.texts = {**(handler.texts or {}), path: (status, text)}

    def expire_continue_tokens(self, expire: bool = True) -> None:
        """Answer 410 Expired to every request that carries a continue token."""
        self._require().expire_continue = expire

    def _require(self) -> _FixedEmulator:
        assert self._handler is not None, "the emulator is not running"
        return self._handler

    # --- lifecycle -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
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
