"""Test kit: what each driver column of the device matrix (`matrixkit`) really runs, read
from the engine itself and never from the device client's own state.

- `render`: a simulated Kubernetes device (capabilities: k8s-single-amd64); read from the
  render ledger and the ConfigMap the real Helm engine wrote to disk.
- `helm`: the real control plane, discovered through its API as the device's
  ServiceAccount; read from Helm's release records, the chart's ConfigMap and the pods
  kwok runs.
- `compose`: a Compose box (compose-box-amd64) on the real Docker engine; read from the
  engine's containers: environment, state and health.

Every view reduces what it finds to `Workload`s (application version, greeting, whether it
runs), so one assertion holds in every column. The test chart (`kits.chartkit.write_chart`)
shows the chart version and the greeting in a ConfigMap and runs a Deployment whose image
tag is the chart version; the Compose package sets `APP_VERSION` and passes the greeting
parameter as `GREETING` (`kits.dockerkit.web_service`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from kits.dockerkit import DockerEngine, inspect
from kits.kubekit import SINGLE_NODE, ControlPlane, KubeCluster

__all__ = ["ComposeView", "EngineView", "HelmView", "RenderView", "Workload"]

#: The label our releases, Compose projects and ledger entries carry (docs/device.md).
MANAGED = "margo-gitops.dev/managed-by=margo-gitops"


@dataclass(frozen=True, order=True)
class Workload:
    """One component as the engine runs it; `name` (release or container) is for messages."""

    version: str
    greeting: str
    running: bool = True
    name: str = field(default="", compare=False)


class EngineView(Protocol):
    """A driver column: how its device is configured and what its engine runs."""

    def driver(self) -> dict[str, Any]:
        """The `driver:` section of the device's configuration."""

    def capabilities(self) -> dict[str, Any]:
        """The `capabilities:` section (the file it names is written by the view)."""

    def workloads(self) -> list[Workload]:
        """Everything of ours the engine runs for this device, sorted."""

    def close(self) -> None:
        """Leave the engine without this device's workloads, for the next test."""


class RenderView:
    """The render driver: manifests the real Helm engine wrote to `home/rendered`."""

    def __init__(self, home: Path, device_id: str, capabilities: dict[str, Any]) -> None:
        self.output = home / "rendered"
        self._capabilities_file = home / "capabilities.json"
        self._capabilities_file.write_text(json.dumps(capabilities))

    def driver(self) -> dict[str, Any]:
        return {"type": "render", "outputDir": str(self.output)}

    def capabilities(self) -> dict[str, Any]:
        return {"file": str(self._capabilities_file)}

    def workloads(self) -> list[Workload]:
        found = []
        for key, entry in self._ledger().items():
            namespace, release = key.split("/", 1)
            data = self._configmap(namespace, release)
            version = str(data.get("chartVersion", ""))
            found.append(Workload(version, str(data.get("greeting", "")),
                                  entry.get("status") == "deployed"
                                  and entry.get("chart", {}).get("version") == version,
                                  release))
        return sorted(found)

    def close(self) -> None:
        """Nothing to do: the files live under the test's temporary directory."""

    def _ledger(self) -> dict[str, Any]:
        """The ledger's releases; a read racing the driver's atomic replace sees none."""
        try:
            releases: dict[str, Any] = json.loads(
                (self.output / ".ledger.json").read_text()).get("releases", {})
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return releases

    def _configmap(self, namespace: str, release: str) -> dict[str, Any]:
        files = sorted((self.output / namespace / release).glob("*/templates/configmap.yaml"))
        if len(files) != 1:
            return {}
        with contextlib.suppress(FileNotFoundError):  # replaced by the next render meanwhile
            data: dict[str, Any] = yaml.safe_load(files[0].read_text())["data"]
            return data
        return {}


class HelmView:
    """The Helm driver on the session's control plane (one schedulable node), as the
    device's ServiceAccount under examples/kubernetes/device-rbac.yaml. `close` uninstalls
    every release and waits until their pods are gone (`KubeCluster.clean`)."""

    def __init__(self, plane: ControlPlane, home: Path, namespace: str) -> None:
        self.cluster = KubeCluster(plane, home)
        self.cluster.set_nodes(SINGLE_NODE)
        self.namespace = namespace
        self._kubeconfig = self.cluster.device_kubeconfig("device.kubeconfig")

    def driver(self) -> dict[str, Any]:
        return {"type": "helm", "kubeconfig": str(self._kubeconfig)}

    def capabilities(self) -> dict[str, Any]:
        return {"kubernetes": {"vendor": "Example", "debounce": "0s"}}

    def workloads(self) -> list[Workload]:
        statuses = self._release_statuses()
        found = []
        for configmap in self.cluster.admin.list("ConfigMap", self.namespace):
            release = (configmap["metadata"].get("labels") or {}).get(
                "app.kubernetes.io/instance")
            if release not in statuses:
                continue
            data = configmap.get("data") or {}
            version = str(data.get("chartVersion", ""))
            pods = self.cluster.running_pods(self.namespace,
                                             f"app.kubernetes.io/instance={release}")
            images = [c["image"] for p in pods for c in p["spec"]["containers"]]
            runs = (statuses[release] == "deployed" and bool(images)
                    and all(image.endswith(f":{version}") for image in images))
            found.append(Workload(version, str(data.get("greeting", "")), runs, release))
        return sorted(found)

    def close(self) -> None:
        self.cluster.close()

    def _release_statuses(self) -> dict[str, str]:
        """Release name → the status of its newest revision, from Helm's own records."""
        newest: dict[str, tuple[int, str]] = {}
        for secret in self.cluster.admin.list("Secret", self.namespace, selector="owner=helm"):
            labels = secret["metadata"]["labels"]
            revision = int(labels.get("version", "0"))
            if revision >= newest.get(labels["name"], (-1, ""))[0]:
                newest[labels["name"]] = (revision, labels.get("status", ""))
        return {name: status for name, (_, status) in newest.items()}


class ComposeView:
    """The Compose driver on the session's Docker engine. The engine holds one device's
    projects at a time (tests on it run one after another: tests/conftest.py pins them to
    one worker), so every container with our label is this device's; `close` removes them
    all."""

    def __init__(self, engine: DockerEngine, home: Path, capabilities: dict[str, Any]) -> None:
        self.engine = engine
        self._capabilities_file = home / "capabilities.json"
        self._capabilities_file.write_text(json.dumps(capabilities))

    def driver(self) -> dict[str, Any]:
        return {"type": "compose", "compose": self.engine.compose,
                "dockerHost": self.engine.host}

    def capabilities(self) -> dict[str, Any]:
        return {"file": str(self._capabilities_file)}

    def workloads(self) -> list[Workload]:
        names = self.engine.text("ps", "-a", "--filter", f"label={MANAGED}", "--format",
                                 "{{.Names}}").split()
        found = []
        for name in names:
            try:
                details = inspect(self.engine, name)
            except RuntimeError:  # removed between the listing and the inspection
                continue
            env = dict(pair.split("=", 1) for pair in details["Config"]["Env"])
            state = details["State"]
            runs = (state.get("Status") == "running"
                    and (state.get("Health") or {}).get("Status") == "healthy")
            found.append(Workload(env.get("APP_VERSION", ""), env.get("GREETING", ""), runs,
                                  name))
        return sorted(found)

    def close(self) -> None:
        ids = self.engine.text("ps", "-aq").split()
        if ids:
            self.engine.run("rm", "-f", *ids)
        self.engine.run("network", "prune", "-f")
