"""The REST view of the device branches: per-client manifests, YAMLs and bundles.

Both transports serve the same bytes by construction: a deployment's digest is the sha256
of the exact blob on the device's branch, and the bundle is a deterministic tar.gz of
exactly those blobs (named `<deploymentId>.yaml` at the archive root). A client's state is
recomputed only when the fleet's generation changes (a compile finished, a device was
added or removed); polls in between are answered from memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pygit2
import yaml

from compiler.gitstore import CommitInfo, DeviceStore, GitStoreError
from compiler.recorded import recorded_branch
from compiler.state import STATE_FILE_NAME, CompilerState
from margo.archive import deterministic_targz
from margo.canonical import canonical_json
from margo.digests import digest_of, sorted_json
from wfm.problems import ProblemError

__all__ = ["BUNDLE_MEDIA_TYPE", "STATE_LOST_RETRY", "ClientState", "DesiredState",
           "ServedDeployment", "StateLost", "manifest_body"]
#: What reading a branch raises when it cannot be read (a damaged or half-synced store).
_UNREADABLE = (GitStoreError, pygit2.GitError, KeyError, ValueError)

BUNDLE_MEDIA_TYPE = "application/vnd.margo.bundle.v1+tar+gzip"
#: Seconds a device is told to wait before asking again for a state the server lost.
STATE_LOST_RETRY = 60
#: (device, commit) pairs whose contents `DesiredState.deployments_at` keeps.
_AT_COMMIT_KEPT = 4096
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
log = logging.getLogger("margo.wfm.desired")


class StateLost(ProblemError):
    """A device's branch is missing or unreadable although the compiler gave it one: its
    desired state is LOST, not empty. Served as "no deployments" it would make the device
    uninstall everything (and a higher manifestVersion would make that stick), so whatever
    would serve it answers 503 with Retry-After instead, until the repository is repaired
    or a compile rebuilds the branch."""

    def __init__(self, device_id: str, why: str) -> None:
        super().__init__(503, f"the desired state of device {device_id!r} is not available: "
                         f"{why}; the server's repository needs repair (a compile rebuilds "
                         "the branch from the fleet source); nothing was changed on the "
                         "device's side, ask again later", retry_after=STATE_LOST_RETRY)
        self.device_id = device_id


class ServedDeployment:
    """One deployment document as served to a device. Its intent and application id are
    read from the document on first use: the manifest path needs only the id and digest."""

    __slots__ = ("_document", "device_id")

    def __init__(self, document: _Document, device_id: str):
        self._document = document
        self.device_id = device_id

    @property
    def deployment_id(self) -> str:
        return self._document.deployment_id

    @property
    def digest(self) -> str:
        return self._document.digest

    @property
    def data(self) -> bytes:
        return self._document.data

    @property
    def names_device(self) -> bool:
        return self._document.names_device

    @property
    def intent(self) -> str | None:
        return self._document.details()[0]

    @property
    def application_id(self) -> str | None:
        return self._document.details()[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServedDeployment) and other.device_id == self.device_id \
            and other.data == self.data

    def __hash__(self) -> int:
        return hash((self.device_id, self.digest))

    def __repr__(self) -> str:
        return (f"ServedDeployment({self.deployment_id!r}, {self.digest!r}, "
                f"device_id={self.device_id!r})")


@dataclass(frozen=True, slots=True)
class ClientState:
    deployments: tuple[ServedDeployment, ...]
    state_digest: str  # changes iff the set of (deploymentId, digest) changes
    bundle: bytes | None
    bundle_digest: str | None

    def find(self, deployment_id: str, digest: str) -> ServedDeployment | None:
        return next((d for d in self.deployments
                     if d.deployment_id == deployment_id and d.digest == digest), None)


#: How our own emitter (`margo.canonical`) begins an rc.3, an rc.2 and an Oct-2024
#: deployment document: the id is the first key of the top-level block mapping (rc.3), the
#: third, after apiVersion and kind (rc.2), or the first annotation (Oct-2024), as a plain
#: scalar. A match is exactly what a YAML reader would take as the id; anything else is
#: read in full.
_HEADS = (
    re.compile(rb"id: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\n"
               rb"metadata:\n"),
    re.compile(rb"apiVersion: application\.margo\.org/v1alpha1\nkind: ApplicationDeployment\n"
               rb"id: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\n"
               rb"metadata:\n"),
    re.compile(rb"apiVersion: application\.margo\.org/v1alpha1\nkind: ApplicationDeployment\n"
               rb"metadata:\n  annotations:\n    id: "
               rb"([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\n"),
)


class _Document:
    """A deployment document we wrote, with what the server needs to know of it. Serving a
    fleet's manifests after a compile means one of these per device: the id comes from the
    document's first lines when our emitter wrote them (no YAML parse), the rest (intent,
    application) is parsed when a person's view first asks for it."""

    __slots__ = ("_details", "data", "deployment_id", "digest", "names_device")

    def __init__(self, deployment_id: str, data: bytes, *, names_device: bool,
                 details: tuple[str | None, str | None] | None = None):
        self.deployment_id = deployment_id
        self.digest = digest_of(data)
        self.data = data
        #: Whether the document says which device it is for (rc.3 and rc.2 shapes do, in
        #: `metadata.deviceId`; an Oct-2024 document cannot).
        self.names_device = names_device
        self._details = details

    @classmethod
    def read(cls, data: bytes) -> _Document | None:
        """None when this is not a deployment document with an id (any shape)."""
        for head, names_device in zip(_HEADS, (True, True, False), strict=True):
            match = head.match(data)
            if match is not None:
                return cls(match.group(1).decode("ascii"), data, names_device=names_device)
        doc = _load(data)
        if doc is None:
            return None
        deployment_id = doc.get("id") or (_annotations(doc)).get("id")
        if not isinstance(deployment_id, str):
            return None
        metadata = doc.get("metadata")
        names_device = isinstance(metadata, dict) and isinstance(metadata.get("deviceId"), str)
        return cls(deployment_id, data, names_device=names_device, details=_details(doc))

    def details(self) -> tuple[str | None, str | None]:
        """(intent, application id), as the document says."""
        if self._details is None:
            doc = _load(self.data)
            self._details = _details(doc) if doc is not None else (None, None)
        return self._details


def _shared_manifest(device_ids: tuple[str, ...],
                     served: Callable[[str], list[ServedDeployment]]
                     ) -> Iterator[ServedDeployment]:
    """The documents of a client's REST manifest. Every device of the client reads the same
    manifest and keeps the documents naming it (`metadata.deviceId`), so with several
    devices a document that names none (Oct-2024's shape: a device that fetches its own Git
    branch) would be taken by every sibling: it stays on its branch only. A client with one
    device gets all its documents, whatever their shape (an intent may force Oct-2024's)."""
    for device_id in device_ids:
        for deployment in served(device_id):
            if len(device_ids) == 1 or deployment.names_device:
                yield deployment


def _load(data: bytes) -> dict[str, Any] | None:
    try:
        doc = yaml.load(data, Loader=_LOADER)
    except yaml.YAMLError:
        return None
    return doc if isinstance(doc, dict) else None


def _annotations(doc: dict[str, Any]) -> dict[str, Any]:
    metadata = doc.get("metadata") or {}
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    return annotations if isinstance(annotations, dict) else {}


def _details(doc: dict[str, Any]) -> tuple[str | None, str | None]:
    metadata = doc.get("metadata")
    labels = (metadata.get("labels") if isinstance(metadata, dict) else None) or {}
    intent = labels.get("margo-gitops.dev/intent") if isinstance(labels, dict) else None
    spec = doc.get("spec")
    application = (spec.get("applicationId") if isinstance(spec, dict) else None) or \
        _annotations(doc).get("applicationId")
    return (intent if isinstance(intent, str) else None,
            application if isinstance(application, str) else None)


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
    # The JCS of this document (`canonical_json`) is its sorted-key compact JSON: JCS
    # differs from that only in the order of non-ASCII keys and in how floats are written,
    # and its keys are ASCII and its numbers integers. One C call, where the walk in
    # Python was a tenth of a held poll's answer when a change reaches every device.
    return sorted_json({"manifestVersion": version, "bundle": bundle,
                        "deployments": deployments}).encode("utf-8")


class DesiredState:
    """Per-client desired state, derived from the device branches and cached."""

    def __init__(self, store: DeviceStore, *, history: int = 4,
                 recorded: Callable[[str], str | None] | None = None,
                 on_lost: Callable[[str], None] | None = None):
        """`recorded(device_id)`: where the device's branch should be when it is missing
        here (None: it has none, so no desired state yet); by default what the compiler's
        state next to the repository says (`compiler.recorded.recorded_branch`), while a
        replica asks what was published. `on_lost(device_id)` is told of each lost branch
        (a replica repairs its copy from what was published)."""
        self._store = store
        self._recorded = recorded or (
            lambda device_id: recorded_branch(store.path.parent, device_id))
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._generation = 0
        # blob oid -> document: what the branches hold now, and what they held before the
        # last change (kept so a change that leaves most blobs alone reads none again).
        self._blobs: dict[str, _Document | None] = {}
        self._older_blobs: dict[str, _Document | None] = {}
        self._current: dict[str, tuple[int, tuple[str, ...], ClientState]] = {}
        self._recent: dict[str, OrderedDict[str, ClientState]] = {}
        self._history = history
        self._reported_lost: set[str] = set()  # devices whose lost state was logged
        #: (device, commit) -> what the commit held (`deployments_at`), newest used last.
        self._at_commit: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()

    @property
    def generation(self) -> int:
        return self._generation

    def bump(self) -> None:
        """Something changed in the branches or device ownership: recompute on demand."""
        with self._lock:
            self._generation += 1
            self._older_blobs, self._blobs = self._blobs, {}

    def _served(self, device_id: str) -> list[ServedDeployment]:
        tree = self._tree_ids(device_id)
        if tree is None:
            lost = self.missing_branch(device_id)
            if lost is not None:
                raise lost
            # Read again: a compile may have moved the branches since (`missing_branch`).
            tree = self._tree_ids(device_id) or {}  # still none: not compiled yet, empty
        else:
            self._reported_lost.discard(device_id)
        blobs, older = self._blobs, self._older_blobs
        missing = [oid for oid in tree.values() if oid not in blobs]
        for oid in missing:
            if oid in older:
                blobs[oid] = older[oid]
        if any(oid not in blobs for oid in missing):
            files = self._store.read_files(device_id) or {}
            for name, oid in tree.items():
                if oid not in blobs:
                    data = files.get(name)
                    blobs[oid] = _Document.read(data) if data is not None else None
        out = []
        for name in sorted(tree):
            document = blobs.get(tree[name])
            if document is not None:
                out.append(ServedDeployment(document, device_id))
        return out

    def missing_branch(self, device_id: str) -> StateLost | None:
        """For a device without a branch in the served repository: the lost-state error
        when a compile (or, on a replica, a publication this replica has synced) gave it
        one, reported like every lost branch; None when it has none yet. Git hosting
        (`wfm.git.githttp`) asks this too, so both transports tell lost state apart from no
        state the same way, on one server and on replicas."""
        recorded = self._recorded(device_id)
        if recorded is None:
            return None
        with contextlib.suppress(*_UNREADABLE):
            if self._store.tree_ids(device_id) is not None:
                # The branch was read before a compile moved the branches and the
                # compiler's state after it committed (a device's first compile: both
                # within milliseconds). Not lost: the caller reads the branch again.
                return None
        return self._lost(device_id, f"its branch is missing from the repository (the last "
                          f"compile left it at {recorded})")

    def _tree_ids(self, device_id: str) -> dict[str, str] | None:
        """The device branch's files (name -> blob id), None without a branch."""
        try:
            return self._store.tree_ids(device_id)
        except _UNREADABLE as exc:
            raise self._lost(device_id, f"its branch cannot be read ({exc})") from None

    def _lost(self, device_id: str, why: str) -> StateLost:
        """The 503 for a device whose state is lost, logged as an error once (until its
        branch is back): every poll of that device meets it."""
        if device_id not in self._reported_lost:
            self._reported_lost.add(device_id)
            log.error("device %r: %s in %s; it is answered 503 until the branch is back "
                      "(restore the repository's refs, or let a compile rebuild it)",
                      device_id, why, self._store.path)
        if self._on_lost is not None:
            self._on_lost(device_id)
        return StateLost(device_id, why)

    def forget_devices(self, device_ids: list[str], *, timeout: float = 30.0) -> list[str]:
        """Delete these devices' branches and what the compiler remembers of them, under
        the compile lock; the devices that had a branch. Why: the id may be registered
        again, by another client, whose branch must start from nothing (no parent commit,
        no previous owner's history or parameter values). GitStoreError when the lock is
        not had within `timeout` seconds (nothing deleted)."""
        with self._store.lock(timeout=timeout):
            deleted = self._store.delete_branches(device_ids)
            state_file = self._store.path.parent / STATE_FILE_NAME
            if state_file.exists():
                state = CompilerState(state_file)
                try:
                    state.forget(device_ids)
                finally:
                    state.close()
        self.bump()
        return sorted(deleted)

    def history(self, device_id: str, limit: int = 20) -> list[CommitInfo]:
        """The device branch's newest commits (what changed, and why)."""
        return self._store.history(device_id, limit=limit)

    def device_deployments(self, device_id: str) -> list[ServedDeployment]:
        """What a device's branch holds now (for people: the read API, the dashboard; and
        for the rollout controller). A device whose state is lost shows nothing here (the
        error is logged; what the device itself is served answers 503): the rollout
        controller runs just before each compile, and a raise there would keep the compile
        that rebuilds the branch from ever running."""
        try:
            return self._served(device_id)
        except StateLost:
            return []

    def client_state(self, client_id: str, device_ids: tuple[str, ...]) -> ClientState:
        cached = self._current.get(client_id)
        if cached and cached[0] == self._generation and cached[1] == device_ids:
            return cached[2]
        generation = self._generation
        deployments = sorted(_shared_manifest(device_ids, self._served),
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
                        document = _Document.read(data)
                        if document is not None and document.deployment_id == deployment_id:
                            return data
        return None

    def deployments_at(self, device_id: str, commit: str) -> dict[str, str] | None:
        """What the device's branch held at `commit` (deployment id -> digest), or None when
        that is not a commit of the device's branch here: a status report that names the
        commit it applied (`wfm.fleet.attribution`) is attributed to those bytes. Only the
        device's own branch is read, so one device's report can never name another's
        state. Kept per (device, commit): a commit never changes."""
        key = (device_id, commit)
        with self._lock:
            if key in self._at_commit:
                self._at_commit.move_to_end(key)
                return self._at_commit[key]
        try:
            files = self._store.read_files(device_id, commit)
        except _UNREADABLE:
            files = None
        if files is None:  # (not kept: a replica may not have synced the commit yet)
            return None
        documents = (_Document.read(data) for data in files.values())
        held = {d.deployment_id: d.digest for d in documents if d is not None}
        with self._lock:
            self._at_commit[key] = held
            while len(self._at_commit) > _AT_COMMIT_KEPT:
                self._at_commit.popitem(last=False)
        return held

    def recent_states(self, client_id: str) -> list[ClientState]:
        """The client's current and a few previous states (a device may still be fetching
        what the previous manifest named when a new compile lands)."""
        return list(reversed(self._recent.get(client_id, OrderedDict()).values()))
