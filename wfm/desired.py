"""The REST view of the device branches: per-client manifests, YAMLs and bundles.

Both transports serve the same bytes by construction: a deployment's digest is the sha256
of the exact blob on the device's branch, and the bundle is a deterministic tar.gz of
exactly those blobs (named `<deploymentId>.yaml` at the archive root). A client's state is
recomputed only when the fleet's generation changes (a compile finished, a device was
added or removed); polls in between are answered from memory.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import yaml

from compiler.gitstore import CommitInfo, DeviceStore
from margo.archive import deterministic_targz
from margo.canonical import canonical_json
from margo.digests import digest_of

__all__ = ["BUNDLE_MEDIA_TYPE", "ClientState", "DesiredState", "ServedDeployment",
           "manifest_body"]

BUNDLE_MEDIA_TYPE = "application/vnd.margo.bundle.v1+tar+gzip"
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True, slots=True)
class ServedDeployment:
    deployment_id: str
    digest: str
    data: bytes
    device_id: str
    intent: str | None = None
    application_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClientState:
    deployments: tuple[ServedDeployment, ...]
    state_digest: str  # changes iff the set of (deploymentId, digest) changes
    bundle: bytes | None
    bundle_digest: str | None

    def find(self, deployment_id: str, digest: str) -> ServedDeployment | None:
        return next((d for d in self.deployments
                     if d.deployment_id == deployment_id and d.digest == digest), None)


@dataclass(frozen=True, slots=True)
class _Parsed:
    deployment_id: str
    digest: str
    data: bytes
    intent: str | None
    application_id: str | None


def _parse(data: bytes) -> _Parsed | None:
    """What the server needs to know of a deployment document we wrote (any shape)."""
    try:
        doc = yaml.load(data, Loader=_LOADER)
    except yaml.YAMLError:
        return None
    if not isinstance(doc, dict):
        return None
    metadata = doc.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    deployment_id = doc.get("id") or annotations.get("id")
    if not isinstance(deployment_id, str):
        return None
    intent = (metadata.get("labels") or {}).get("margo-gitops.dev/intent")
    application = (doc.get("spec") or {}).get("applicationId") or annotations.get(
        "applicationId")
    return _Parsed(deployment_id, digest_of(data), data, intent, application)


def manifest_body(version: int, state: ClientState, prefix: str) -> bytes:
    """The exact manifest bytes (JCS) for a client; `prefix` is `/api/v1` or the rc.2
    `/api/v1/clients/<id>`."""
    bundle = None
    if state.bundle is not None and state.bundle_digest is not None:
        bundle = {"mediaType": BUNDLE_MEDIA_TYPE, "digest": state.bundle_digest,
                  "url": f"{prefix}/bundles/{state.bundle_digest}",
                  "sizeBytes": len(state.bundle)}
    deployments = [{"deploymentId": d.deployment_id, "digest": d.digest,
                    "url": f"{prefix}/deployments/{d.deployment_id}/{d.digest}",
                    "sizeBytes": len(d.data)} for d in state.deployments]
    return canonical_json({"manifestVersion": version, "bundle": bundle,
                           "deployments": deployments})


class DesiredState:
    """Per-client desired state, derived from the device branches and cached."""

    def __init__(self, store: DeviceStore, *, history: int = 4):
        self._store = store
        self._lock = threading.Lock()
        self._generation = 0
        self._blobs: dict[str, _Parsed | None] = {}  # blob oid -> parsed document
        self._current: dict[str, tuple[int, tuple[str, ...], ClientState]] = {}
        self._recent: dict[str, OrderedDict[str, ClientState]] = {}
        self._history = history

    @property
    def generation(self) -> int:
        return self._generation

    def bump(self) -> None:
        """Something changed in the branches or device ownership: recompute on demand."""
        with self._lock:
            self._generation += 1

    def _served(self, device_id: str) -> list[ServedDeployment]:
        tree = self._store.tree_ids(device_id) or {}
        if any(oid not in self._blobs for oid in tree.values()):
            files = self._store.read_files(device_id) or {}
            for name, oid in tree.items():
                data = files.get(name)
                self._blobs[oid] = _parse(data) if data is not None else None
        out = []
        for name in sorted(tree):
            parsed = self._blobs[tree[name]]
            if parsed is not None:
                out.append(ServedDeployment(parsed.deployment_id, parsed.digest, parsed.data,
                                            device_id, parsed.intent, parsed.application_id))
        return out

    def history(self, device_id: str, limit: int = 20) -> list[CommitInfo]:
        """The device branch's newest commits (what changed, and why)."""
        return self._store.history(device_id, limit=limit)

    def device_deployments(self, device_id: str) -> list[ServedDeployment]:
        """What a device's branch holds now (for people: the read API, the dashboard)."""
        return self._served(device_id)

    def client_state(self, client_id: str, device_ids: tuple[str, ...]) -> ClientState:
        cached = self._current.get(client_id)
        if cached and cached[0] == self._generation and cached[1] == device_ids:
            return cached[2]
        generation = self._generation
        deployments = sorted((d for device_id in device_ids for d in self._served(device_id)),
                             key=lambda d: (d.deployment_id, d.digest))
        refs = [[d.deployment_id, d.digest] for d in deployments]
        state_digest = "sha256:" + hashlib.sha256(canonical_json(refs)).hexdigest()
        previous = cached[2] if cached else None
        if previous is not None and previous.state_digest == state_digest:
            state = previous
        elif deployments:
            bundle = deterministic_targz({f"{d.deployment_id}.yaml": d.data
                                          for d in deployments})
            state = ClientState(tuple(deployments), state_digest, bundle, digest_of(bundle))
        else:
            state = ClientState((), state_digest, None, None)
        self._current[client_id] = (generation, device_ids, state)
        recent = self._recent.setdefault(client_id, OrderedDict())
        recent[state.state_digest] = state
        recent.move_to_end(state.state_digest)
        while len(recent) > self._history:
            recent.popitem(last=False)
        return state

    def find_in_history(self, device_ids: tuple[str, ...], deployment_id: str, digest: str,
                        *, depth: int = 8) -> bytes | None:
        """A deployment document that one of the devices' last `depth` commits held, by its
        id and digest: what a manifest served by another replica (or before a restart) may
        still name when this process never computed that state."""
        for device_id in device_ids:
            for commit in self._store.history(device_id, limit=depth):
                files = self._store.read_files(device_id, commit.id) or {}
                for data in files.values():
                    if digest_of(data) == digest:
                        parsed = _parse(data)
                        if parsed is not None and parsed.deployment_id == deployment_id:
                            return data
        return None

    def recent_states(self, client_id: str) -> list[ClientState]:
        """The client's current and a few previous states (a device may still be fetching
        what the previous manifest named when a new compile lands)."""
        return list(reversed(self._recent.get(client_id, OrderedDict()).values()))
