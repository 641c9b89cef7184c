"""The capability snapshot: the latest DeviceCapabilitiesManifest of every device.

Offline compiles read it from a directory (one document per file, any spec shape) or from
one YAML/JSON file keyed by device id; the fleet server builds the same from its database
with `snapshot_from_documents`. A broken document is a located problem and its device is
left alone (its previous desired state stays), never dropped. A cluster proposal's
`ClusterCapabilitiesManifest` is read as the rc.3 document `margo.cluster` converts it to,
exactly as the server stores it, so both bodies of one cluster compile alike.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from margo.cluster import device_capabilities_from_cluster, is_cluster_manifest
from margo.constraints import matching_view
from margo.digests import data_digest
from margo.errors import DocumentError, Problem
from margo.kinds import Kind, detect
from margo.loading import Limits, LoadedDocument, load_path
from margo.models import DeviceCapabilities
from margo.normalize import normalise
from margo.validation import validate_loaded

__all__ = ["Device", "Snapshot", "SnapshotError", "load_snapshot", "snapshot_from_documents"]

_SUFFIXES = (".json", ".yaml", ".yml")
#: One file holding every device of a large fleet is legitimately big (≈1 KiB per device).
KEYED_SNAPSHOT_LIMITS = Limits(max_bytes=256 * 1024 * 1024)


class SnapshotError(RuntimeError):
    """The snapshot as a whole cannot be read."""


@dataclass(frozen=True, slots=True)
class Device:
    id: str
    capabilities: DeviceCapabilities
    digest: str  # sha256 of the document's sorted-key compact JSON: changes iff content does
    file: str | None = None
    #: What constraints and selectors are evaluated against (`margo.constraints.matching_view`:
    #: properties + root extensions + cluster sections), built once per device, not per match.
    matching: Mapping[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "matching", matching_view(self.capabilities.properties,
                                                           self.capabilities.extensions))

    @property
    def properties(self) -> Mapping[str, Any]:
        return self.capabilities.properties

    @property
    def labels(self) -> Mapping[str, Any]:
        return self.capabilities.labels


@dataclass
class Snapshot:
    devices: dict[str, Device] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    broken: set[str] = field(default_factory=set)  # device ids (or file stems) not usable

    @property
    def digest(self) -> str:
        """One digest over every device's document digest (for commit trailers)."""
        h = hashlib.sha256()
        for device_id in sorted(self.devices):
            h.update(f"{device_id}\0{self.devices[device_id].digest}\n".encode())
        return "sha256:" + h.hexdigest()


def _claimed_id(doc: Any) -> str | None:
    properties = doc.get("properties") if isinstance(doc, dict) else None
    claimed = properties.get("id") if isinstance(properties, dict) else None
    return claimed if isinstance(claimed, str) else None


def _trusted_model(doc: Any, digest: str, trusted: Mapping[str, str]) -> DeviceCapabilities | None:
    """The model of a document whose exact content validated before (same digest)."""
    claimed = _claimed_id(doc)
    if claimed is None or trusted.get(claimed) != digest:
        return None
    detection = detect(doc, expect=Kind.DEVICE_CAPABILITIES)
    if detection.kind is None or detection.shape is None:
        return None
    model: DeviceCapabilities = normalise(detection.kind, detection.shape, doc)
    return model


def _from_cluster_manifest(snapshot: Snapshot, loaded: LoadedDocument,
                           key: str | None) -> LoadedDocument | None:
    """The rc.3 document of a cluster manifest; None (problems located) when invalid."""
    try:
        converted = device_capabilities_from_cluster(loaded.value)
    except DocumentError as exc:
        snapshot.problems.extend(loaded.locate(p) for p in exc.problems)
        metadata = loaded.value.get("metadata")
        cluster_id = metadata.get("id") if isinstance(metadata, dict) else None
        snapshot.broken.add(str(cluster_id if isinstance(cluster_id, str) else key))
        return None
    return LoadedDocument.unlocated(converted, loaded.file)


def _add(snapshot: Snapshot, loaded: LoadedDocument, key: str | None,
         trusted: Mapping[str, str]) -> None:
    if is_cluster_manifest(loaded.value):
        converted = _from_cluster_manifest(snapshot, loaded, key)
        if converted is None:
            return
        loaded = converted
    digest = data_digest(loaded.value)
    caps = _trusted_model(loaded.value, digest, trusted) if trusted else None
    if caps is None:
        report = validate_loaded(loaded, expect=Kind.DEVICE_CAPABILITIES)
        if not report.valid:
            snapshot.problems.extend(report.problems)
            snapshot.broken.add(str(_claimed_id(loaded.value) or key))
            return
        caps = report.model
    if key is not None and key != caps.device_id:
        snapshot.problems.append(loaded.locate(Problem(
            ("properties", "id"), f"filed under {key!r} but reports id {caps.device_id!r}",
            expected=key, found=caps.device_id)))
        snapshot.broken.add(key)
        return
    if caps.device_id in snapshot.devices:
        snapshot.problems.append(loaded.locate(Problem(
            ("properties", "id"), f"device {caps.device_id!r} is reported twice (also in "
                                  f"{snapshot.devices[caps.device_id].file})")))
        snapshot.broken.add(caps.device_id)
        return
    snapshot.devices[caps.device_id] = Device(caps.device_id, caps, digest, loaded.file)


def snapshot_from_documents(documents: Mapping[str, Any], *, file: str | None = None,
                            trusted: Mapping[str, str] | None = None) -> Snapshot:
    """A snapshot from already-decoded documents keyed by device id (e.g. the WFM's store)."""
    snapshot = Snapshot()
    for key in sorted(documents):
        _add(snapshot, LoadedDocument.unlocated(documents[key], file), key, trusted or {})
    return snapshot


def load_snapshot(path: str | os.PathLike[str], *,
                  trusted: Mapping[str, str] | None = None) -> Snapshot:
    """A directory of capability documents, or one file mapping device id -> document.

    `trusted` maps device ids to digests of documents that validated before (the
    compiler's state): a document with exactly that content is normalised without
    validating it again, which is what makes a no-op recompile of a large fleet cheap.
    """
    trusted = trusted or {}
    root = Path(path)
    snapshot = Snapshot()
    try:
        if root.is_dir():
            for file in sorted(p for p in root.iterdir() if p.suffix in _SUFFIXES):
                try:
                    _add(snapshot, load_path(str(file)), None, trusted)
                except DocumentError as exc:
                    snapshot.problems.extend(exc.problems)
                    snapshot.broken.add(file.stem)
            return snapshot
        loaded = load_path(str(root), limits=KEYED_SNAPSHOT_LIMITS)
    except DocumentError as exc:
        raise SnapshotError("\n".join(p.format() for p in exc.problems)) from None
    except OSError as exc:
        raise SnapshotError(f"{root}: cannot read: {exc.strerror or exc}") from None
    if not isinstance(loaded.value, dict):
        raise SnapshotError(f"{root}: expected a mapping of device id to capabilities document")
    for key in sorted(loaded.value):
        sub = LoadedDocument(loaded.value[key], loaded.file,
                             _Shifted(loaded, key))  # type: ignore[arg-type]
        _add(snapshot, sub, key, trusted)
    return snapshot


class _Shifted:
    """Positions of a sub-document inside a keyed snapshot file."""

    def __init__(self, parent: LoadedDocument, key: str):
        self.parent, self.key = parent, key

    def value_position(self, path: Any) -> tuple[int, int] | None:
        return self.parent.source.value_position((self.key, *path))

    def key_position(self, path: Any) -> tuple[int, int] | None:
        return self.parent.source.key_position((self.key, *path))
