"""Builders for small fleets in tests: write a source directory and a capability snapshot,
compile them through the real Git store and state, and read the device trees back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.compilation import CompileReport, compile_fleet
from compiler.gitstore import DeviceStore
from compiler.secrets import FleetKey
from compiler.snapshot import load_snapshot
from compiler.source import load_source
from compiler.state import CompilerState
from margo.canonical import canonical_yaml


def app(app_id: str = "com-example-app", version: str = "1.0.0", *,
        constraints: dict[str, Any] | None = None, revision: str = "1.0.0",
        parameters: dict[str, Any] | None = None,
        schema: list[dict[str, Any]] | None = None,
        settings: list[dict[str, Any]] | None = None,
        compose: bool = True) -> dict[str, Any]:
    helm_profile: dict[str, Any] = {
        "type": "helm", "id": f"{app_id}-helm",
        "components": [{"name": "web", "properties": {
            "repository": "oci://registry.example.com/charts/web", "revision": revision}}],
    }
    if constraints is not None:
        helm_profile["deviceConstraints"] = constraints
    profiles = [helm_profile]
    if compose:
        profiles.append({"type": "compose", "id": f"{app_id}-compose", "components": [
            {"name": "web-compose", "properties": {
                "repository": "oci://registry.example.com/compose/web", "revision": revision}}]})
    doc: dict[str, Any] = {
        "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription", "id": app_id,
        "metadata": {"name": app_id, "version": version,
                     "catalog": {"organization": [{"name": "Example"}]}},
        "deploymentProfiles": profiles,
        "parameters": parameters if parameters is not None else {
            "greeting": {"value": "hello", "targets": [
                {"pointer": "config.greeting", "components": ["web"]},
                {"pointer": "GREETING", "components": ["web-compose"]}]}},
    }
    if schema is not None:
        doc["configuration"] = {"sections": [{"name": "All", "settings": settings or []}],
                                "schema": schema}
    return doc


def intent(name: str, app_id: str = "com-example-app", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "margo-gitops.dev/v1alpha1", "kind": "DeploymentIntent",
            "metadata": {"name": name},
            "spec": {"application": {"id": app_id}, **spec}}


def device(device_id: str, *, cores: float = 4, memory: str = "8Gi",
           types: tuple[str, ...] = ("helm",), labels: dict[str, Any] | None = None,
           gpu: bool = False, arch: str = "amd64") -> dict[str, Any]:
    doc: dict[str, Any] = {"properties": {
        "id": device_id, "vendor": "Example", "modelNumber": "M1", "serialNumber": "S1",
        "cpus": [{"cores": cores, "architecture": arch}], "memory": memory, "storage": "64Gi",
        "peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}] if gpu else [],
        "interfaces": [{"type": "ethernet"}], "otelCollector": True,
        "supportedRuntimes": ["oci"], "supportedDeploymentTypes": list(types)}}
    if labels:
        doc["labels"] = labels
    return doc


@dataclass
class Fleet:
    """A fleet on disk plus a repos directory; `compile()` runs the real compiler."""

    root: Path
    apps: dict[str, dict[str, Any]] = field(default_factory=dict)
    intents: dict[str, dict[str, Any]] = field(default_factory=dict)
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    raw_files: dict[str, str] = field(default_factory=dict)

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def caps(self) -> Path:
        return self.root / "caps"

    @property
    def repos(self) -> Path:
        return self.root / "repos"

    def write(self) -> None:
        for directory in (self.source / "apps", self.source / "deployments", self.caps):
            if directory.exists():
                for path in sorted(directory.rglob("*"), reverse=True):
                    path.unlink() if path.is_file() else path.rmdir()
            directory.mkdir(parents=True, exist_ok=True)
        for app_id, doc in self.apps.items():
            (self.source / "apps" / app_id).mkdir(parents=True, exist_ok=True)
            (self.source / "apps" / app_id / "margo.yaml").write_bytes(canonical_yaml(doc))
        for name, doc in self.intents.items():
            (self.source / "deployments" / f"{name}.yaml").write_bytes(canonical_yaml(doc))
        for device_id, doc in self.devices.items():
            (self.caps / f"{device_id}.json").write_text(json.dumps(doc, indent=1))
        for rel, text in self.raw_files.items():
            (self.source / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.source / rel).write_text(text)

    def compile(self, *, now: float = 1_000_000.0, dry_run: bool = False,
                rollouts: dict[str, Any] | None = None,
                fleet_key: FleetKey | None = None) -> CompileReport:
        self.write()
        self.repos.mkdir(parents=True, exist_ok=True)
        state = CompilerState(self.repos / "compiler-state.sqlite")
        try:
            return compile_fleet(load_source(self.source), load_snapshot(self.caps),
                                 DeviceStore(self.repos), state, now=now, dry_run=dry_run,
                                 rollouts=rollouts, fleet_key=fleet_key)
        finally:
            state.close()

    @property
    def store(self) -> DeviceStore:
        return DeviceStore(self.repos)

    def tree(self, device_id: str) -> dict[str, bytes]:
        return self.store.read_files(device_id) or {}

    def deployment(self, device_id: str, intent_name: str) -> dict[str, Any]:
        import yaml

        return yaml.safe_load(self.tree(device_id)[f"{intent_name}.yaml"])
