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
runs), so one assertion holds in every column. `fingerprint()` says, per workload, what
changes whenever the engine applies it again (the render ledger's revision, Helm's release
revision, the container's id and start time): a step that should not happen shows there.
`set_cores` and `set_gpu` change what the device reports: its capabilities file (render,
Compose: the client re-reads it every cycle), or its cluster's nodes (Helm: the client's
Kubernetes discovery re-reports a relevant change; the GPU is a simulated kwok node).

The test chart (`kits.chartkit.write_chart`) shows the chart version and the greeting in a
ConfigMap and runs a Deployment whose image tag is the chart version; the Compose package
sets `APP_VERSION` and passes the greeting parameter as `GREETING`
(`kits.dockerkit.web_service`).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import yaml

from kits.dockerkit import DockerEngine, inspect
from kits.kubekit import GPU_WORKER, SINGLE_NODE, ControlPlane, KubeCluster, SimNode

__all__ = ["ComposeView", "EngineView", "HelmView", "RenderView", "Workload"]

#: The label our releases, Compose projects and ledger entries carry (docs/device.md).
MANAGED = "margo-gitops.dev/managed-by=margo-gitops"
#: The GPU a capabilities file reports with `set_gpu(True)` (matched by `/type In [gpu]`).
GPU_PERIPHERAL = {"type": "gpu", "manufacturer": "NVIDIA", "model": "L4"}


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

    def fingerprint(self) -> dict[str, str]:
        """Workload name -> what changes whenever the engine applies it again."""

    def set_cores(self, cores: float) -> None:
        """Report `cores` CPU cores from now on (one `cpus` entry, or one node)."""

    def set_gpu(self, present: bool) -> None:
        """Report a GPU from now on, or none."""


class _CapabilitiesFile:
    """A device whose capabilities are a file (`capabilities.file`), which the client reads
    again every cycle and reports when it changed."""

    def __init__(self, home: Path, capabilities: dict[str, Any]) -> None:
        self._capabilities_file = home / "capabilities.json"
        self._capabilities_file.write_text(json.dumps(capabilities))

    def capabilities(self) -> dict[str, Any]:
        return {"file": str(self._capabilities_file)}

    def edit_capabilities(self, properties: dict[str, Any]) -> None:
        """Replace these `properties` of the document, written aside and renamed so that the
        client never reads half a file."""
        doc = json.loads(self._capabilities_file.read_text())
        doc["properties"].update(properties)
        temporary = self._capabilities_file.with_name(".capabilities.json.tmp")
        temporary.write_text(json.dumps(doc))
        os.replace(temporary, self._capabilities_file)

    def set_cores(self, cores: float) -> None:
        self.edit_capabilities({"cpus": [{"cores": cores, "architecture": "amd64"}]})

    def set_gpu(self, present: bool) -> None:
        self.edit_capabilities({"peripherals": [GPU_PERIPHERAL] if present else []})


class RenderView(_CapabilitiesFile):
    """The render driver: manifests the real Helm engine wrote to `home/rendered`."""

    def __init__(self, home: Path, device_id: str, capabilities: dict[str, Any]) -> None:
        super().__init__(home, capabilities)
        self.output = home / "rendered"

    def driver(self) -> dict[str, Any]:
        return {"type": "render", "outputDir": str(self.output)}

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

    def fingerprint(self) -> dict[str, str]:
        """Release -> the ledger's revision counter (every render adds one)."""
        return {key.split("/", 1)[1]: str(entry.get("revision"))
                for key, entry in self._ledger().items()}

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
        self._node: SimNode = SINGLE_NODE[0]
        self._gpu = False
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

    def fingerprint(self) -> dict[str, str]:
        """Release -> its newest revision in Helm's records (every install, upgrade or
        repair adds one)."""
        return {name: str(revision) for name, revision in self.revisions().items()}

    def revisions(self) -> dict[str, int]:
        """Release -> its newest revision in Helm's records."""
        newest: dict[str, int] = {}
        for secret in self.cluster.admin.list("Secret", self.namespace, selector="owner=helm"):
            labels = secret["metadata"]["labels"]
            newest[labels["name"]] = max(newest.get(labels["name"], 0),
                                         int(labels.get("version", "0")))
        return newest

    def set_cores(self, cores: float) -> None:
        """The schedulable node's CPU capacity; the client's discovery reports the change."""
        self._node = replace(self._node, cpu=f"{round(cores * 1000)}m")
        self._apply_nodes()

    def set_gpu(self, present: bool) -> None:
        """A GPU worker beside the node (simulated by kwok: no GPU on this machine), or
        none; the client's discovery reports a GPU that appears or goes."""
        self._gpu = present
        self._apply_nodes()

    def _apply_nodes(self) -> None:
        self.cluster.set_nodes((self._node, *((GPU_WORKER,) if self._gpu else ())))

    def _release_statuses(self) -> dict[str, str]:
        """Release name → the status of its newest revision, from Helm's own records."""
        newest: dict[str, tuple[int, str]] = {}
        for secret in self.cluster.admin.list("Secret", self.namespace, selector="owner=helm"):
            labels = secret["metadata"]["labels"]
            revision = int(labels.get("version", "0"))
            if revision >= newest.get(labels["name"], (-1, ""))[0]:
                newest[labels["name"]] = (revision, labels.get("status", ""))
        return {name: status for name, (_, status) in newest.items()}


class ComposeView(_CapabilitiesFile):
    """The Compose driver on the session's Docker engine. The engine holds one device's
    projects at a time (tests on it run one after another: tests/conftest.py pins them to
    one worker), so every container with our label is this device's; `close` removes them
    all."""

    def __init__(self, engine: DockerEngine, home: Path, capabilities: dict[str, Any]) -> None:
        super().__init__(home, capabilities)
        self.engine = engine

    def driver(self) -> dict[str, Any]:
        return {"type": "compose", "compose": self.engine.compose,
                "dockerHost": self.engine.host}

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

    def fingerprint(self) -> dict[str, str]:
        """Container -> its id and start time (a recreated or restarted container has
        others)."""
        found = {}
        for name in self.engine.text("ps", "-a", "--filter", f"label={MANAGED}", "--format",
                                     "{{.Names}}").split():
            with contextlib.suppress(RuntimeError):  # removed since the listing
                details = inspect(self.engine, name)
                found[name] = f"{details['Id'][:12]}@{details['State'].get('StartedAt')}"
        return found

    def close(self) -> None:
        ids = self.engine.text("ps", "-aq").split()
        if ids:
            self.engine.run("rm", "-f", *ids)
        self.engine.run("network", "prune", "-f")
