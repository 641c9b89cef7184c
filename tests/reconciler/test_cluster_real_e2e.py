"""A Kubernetes cluster as a Margo target, for real: a real `margo serve`, the device client
with the Helm driver and cluster discovery on the real control plane (as its
ServiceAccount), the example charts from the real registry.

What is asserted is what the cluster did: pods the scheduler spread over two nodes because
of the chart's topologySpreadConstraints (no Margo node selector anywhere), the GPU pod on
the GPU node because of the chart's resource request, a release removed after the grace
period when the GPU node is cordoned or deleted and installed again when it returns, a
Deployment deleted out of band reported and repaired, and a device client SIGKILLed in the
middle of an upgrade that converges after its restart.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.chartkit import publish_chart, publish_example_charts
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.kubekit import GPU_WORKER, SINGLE_NODE, THREE_NODES, KubeCluster, SimNode

from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.runner import Reconciler
from tools.polling import poll_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "fleet"

VISION = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {name: vision}
spec:
  application: {id: com-example-gpu-inference}
  profile: {type: helm}
  namespace: vision
  gracePeriod: 3s
  targets: {devices: [edge-cluster]}
"""

HELLO = """\
apiVersion: margo-gitops.dev/v1alpha1
kind: DeploymentIntent
metadata: {name: hello}
spec:
  application: {id: com-example-hello-world}
  profile: {type: helm}
  namespace: hello
  parameters: {greeting: Servus}
  targets: {devices: [edge-cluster]}
"""


def until(what: str, predicate: Callable[[], Any], reconciler: Reconciler | None = None,
          timeout: float = 60) -> Any:
    """Poll (running device cycles meanwhile, as `margo device run` would) until true."""
    cycles: list[Any] = [None]
    run = (lambda: cycles.__setitem__(0, reconciler.cycle())) if reconciler is not None \
        else None
    return poll_until(what, predicate, timeout=timeout, interval=0.2, each=run,
                      describe=lambda: f"last cycle: {cycles[0]}")


def device_home(tmp_path: Path, server: FleetServer, kube: KubeCluster, *,
                driver: dict[str, Any] | None = None) -> Path:
    """The device client's directory: configuration, token, and its ServiceAccount."""
    home = tmp_path / "edge-cluster"
    home.mkdir()
    (home / "token").write_text(server.token)
    kubeconfig = kube.device_kubeconfig("device.kubeconfig")
    (home / "device.yaml").write_text(yaml.safe_dump({
        "device": {"id": "edge-cluster"},
        "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
        "source": {"type": "margo-rest"},
        "driver": {"type": "helm", "kubeconfig": str(kubeconfig), **(driver or {})},
        "dataDir": "data",
        "capabilities": {"kubernetes": {"vendor": "Example", "debounce": "0s",
                                        "labels": {"example.com/site": "plant-a"}}},
        "schedule": {"interval": "1s"}}))
    return home / "device.yaml"


@contextmanager
def serving_fleet(fleet: Path, tmp_path: Path, kube: KubeCluster, *,
                  without: tuple[str, ...] = ()) -> Iterator[tuple[FleetServer, Path]]:
    """A server on a copy of the module's fleet (less the intents `without`), and the
    device's configuration for it."""
    workdir = tmp_path / "server"
    shutil.copytree(fleet, workdir / "fleet")
    for intent in without:
        (workdir / "fleet" / "deployments" / f"{intent}.yaml").unlink()
    with fleet_server(workdir, fleet=workdir / "fleet") as server:
        yield server, device_home(tmp_path, server, kube)


def deployed(server: FleetServer, intent: str) -> list[dict[str, Any]]:
    """The device's deployments of `intent`; none while the server has not heard of it."""
    response = server._http.get("/api/fleet/devices/edge-cluster")
    if response.status_code == 404:
        return []
    assert response.status_code == 200, response.text
    return [d for d in response.json()["deployments"] if d["intent"] == intent]


def installed(server: FleetServer, intent: str) -> bool:
    found = deployed(server, intent)
    return bool(found) and found[0]["state"] == "installed"


@pytest.fixture(scope="module")
def fleet(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    publish_example_charts(registry)
    source = tmp_path_factory.mktemp("fleet")
    intents = {"ha-web": (EXAMPLES / "deployments" / "ha-web.yaml").read_text(),
               "vision": VISION}
    return write_fleet(source / "fleet", registry=registry, intents=intents)


def test_ha_web_spreads_over_nodes_and_the_gpu_application_follows_the_gpu_node(
        fleet: Path, kube: KubeCluster, tmp_path: Path) -> None:
    kube.set_nodes(THREE_NODES)
    with serving_fleet(fleet, tmp_path, kube) as (server, config), \
            open_reconciler(load_config(config)) as reconciler:
        until("HA web installed", lambda: installed(server, "ha-web"), reconciler)
        pods = kube.running_pods("web")
        # Two replicas (two schedulable nodes), on two different nodes: the chart's
        # topologySpreadConstraints, applied by the real scheduler.
        assert sorted(p["spec"]["nodeName"] for p in pods) == ["worker-a", "worker-b"]
        assert not any("nodeSelector" in p["spec"] or "affinity" in p["spec"] for p in pods)
        # No GPU node: the GPU application is not placed, and the explanation says why.
        assert deployed(server, "vision") == []
        assert "NVIDIA" in str(server.device("edge-cluster")["eligibility"])

        kube.set_nodes([*THREE_NODES, GPU_WORKER])
        until("the GPU application installed", lambda: installed(server, "vision"),
              reconciler)
        [inference] = [p for p in kube.running_pods("vision")
                       if p["metadata"]["name"].startswith("inference-server")]
        assert inference["spec"]["nodeName"] == "gpu-worker"  # by its nvidia.com/gpu request
        reported = server.device("edge-cluster")["capabilities"]
        assert reported["labels"]["k8s.margo-gitops.dev/gpus"] == 1

        # Cordoned: the GPU is no longer schedulable; after the 3 s grace period the
        # application is removed from the device branch and uninstalled from the cluster.
        kube.admin.merge_patch("Node", "gpu-worker", {"spec": {"unschedulable": True}})
        until("the re-report", lambda: server.device("edge-cluster")["capabilities"][
            "labels"]["k8s.margo-gitops.dev/gpus"] == 0, reconciler)
        assert deployed(server, "vision"), "kept during the grace period"
        until("the GPU application removed", lambda: not deployed(server, "vision")
              and not kube.release_secrets("vision"), reconciler)
        kube.until("its pods gone", lambda: not kube.pods("vision"))

        kube.admin.merge_patch("Node", "gpu-worker", {"spec": {"unschedulable": False}})
        until("the GPU application installed again", lambda: installed(server, "vision"),
              reconciler)
        # Deleted outright, it goes the same way.
        kube.set_nodes(THREE_NODES)
        until("the GPU application removed after deletion",
              lambda: not deployed(server, "vision") and not kube.release_secrets("vision"),
              reconciler)
        assert installed(server, "ha-web")
        assert reconciler.cycle().converged


def test_one_node_keeps_one_replica_and_the_application_placed(
        fleet: Path, kube: KubeCluster, tmp_path: Path) -> None:
    kube.set_nodes(SINGLE_NODE)
    with serving_fleet(fleet, tmp_path, kube) as (server, config), \
            open_reconciler(load_config(config)) as reconciler:
        until("HA web installed", lambda: installed(server, "ha-web"), reconciler)
        [pod] = kube.running_pods("web")
        assert pod["spec"]["nodeName"] == "edge-0"
        [release] = reconciler.driver.installed()
        values = reconciler.driver.config("web").get_values(release.release_name)
        assert values["replicaCount"] == 1
        # A single replica gets no PodDisruptionBudget (it would block every drain).
        assert not kube.admin.request(
            "GET", "/apis/policy/v1/namespaces/web/poddisruptionbudgets").json()["items"]


def test_drift_is_reported_then_repaired_when_the_device_asks(
        fleet: Path, kube: KubeCluster, tmp_path: Path) -> None:
    kube.set_nodes(SINGLE_NODE)
    with serving_fleet(fleet, tmp_path, kube, without=("vision",)) as (server, config):
        with open_reconciler(load_config(config)) as reconciler:
            until("HA web installed", lambda: installed(server, "ha-web"), reconciler)
            [release] = reconciler.driver.installed()
            kube.admin.delete("Deployment", release.release_name, "web")
            kube.until("gone", lambda: not kube.admin.find(
                "Deployment", release.release_name, "web"))
            until("the drift reported", lambda: deployed(server, "ha-web")[0]["state"]
                  == "failed", reconciler)
            [component] = deployed(server, "ha-web")[0]["components"]
            assert component["error"]["code"] == "DRIFTED"
            assert component["error"]["message"] == (
                f"missing from the cluster: Deployment web/{release.release_name}")
            assert kube.admin.find("Deployment", release.release_name, "web") is None
        settings = yaml.safe_load(config.read_text())
        settings["driver"]["driftDetection"] = "repair"
        config.write_text(yaml.safe_dump(settings))
        with open_reconciler(load_config(config)) as reconciler:
            until("repaired", lambda: installed(server, "ha-web"), reconciler)
            assert kube.admin.get("Deployment", release.release_name, "web")["status"][
                "availableReplicas"] == 1


def publish_hello_world(registry: str, tmp_path: Path, version: str, *, requests: str) -> None:
    """The example charts, plus a hello-world `version` whose container requests
    `requests` (a YAML flow mapping)."""
    publish_example_charts(registry)
    chart = tmp_path / "charts" / "hello-world"
    shutil.copytree(EXAMPLES / "apps" / "com-example-hello-world" / "charts" / "hello-world",
                    chart)
    chart_yaml = chart / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 1.0.0",
                                                         f"version: {version}"))
    template = chart / "templates" / "deployment.yaml"
    template.write_text(template.read_text()
                        + f"          resources: {{requests: {requests}}}\n")
    publish_chart(registry, chart)


def history(server: FleetServer, deployment: str) -> list[str]:
    """Overall states the server recorded for a deployment, in arrival order."""
    with sqlite3.connect(server.data_dir / "wfm.sqlite") as conn:
        rows = conn.execute("SELECT state FROM status_reports WHERE deployment_id = ? "
                            "ORDER BY id", (deployment,)).fetchall()
    return [row[0] for row in rows]


def test_a_device_client_killed_mid_upgrade_recovers_after_restart(
        registry: str, kube: KubeCluster, tmp_path: Path) -> None:
    kube.set_nodes(SINGLE_NODE)
    # hello-world 1.1.0 asks for 6 CPUs: no node can run it until a bigger one joins.
    publish_hello_world(registry, tmp_path, "1.1.0", requests='{cpu: "6"}')
    fleet = write_fleet(tmp_path / "fleet", registry=registry, intents={"hello": HELLO})
    with fleet_server(tmp_path, fleet=fleet) as server:
        config = device_home(tmp_path, server, kube)
        command = [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
                   str(config), "--log-level", "warning"]
        log = tmp_path / "device.log"

        def start() -> subprocess.Popen[bytes]:
            with open(log, "ab") as output:
                return subprocess.Popen(command, cwd=ROOT, stdout=output,
                                        stderr=subprocess.STDOUT)

        process = start()
        try:
            server.wait_for(lambda: installed(server, "hello"), timeout=60,
                            what="hello installed")
            [summary] = deployed(server, "hello")
            app = fleet / "apps" / "com-example-hello-world" / "margo.yaml"
            app.write_text(app.read_text().replace("revision: 1.0.0", "revision: 1.1.0", 1))
            kube.until("the upgrade in progress", lambda: "pending-upgrade" in
                       kube.release_secrets("hello").values(), timeout=60)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert "pending-upgrade" in kube.release_secrets("hello").values()
        kube.set_nodes([*SINGLE_NODE, SimNode("big-0", cpu="16", memory="32Gi")])
        process = start()
        try:
            # The same deployment (its id is stable per intent and device) reported
            # installed a second time: the upgrade the killed client had begun.
            server.wait_for(lambda: history(server, summary["deploymentId"]).count(
                "installed") == 2 and installed(server, "hello"), timeout=120,
                what="hello 1.1.0 installed")
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        assert {p["spec"]["nodeName"] for p in kube.running_pods("hello")} == {"big-0"}
        statuses = kube.release_secrets("hello")
        assert sorted(statuses.values()).count("deployed") == 1, statuses
        states = history(server, summary["deploymentId"])
        assert states[0] == "pending" and states[-1] == "installed", states
        assert all(a != b for a, b in pairwise(states)), states
        # A restarted client finds everything in Helm's records and changes nothing.
        once = subprocess.run([sys.executable, "-m", "margo_cli.main", "device", "once",
                               "--config", str(config), "--json", "--log-level", "warning"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert once.returncode == 0, once.stdout + once.stderr
        assert '"steps": []' in once.stdout


def hello(name: str) -> str:
    return (f"apiVersion: margo-gitops.dev/v1alpha1\nkind: DeploymentIntent\n"
            f"metadata: {{name: {name}}}\n"
            f"spec:\n  application: {{id: com-example-hello-world}}\n"
            f"  profile: {{type: helm}}\n  namespace: {name}\n"
            f"  targets: {{devices: [edge-cluster]}}\n")


def reported_workloads(server: FleetServer) -> dict[str, float]:
    """Deployment id -> the CPU its scheduled pods request, as the device last reported."""
    cluster = server.device("edge-cluster")["capabilities"]["x-margo-gitops-extensions"][
        "cluster"]
    return {w["deployment"]: w["requested"].get("cpu", 0)
            for n in cluster["resources"]["nodes"] for w in n.get("workloads", [])}


def test_a_deployment_whose_pods_are_scheduled_is_counted_once(
        registry: str, kube: KubeCluster, tmp_path: Path) -> None:
    """One node of 1 core; hello-world asks for 0.5 cores and its pod requests exactly that.
    Once hello-a's pod runs, the report has subtracted it; the WFM must then not subtract
    hello-a again, or hello-b would never fit."""
    kube.set_nodes([SimNode("edge-0", cpu="1", memory="2Gi")])
    publish_hello_world(registry, tmp_path, "1.3.0", requests="{cpu: 500m, memory: 256Mi}")
    fleet = write_fleet(tmp_path / "fleet", registry=registry,
                        intents={"hello-a": hello("hello-a")})
    app = fleet / "apps" / "com-example-hello-world" / "margo.yaml"
    app.write_text(app.read_text().replace("revision: 1.0.0", "revision: 1.3.0", 1))
    with fleet_server(tmp_path, fleet=fleet) as server, \
            open_reconciler(load_config(device_home(tmp_path, server, kube))) as reconciler:
        until("hello-a installed", lambda: installed(server, "hello-a"), reconciler)
        [a] = deployed(server, "hello-a")
        until("its pod reported as hello-a's", lambda: reported_workloads(server)
              == {a["deploymentId"]: 0.5}, reconciler)
        assert server.device("edge-cluster")["capabilities"]["properties"]["cpus"] == [
            {"cores": 0.5, "architecture": "amd64"}]

        (fleet / "deployments" / "hello-b.yaml").write_text(hello("hello-b"))
        until("hello-b installed", lambda: installed(server, "hello-b"), reconciler)
        [b] = deployed(server, "hello-b")
        until("both pods reported", lambda: reported_workloads(server)
              == {a["deploymentId"]: 0.5, b["deploymentId"]: 0.5}, reconciler)
        assert {p["spec"]["nodeName"] for ns in ("hello-a", "hello-b")
                for p in kube.running_pods(ns)} == {"edge-0"}

        # The node is full now: a third one is not placed, and the two stay, cycle after
        # cycle (each is checked as if its own pod were not counted).
        (fleet / "deployments" / "hello-c.yaml").write_text(hello("hello-c"))
        until("hello-c explained", lambda: any(
            e["intent"] == "hello-c" and e["status"] == "not eligible"
            for e in server.device("edge-cluster")["eligibility"]), reconciler)
        for _ in range(3):
            assert reconciler.cycle().converged
        assert installed(server, "hello-a") and installed(server, "hello-b")
        assert deployed(server, "hello-c") == []
