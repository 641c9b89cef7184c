"""A Kubernetes cluster as a Margo target, end to end: compiler + server + device client.

The cluster is served by the Kubernetes API emulator from recorded node objects (a kind
control plane and worker; the recorded Tesla T4 node joins and leaves). The device client
discovers it with the `kubernetes` capability provider, reports it to a real `margo serve`,
and converges with the render driver on charts from the real registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import publish_example_charts
from clusterkit import GPU_NODE, NODES, gpu_three_node, gpu_worker, serve
from fleetserver import fleet_server, write_fleet
from kubeemu import running_emulator

from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.runner import Reconciler

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


def until(what: str, predicate: Callable[[], Any], reconciler: Reconciler | None = None,
          timeout: float = 30) -> Any:
    """Poll (running device cycles meanwhile, as `margo device run` would) until true."""
    deadline = time.monotonic() + timeout
    while True:
        last = reconciler.cycle() if reconciler is not None else None
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}; last cycle: {last}")
        time.sleep(0.2)


def test_a_gpu_node_joining_and_leaving_moves_the_gpu_application(
        registry: str, tmp_path: Path) -> None:
    publish_example_charts(registry)
    fleet = write_fleet(tmp_path / "fleet", registry=registry, intents={"vision": VISION})
    # The GPU application asks for a node, not for the whole device: one amd64 node with an
    # NVIDIA GPU available (the node-aware requirement, copied verbatim to the device).
    app = fleet / "apps" / "com-example-gpu-inference" / "margo.yaml"
    description = yaml.safe_load(app.read_text())
    description["deploymentProfiles"][0]["deviceConstraints"] = {
        "x-margo-gitops-extensions": {"cluster": {"nodes": [{
            "capacity": {"resources": {"nvidia.com/gpu": 1}},
            "selector": {"matchExpressions": [
                {"key": "/architecture", "operator": "In", "values": ["amd64"]}]}}]}}}
    app.write_text(yaml.safe_dump(description, sort_keys=False))
    cluster = gpu_three_node()
    cluster.objects[NODES] = [n for n in cluster.objects[NODES]
                              if n["metadata"]["name"] != GPU_NODE]
    with running_emulator(tmp_path / "kube") as emulator, \
            fleet_server(tmp_path, fleet=fleet) as server:
        serve(emulator, cluster)
        home = tmp_path / "edge-cluster"
        home.mkdir()
        (home / "token").write_text(server.token)
        (home / "device.yaml").write_text(yaml.safe_dump({
            "device": {"id": "edge-cluster"},
            "server": {"url": server.base, "clientId": server.client_id, "tokenFile": "token"},
            "source": {"type": "margo-rest"},
            "driver": {"type": "render", "outputDir": "rendered"},
            "dataDir": "data",
            "capabilities": {"kubernetes": {"kubeconfig": str(emulator.kubeconfig),
                                            "vendor": "Example", "debounce": "0s",
                                            "labels": {"example.com/site": "plant-a"}}}}))

        def vision_on_device() -> list[dict[str, Any]]:
            return [d for d in server.device("edge-cluster")["deployments"]
                    if d["intent"] == "vision"]

        def explanation() -> str:
            return str(server.device("edge-cluster")["eligibility"])

        with open_reconciler(load_config(home / "device.yaml")) as reconciler:
            first = reconciler.cycle()
            assert first.failures == [], first.failures
            reported = server.device("edge-cluster")["capabilities"]
            cluster_body = reported["x-margo-gitops-extensions"]["cluster"]
            assert cluster_body["resources"]["nodeCount"] == 2
            assert reported["labels"]["k8s.margo-gitops.dev/nodes"] == 2
            # No GPU node: not eligible, and the explanation says which clause fails.
            until("the compile", lambda: "nvidia.com/gpu" in explanation())
            assert vision_on_device() == []

            emulator.load(NODES, gpu_worker())  # the GPU node joins
            until("the GPU application on the cluster", vision_on_device, reconciler)
            until("its components rendered",
                  lambda: vision_on_device()[0]["state"] == "installed", reconciler,
                  timeout=60)
            reported = server.device("edge-cluster")["capabilities"]
            assert reported["labels"]["k8s.margo-gitops.dev/gpus"] == 1
            assert any(p.get("manufacturer") == "NVIDIA"
                       for p in reported["properties"]["peripherals"])
            assert sorted((home / "rendered" / "vision").iterdir())
            # The node requirement reached the device verbatim, as the spec requires.
            assert b"nvidia.com/gpu: 1" in b"".join(reconciler.state.desired_documents())

            emulator.remove(NODES, GPU_NODE)  # and leaves again
            until("the re-report", lambda: server.device("edge-cluster")["capabilities"][
                "labels"]["k8s.margo-gitops.dev/gpus"] == 0, reconciler)
            assert vision_on_device(), "kept during the 3 s grace period"
            until("the GPU application removed after the grace period",
                  lambda: not vision_on_device()
                  and not (home / "rendered" / "vision").exists(), reconciler, timeout=60)
            assert reconciler.cycle().converged


@pytest.mark.parametrize("other", [{"file": "caps.json"}, {"host": {}}])
def test_only_one_capability_provider_may_be_configured(tmp_path: Path,
                                                        other: dict[str, Any]) -> None:
    from margo.errors import DocumentError

    config = tmp_path / "device.yaml"
    (tmp_path / "token").write_text("t")

    def write(capabilities: dict[str, Any]) -> None:
        config.write_text(yaml.safe_dump({
            "device": {"id": "d"}, "server": {"url": "http://127.0.0.1:1", "clientId": "c",
                                              "tokenFile": "token"},
            "source": {"type": "margo-rest"}, "driver": {"type": "helm", "kubeconfig": "kc"},
            "dataDir": "data", "capabilities": capabilities}))

    write({"kubernetes": {}, **other})
    with pytest.raises(DocumentError, match="one of 'file', 'host' or 'kubernetes'"):
        load_config(config)
    write({"kubernetes": {}})  # the cluster provider defaults to the Helm driver's kubeconfig
    parsed = load_config(config)
    assert parsed.kubernetes is not None and parsed.kubernetes["kubeconfig"] == tmp_path / "kc"


def test_margo_device_capabilities_prints_both_documents(tmp_path: Path) -> None:
    """The discovery, printed as the rc.3 document and as the proposal's manifest."""
    import json
    import subprocess
    import sys

    from margo.cluster import is_cluster_manifest, validate_cluster_manifest

    root = Path(__file__).resolve().parents[2]
    with running_emulator(tmp_path / "kube") as emulator:
        serve(emulator, gpu_three_node())
        (tmp_path / "token").write_text("t")
        config = tmp_path / "device.yaml"
        config.write_text(yaml.safe_dump({
            "device": {"id": "edge-cluster"},
            "server": {"url": "http://127.0.0.1:1", "clientId": "c", "tokenFile": "token"},
            "source": {"type": "margo-rest"}, "driver": {"type": "render"}, "dataDir": "data",
            "capabilities": {"kubernetes": {"kubeconfig": str(emulator.kubeconfig)}}}))
        outputs = {}
        for form in ("margo", "cluster"):
            done = subprocess.run(
                [sys.executable, "-m", "margo_cli.main", "device", "capabilities", "--config",
                 str(config), "--format", form], cwd=root, capture_output=True, text=True,
                timeout=60)
            assert done.returncode == 0, done.stderr
            outputs[form] = json.loads(done.stdout)
    assert outputs["margo"]["properties"]["id"] == "edge-cluster"
    assert outputs["margo"]["labels"]["k8s.margo-gitops.dev/gpus"] == 1
    manifest = outputs["cluster"]
    assert is_cluster_manifest(manifest) and validate_cluster_manifest(manifest) == []
    assert manifest["metadata"]["id"] == "edge-cluster"
