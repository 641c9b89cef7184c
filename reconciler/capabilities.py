"""What the device tells the server about itself: DeviceCapabilitiesManifest providers and the
sender that reports them only when they change.

Providers gather an rc.3-shaped document (no `apiVersion`/`kind`: the official rc.3 schema is
`additionalProperties: false` and does not list them). The sender shapes it for the server's
generation: rc.2 requires `apiVersion`/`kind`; an Oct-2024 server expects `roles` and
`resources` instead of the flat rc.3 properties (an operator's file already in the Oct-2024
shape is sent to it as written). Placement on the server depends on these
facts, and the spec requires re-reporting on any change, so the sender compares a digest of
what it would send with the last one the server acknowledged (stored durably) and sends only
on a difference.

The Kubernetes cluster provider (nodes, GPUs, API surface, classes) implements the same
`CapabilityProvider` protocol in `reconciler/kubernetes/provider.py`.

Whatever the provider, the device client adds its encryption key (`KeyReporting`): root
`x-margo-gitops-extensions.encryptionKey = {"type": "age-x25519", "recipient": "age1..."}`
(`margo.sealing.key_report`), merged into the extension the provider may already fill (the
cluster's `cluster`), in every generation. The server seals sensitive parameter values to
that recipient. The report's own authentication (rc.3 mutual TLS, rc.2 signature, the
device's token) is what binds the key to the device; a rotated key changes the document's
digest, so it is reported at the next cycle.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from margo.digests import data_digest
from margo.errors import DocumentError
from margo.kinds import Kind, Shape, detect
from margo.normalize import normalise_architecture
from margo.sealing import EXTENSION, key_report
from margo.validation import validate_file, validate_value
from reconciler.delivery import UNCHANGED, Outcome, send_json
from reconciler.state import DeviceState
from reconciler.statuses import GENERATIONS

__all__ = ["CAPABILITIES_API_VERSION", "CapabilityProvider", "CapabilityReporter",
           "HostProvider", "KeyReporting", "StaticProvider", "capabilities_path", "format_bytes",
           "report_all", "shape_capabilities", "with_encryption_key"]

CAPABILITIES_API_VERSION = "device.margo.org/v1alpha1"
CAPABILITIES_KIND = "DeviceCapabilitiesManifest"
_ARM32 = {"armv6l", "armv7l", "armv7", "armv8l", "armhf", "arm"}
#: Oct-2024 roles for the deployment types a device supports.
_OCT_2024_ROLES = {"helm": "Standalone Cluster", "compose": "Standalone Device"}
#: Root extension members, which every generation's schema allows.
_ROOT_EXTENSION = re.compile(r"x-[a-z][a-z0-9-]*-extensions")


class CapabilityProvider(Protocol):
    """Anything that can describe the device as a DeviceCapabilitiesManifest (rc.3 shape)."""

    def gather(self) -> dict[str, Any]:
        """The current document; raises `DocumentError` when it would not be valid."""
        ...


def _plain(doc: Any) -> dict[str, Any]:
    """A deep, JSON-only copy (what is sent and digested must be plain data)."""
    copied: dict[str, Any] = json.loads(json.dumps(doc))
    return copied


class StaticProvider:
    """Capabilities written by the operator in a JSON or YAML file (a device whose facts
    cannot be discovered, or that must report a Margo-reserved subset of its resources)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def gather(self) -> dict[str, Any]:
        """The file's document, validated; `DocumentError` with line and column of every
        problem when invalid; `OSError` when unreadable (not the same thing as invalid)."""
        report = validate_file(str(self.path), expect=Kind.DEVICE_CAPABILITIES)
        if report.problems:
            raise DocumentError(report.problems)
        return _plain(report.document)


def with_encryption_key(doc: Mapping[str, Any], recipient: str) -> dict[str, Any]:
    """`doc` with the device's encryption key in its root extension, beside what the
    extension already holds."""
    out = _plain(doc)
    extension = out.get(EXTENSION)
    out[EXTENSION] = {**(extension if isinstance(extension, dict) else {}),
                      **key_report(recipient)}
    return out


class KeyReporting:
    """Any provider's document with the device's encryption key added (`recipient` is
    asked at every gather, so a rotated key is reported at the next cycle)."""

    def __init__(self, provider: CapabilityProvider, recipient: Callable[[], str]) -> None:
        self.provider = provider
        self.recipient = recipient

    def gather(self) -> dict[str, Any]:
        return with_encryption_key(self.provider.gather(), self.recipient())


def format_bytes(size: int) -> str:
    """A byte count as the spec's examples write it (`"59 Gi"`), rounded down so the device
    never claims more than it has: whole GiB from 10 GiB up (less than 10% lost), else MiB."""
    gib, mib = 1024**3, 1024**2
    if size >= 10 * gib:
        return f"{size // gib} Gi"
    return f"{size // mib} Mi"


def _architecture(machine: str) -> str | None:
    name = normalise_architecture(machine.lower())
    if name in ("amd64", "arm64"):
        return name
    if name in _ARM32:
        return "arm"
    return None  # riscv64 and others: the schema has no word for them, so say nothing


def _memory_total(meminfo: Path) -> int:
    """MemTotal from /proc/meminfo, in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            return int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    raise ValueError(f"{meminfo}: no MemTotal line")


def _interfaces(net: Path) -> list[dict[str, str]]:
    """Network interfaces from /sys/class/net: `wifi` when the kernel marks it wireless,
    `ethernet` for other Ethernet-type links; loopback and non-Ethernet links (tunnels) are
    skipped. Virtual links (bridges, veths) count only when no physical one exists, as in a
    container, where the only link is virtual but still the device's way out."""
    physical: list[dict[str, str]] = []
    virtual: list[dict[str, str]] = []
    for link in sorted(net.iterdir()) if net.is_dir() else []:
        if link.name == "lo":
            continue
        if (link / "wireless").exists() or (link / "phy80211").exists():
            kind = "wifi"
        else:
            try:
                link_type = (link / "type").read_text().strip()
            except OSError:
                continue
            if link_type != "1":  # ARPHRD_ETHER
                continue
            kind = "ethernet"
        is_physical = (link / "device").exists()
        (physical if is_physical else virtual).append({"type": kind})
    return physical or virtual


class HostProvider:
    """The real facts of the machine the client runs on, plus what the operator declares
    (identity, supported deployment types and runtimes, labels). `otel_collector` may be
    a probe, asked at every gather (`reconciler.telemetry.probe`: does the configured
    collector answer)."""

    def __init__(self, device_id: str, *, vendor: str, model_number: str, serial_number: str,
                 deployment_types: Sequence[str], runtimes: Sequence[str] = ("oci",),
                 otel_collector: bool | Callable[[], bool],
                 labels: Mapping[str, Any] | None = None,
                 storage_path: Path, proc_meminfo: Path = Path("/proc/meminfo"),
                 sys_class_net: Path = Path("/sys/class/net"),
                 machine: Callable[[], str] = platform.machine) -> None:
        self.device_id = device_id
        self.vendor, self.model_number, self.serial_number = vendor, model_number, serial_number
        self.deployment_types = list(deployment_types)
        self.runtimes = list(runtimes)
        self.otel_collector = otel_collector
        self.labels = dict(labels or {})
        self.storage_path = Path(storage_path)
        self.proc_meminfo = Path(proc_meminfo)
        self.sys_class_net = Path(sys_class_net)
        self.machine = machine

    def _cpus(self) -> list[dict[str, Any]]:
        cpu: dict[str, Any] = {"cores": os.cpu_count() or 1}
        architecture = _architecture(self.machine())
        if architecture is not None:
            cpu["architecture"] = architecture
        return [cpu]

    def _storage(self) -> str:
        """The size of the file system holding `storage_path`; before the client first
        made it (a fresh device), of the one it will be made on: its nearest existing
        parent's. Nothing is created."""
        path = self.storage_path.absolute()
        while not path.exists() and path != path.parent:
            path = path.parent
        stats = os.statvfs(path)
        return format_bytes(stats.f_frsize * stats.f_blocks)

    def gather(self) -> dict[str, Any]:
        """The document, validated (`DocumentError` when, say, a deployment type is unknown)."""
        properties: dict[str, Any] = {
            "id": self.device_id, "vendor": self.vendor, "modelNumber": self.model_number,
            "serialNumber": self.serial_number, "cpus": self._cpus(),
            "memory": format_bytes(_memory_total(self.proc_meminfo)),
            "storage": self._storage(), "peripherals": [],
            "interfaces": _interfaces(self.sys_class_net),
            "otelCollector": (self.otel_collector() if callable(self.otel_collector)
                              else self.otel_collector),
            "supportedRuntimes": self.runtimes,
            "supportedDeploymentTypes": self.deployment_types}
        doc: dict[str, Any] = {"properties": properties}
        if self.labels:
            doc["labels"] = dict(sorted(self.labels.items()))
        doc = _plain(doc)
        validate_value(doc, expect=Kind.DEVICE_CAPABILITIES, file="host capabilities")
        return doc


def _oct_2024(doc: dict[str, Any]) -> dict[str, Any]:
    """The document for an Oct-2024 server: one already in that shape (an operator's file
    with `roles` and `resources`) as it is, validated; rc.3 properties converted to `roles` +
    `resources` (labels and runtimes did not exist; root `x-*-extensions`, which its schema
    allows, are kept)."""
    if detect(doc, expect=Kind.DEVICE_CAPABILITIES).shape == Shape.OCT_2024:
        validate_value(doc, expect=Kind.DEVICE_CAPABILITIES, file="capabilities")
        return doc
    props = doc["properties"]
    roles = [_OCT_2024_ROLES[t] for t in props.get("supportedDeploymentTypes", [])
             if t in _OCT_2024_ROLES]
    if not roles:
        raise ValueError("an Oct-2024 server needs a role, and only helm or compose "
                         "deployment types map to one (or write the capabilities file in "
                         "the Oct-2024 shape, with roles and resources)")
    out: dict[str, Any] = {k: props[k] for k in ("id", "vendor", "modelNumber", "serialNumber")}
    out["roles"] = roles
    resources: dict[str, Any] = {}
    cpus = props.get("cpus") or []
    if cpus:
        cpu: dict[str, Any] = {"cores": sum(c["cores"] for c in cpus)}
        architectures = sorted({c["architecture"] for c in cpus if "architecture" in c})
        if architectures:
            cpu["architectures"] = architectures
        resources["cpu"] = cpu
    for key in ("memory", "storage", "peripherals", "interfaces"):
        if key in props:
            resources[key] = props[key]
    out["resources"] = resources
    extensions = {key: value for key, value in doc.items() if _ROOT_EXTENSION.fullmatch(key)}
    return {"apiVersion": CAPABILITIES_API_VERSION, "kind": CAPABILITIES_KIND,
            "properties": out, **extensions}


def shape_capabilities(doc: Mapping[str, Any], generation: str) -> dict[str, Any]:
    """The document as `generation` wants it. rc.3: without `apiVersion`/`kind`; rc.2: with
    them (labels are kept although rc.2 has no such field: our server places by them);
    oct-2024: roles and resources (a document already in that shape is sent as it is)."""
    if generation not in GENERATIONS:
        raise ValueError(f"unknown API generation {generation!r}")
    body = _plain(doc)
    if generation == Shape.OCT_2024:
        return _oct_2024(body)
    body.pop("apiVersion", None)
    body.pop("kind", None)
    if generation == Shape.RC3:
        return body
    return {"apiVersion": CAPABILITIES_API_VERSION, "kind": CAPABILITIES_KIND, **body}


def capabilities_path(generation: str, *, device_id: str, client_id: str | None) -> str:
    """Where `generation` takes capabilities (all by PUT, which every generation has)."""
    device = quote(device_id, safe="/")
    if generation == Shape.RC3:
        return f"/api/v1/capabilities/{device}"
    if generation == Shape.RC2:
        if not client_id:
            raise ValueError("rc.2 capability paths need the clientId from onboarding")
        return f"/api/v1/clients/{quote(client_id, safe='')}/capabilities/{device}"
    if generation == Shape.OCT_2024:
        return f"/device/{device}/capabilities"
    raise ValueError(f"unknown API generation {generation!r}")


class CapabilityReporter:
    """Sends one device's capabilities when they differ from what the server acknowledged.

    The acknowledged digest lives in `DeviceState` under `capabilities.digest/<deviceId>` (one
    key per device, so a gateway reporting itself and its children does not re-send every
    document each time). It covers the method, path and exact body, so moving to another
    server generation also re-sends. It is stored only after a 2xx: a failed or unanswered
    report is sent again next time."""

    def __init__(self, client: httpx.Client, state: DeviceState, *, generation: str,
                 device_id: str, client_id: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.state, self.clock = client, state, clock
        self.generation, self.device_id = generation, device_id
        self.path = capabilities_path(generation, device_id=device_id, client_id=client_id)
        self.key = f"capabilities.digest/{device_id}"

    def report(self, doc: Mapping[str, Any], *, force: bool = False) -> Outcome:
        """PUT the document unless unchanged (`Outcome.kind == "unchanged"`, nothing sent).
        Never raises for HTTP or network trouble: the outcome says what happened."""
        properties = doc.get("properties")
        if not isinstance(properties, Mapping) or properties.get("id") != self.device_id:
            raise ValueError(f"capabilities for {self.device_id!r} must have properties.id "
                             f"{self.device_id!r}")
        body = shape_capabilities(doc, self.generation)
        digest = data_digest({"method": "PUT", "path": self.path, "body": body})
        if not force and self.state.get(self.key) == digest:
            return Outcome(UNCHANGED)
        outcome = send_json(self.client, "PUT", self.path, body, now=self.clock())
        if outcome.kind == "delivered":
            self.state.set(self.key, digest)
        return outcome

    def acknowledged(self) -> str | None:
        """The digest the server last acknowledged, if any."""
        return self.state.get(self.key)


def report_all(reporters: Iterable[tuple[CapabilityReporter, CapabilityProvider]],
               *, force: bool = False) -> list[Outcome]:
    """Report several devices in order (a gateway first, then its children), stopping at the
    first failure: a child before its parent would only be refused."""
    outcomes: list[Outcome] = []
    for reporter, provider in reporters:
        outcome = reporter.report(provider.gather(), force=force)
        outcomes.append(outcome)
        if not outcome.ok:
            break
    return outcomes
