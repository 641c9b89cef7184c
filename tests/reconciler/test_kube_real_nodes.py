"""The device client's Kubernetes side on real nodes: kubelets that run containers.

Two real nodes (tools/kube/realnode.py: the kubelet and kube-proxy built from the pinned
module, Debian's containerd and CNI plugins, each node in namespaces of its own) on a
control plane of their own. Unlike kwok's simulated nodes, readiness here is the kubelet
running the chart's readiness probe against a real process, a failing container is really
restarted, logs and exec go through the API server to the kubelet, Services are kube-proxy's
rules, and the nodes report the machine's own CPU and memory.

GPU nodes stay simulated (test_kube_real.py, test_cluster_real_e2e.py): these machines
have no GPU, so no kubelet here can advertise one.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.chartkit import (
    actions,
    converge,
    deployment_template,
    greeter,
    make_deployment,
    publish_chart,
    publish_example_charts,
    write_chart,
)
from kits.kubekit import RealCluster, RealNode, RealNodes

from margo.quantity import parse_quantity
from reconciler.charts import ChartCache
from reconciler.drivers.helm import HelmDriver
from reconciler.errors import ApplyError
from reconciler.kubernetes.client import KubeClient
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.discovery import discover
from reconciler.kubernetes.doctor import doctor
from reconciler.releases import release_name
from tools.kube.realnode import REAL_NODE_LABEL, REAL_NODE_TAINT

RELEASE = release_name("5f0c7a52-7f5e-4c1e-9d43-0b5a1d9e2a10", "greeter")

def real_deployment(image: str, probe: int) -> str:
    """A Deployment whose container the kubelet probes (GET / on `probe`) every second."""
    return deployment_template(
        f"          image: {image}\n"
        '          env: [{name: GREETING, value: "{{ .Values.config.greeting }}"}]\n'
        f"          readinessProbe:\n            httpGet: {{path: /, port: {probe}}}\n"
        "            periodSeconds: 1\n",
        replicas="{{ .Values.replicaCount }}", pod="      terminationGracePeriodSeconds: 1\n")


def real_chart(root: Path, version: str, image: str, *, probe: int = 8080) -> Path:
    chart = write_chart(root, version=version)
    (chart / "templates" / "deployment.yaml").write_text(
        real_deployment(image, probe))
    return chart


@pytest.fixture(scope="module")
def charts_on(registry: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`greeter` 1.0.0 and 2.0.0 (ready once their HTTP server answers), 3.0.0 (probed on a
    port nothing serves: never ready) and 4.0.0 (its container exits 3 at start)."""
    src = tmp_path_factory.mktemp("real-charts")
    image = "registry.example.com/greeter:{}"
    for version in ("1.0.0", "2.0.0"):
        repository = publish_chart(registry, real_chart(src, version, image.format(version)),
                                   repo_path="real")
    publish_chart(registry, real_chart(src, "3.0.0", image.format("1.0.0"), probe=9999),
                  repo_path="real")
    publish_chart(registry, real_chart(src, "4.0.0", "registry.example.com/crasher:1.0.0"),
                  repo_path="real")
    return {"greeter": repository, "examples": publish_example_charts(registry)}


@pytest.fixture
def driver(real_kube: RealCluster, tmp_path: Path) -> Iterator[HelmDriver]:
    with ChartCache(tmp_path / "cache") as cache:
        helm_driver = HelmDriver(cache, kubeconfig=real_kube.device_kubeconfig())
        yield helm_driver
        helm_driver.close()


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def live_pods(kube: RealCluster, namespace: str) -> list[dict[str, Any]]:
    return [p for p in kube.pods(namespace) if not p["metadata"].get("deletionTimestamp")]


def test_install_upgrade_and_rollback_wait_for_real_readiness(
        driver: HelmDriver, real_kube: RealCluster, charts_on: dict[str, Any],
        tmp_path: Path) -> None:
    repository = charts_on["greeter"]
    converge(driver, [greeter(repository, "1.0.0", greeting="Servus", wait=True)])
    [pod] = live_pods(real_kube, "edge")
    assert ready(pod) and pod["status"]["containerStatuses"][0]["started"]
    # The container ran, with the value Helm rendered: its output, from the kubelet.
    assert "greeter 1.0.0 says: Servus" in real_kube.pod_log("edge", pod["metadata"]["name"])

    assert actions(converge(driver, [greeter(repository, "2.0.0", greeting="Servus",
                                             wait=True)])) == ["upgrade:greeter"]
    real_kube.until("the old pod gone", lambda: len(live_pods(real_kube, "edge")) == 1)
    [pod] = live_pods(real_kube, "edge")
    code, page, _ = real_kube.pod_exec("edge", pod["metadata"]["name"],
                                       ["wget", "-q", "-O", "-", "http://127.0.0.1:8080/"])
    assert (code, page) == (0, "greeter 2.0.0\n")  # exec, through the API server

    # 3.0.0 is probed on a port nothing serves: the pod runs and is never Ready, `wait`
    # times out, and the old pod serves meanwhile.
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repository, "3.0.0", wait=True, timeout="0m5s")])
    assert caught.value.code == "TIMEOUT" and caught.value.retryable
    assert f"Deployment/edge/{RELEASE} not ready" in caught.value.message
    pods = live_pods(real_kube, "edge")
    assert sorted((p["spec"]["containers"][0]["image"], p["status"]["phase"], ready(p))
                  for p in pods) == [("registry.example.com/greeter:1.0.0", "Running", False),
                                     ("registry.example.com/greeter:2.0.0", "Running", True)]
    events = real_kube.admin.request("GET", "/api/v1/namespaces/edge/events").json()["items"]
    assert any(e["reason"] == "Unhealthy" and "Readiness probe failed" in e["message"]
               for e in events)

    with ChartCache(tmp_path / "rollback") as cache:
        rolling = HelmDriver(cache, kubeconfig=real_kube.device_kubeconfig(),
                             rollback_on_failure=True)
        try:
            with pytest.raises(ApplyError) as caught:
                converge(rolling, [greeter(repository, "3.0.0", wait=True, timeout="0m5s")])
            assert "has been rolled back" in caught.value.message
            history = rolling.config("edge").history(RELEASE)
            assert [(h["status"], h["chart_version"]) for h in history][-1] == (
                "deployed", "2.0.0")
        finally:
            rolling.close()
    real_kube.until("only the 2.0.0 pod", lambda: [
        (p["spec"]["containers"][0]["image"], ready(p)) for p in live_pods(real_kube, "edge")]
        == [("registry.example.com/greeter:2.0.0", True)])


def test_a_container_that_fails_is_restarted_and_the_wait_times_out(
        driver: HelmDriver, real_kube: RealCluster, charts_on: dict[str, Any]) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(charts_on["greeter"], "4.0.0", wait=True,
                                  timeout="0m5s")])
    assert caught.value.code == "TIMEOUT"
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    # The kubelet restarted the container that exited; its last run's output is kept.
    [pod] = real_kube.until("a restart", lambda: [
        p for p in live_pods(real_kube, "edge")
        if p["status"].get("containerStatuses", [{}])[0].get("restartCount", 0) >= 1])
    status = pod["status"]["containerStatuses"][0]
    last = status["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (3, "Error")
    assert not ready(pod)
    # stdout and stderr are two pipes: the kubelet keeps both lines, in either order. The
    # run is reported terminated once its process exits, and the runtime may still be
    # copying a pipe into the log then (seen once under the whole suite: only the stderr
    # line yet), so the log is read until it holds two lines; they must be exactly these.
    lines = real_kube.until("both lines of the last run's log", lambda: (
        found if len(found := sorted(real_kube.pod_log(
            "edge", pod["metadata"]["name"], previous=True).splitlines())) >= 2 else None),
        timeout=30)
    assert lines == ["fatal: DATABASE_URL is not set", "loading configuration"]


def test_spread_over_two_real_nodes_behind_a_service(
        driver: HelmDriver, real_kube: RealCluster, charts_on: dict[str, Any]) -> None:
    """The example HA web chart with two replicas and the hello-world chart, unchanged:
    the scheduler spreads the web pods over both nodes, the kubelets' probes make them
    Ready, and from a pod the Service answers (kube-proxy), by name too (CoreDNS), pods on
    the other node answer, and the API server answers through the `kubernetes` Service."""
    examples = charts_on["examples"]
    web = make_deployment({"ha-web": examples["ha-web"]}, namespace="web", wait=True,
                          parameters={"replicas": (2, "replicaCount", ["ha-web"]),
                                      "message": ("Hi from both", "config.message",
                                                  ["ha-web"])})
    hello = make_deployment({"hello-world": examples["hello-world"]}, namespace="hello",
                            wait=True, deployment_id="8d1e5f0a-2b3c-4d5e-8f90-a1b2c3d4e5f6",
                            parameters={"greeting": ("Servus", "config.greeting",
                                                     ["hello-world"])})
    assert actions(converge(driver, [web, hello])) == ["install:ha-web", "install:hello-world"]
    pods = live_pods(real_kube, "web")
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["real-a", "real-b"]
    assert all(ready(p) for p in pods)
    assert not any("nodeSelector" in p["spec"] or "affinity" in p["spec"] for p in pods)
    for pod in pods:
        assert "ha-web serving: Hi from both" in real_kube.pod_log(
            "web", pod["metadata"]["name"])
    [hello_pod] = live_pods(real_kube, "hello")
    assert real_kube.pod_log("hello", hello_pod["metadata"]["name"]) == \
        "hello-world says: Servus\n"  # the Margo parameter, given to the container

    [service] = real_kube.admin.list("Service", "web")
    cluster_ip = service["spec"]["clusterIP"]
    client, other = sorted(pods, key=lambda p: p["spec"]["nodeName"])
    name = client["metadata"]["name"]
    for _ in range(4):  # either backend, whichever node kube-proxy picks
        assert real_kube.pod_exec("web", name, ["wget", "-q", "-O", "-",
                                                f"http://{cluster_ip}/"])[:2] == (0, "ha-web\n")
    assert real_kube.pod_exec("web", name, [
        "wget", "-q", "-O", "-", f"http://{other['status']['podIP']}:8080/"])[:2] == (
            0, "ha-web\n")
    # Cluster DNS (CoreDNS, as a pod: it reads Services through the `kubernetes` Service):
    # the Service by its short name, and the API server's Service by its full one.
    by_name = f"http://{service['metadata']['name']}/"
    assert real_kube.pod_exec("web", name, ["wget", "-q", "-O", "-", by_name])[:2] == (
        0, "ha-web\n")
    code, answer, _ = real_kube.pod_exec("web", name, [
        "busybox", "nslookup", "kubernetes.default.svc.cluster.local"])
    assert code == 0 and "Address: 10.0.0.1" in answer, answer
    # The API server, through the `kubernetes` Service: busybox has no TLS client the API
    # server accepts, so plain HTTP is sent and the API server's own refusal comes back.
    code, answer, _ = real_kube.pod_exec("web", name, [
        "sh", "-c", r"(printf 'GET /version HTTP/1.0\r\n\r\n'; sleep 2) | nc 10.0.0.1 443"])
    assert code == 0 and "Client sent an HTTP request to an HTTPS server" in answer


def meminfo_bytes(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def test_discovery_and_the_doctor_see_the_real_kubelets(real_kube: RealCluster) -> None:
    kubeconfig = real_kube.device_kubeconfig()
    with KubeClient.from_kubeconfig(kubeconfig) as client:
        doc = capabilities_document(discover(client), device_id="real-nodes")
        report = doctor(client)
    cluster = doc["x-margo-gitops-extensions"]["cluster"]
    nodes = {n["name"]: n for n in cluster["resources"]["nodes"]}
    assert set(nodes) == {"real-a", "real-b"}
    cores, memory = os.cpu_count(), meminfo_bytes("MemTotal")
    for name, node in nodes.items():
        # What the kubelet measured on this machine: every core, all of its memory less
        # the eviction threshold the node keeps free (100Mi, tools/kube/nodeconfig.py).
        assert node["allocatable"]["cpu"] == cores, name
        assert parse_quantity(node["allocatable"]["memory"]) == memory - 100 * 2**20, name
        assert node["ready"] and node["schedulable"], name
        assert node["containerRuntime"].startswith("containerd://1.6"), name
        assert node["kubeletVersion"] == real_kube.version, name
    assert {n["zone"] for n in nodes.values()} == {"zone-a", "zone-b"}
    # rc.3 cpus: what each node has left (CoreDNS's pod requests a little on one).
    assert sorted(c["cores"] for c in doc["properties"]["cpus"]) == sorted(
        n["available"]["cpu"] for n in nodes.values())
    assert doc["labels"]["k8s.margo-gitops.dev/schedulable-nodes"] == 2
    # The kubelets' own conditions, as they report them.
    for node in real_kube.admin.list("Node"):
        conditions = {c["type"]: (c["status"], c["reason"])
                      for c in node["status"]["conditions"]}
        assert conditions == {"MemoryPressure": ("False", "KubeletHasSufficientMemory"),
                              "DiskPressure": ("False", "KubeletHasNoDiskPressure"),
                              "PIDPressure": ("False", "KubeletHasSufficientPID"),
                              "Ready": ("True", "KubeletReady")}
    checks = {c.id: c for c in report.checks}
    for check_id in ("kubelet-ready", "container-runtime", "version-skew"):
        assert checks[check_id].status == "pass", checks[check_id]
        assert {n.name: n.status for n in checks[check_id].nodes} == {
            "real-a": "pass", "real-b": "pass"}
    runtime = {n.name: n.message for n in checks["container-runtime"].nodes}
    assert all(m.startswith("containerd://1.6") for m in runtime.values()), runtime


HOST_PATHS = ("/run/netns", "/run/containerd/containerd.sock", "/var/lib/cni", "/etc/cni",
              "/opt/cni", "/var/lib/kubelet", "/var/lib/containerd", "/var/log/pods",
              "/var/log/containers", "/etc/kubernetes")


def _cmdline(pid: Path) -> str:
    try:
        return (pid / "cmdline").read_bytes().decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""


def _node_cgroups(root: Path, node: str) -> set[str]:
    """The cgroups of the node named `node` (`margo-node-<pid>-<node>`) under every
    controller. The walk stops at a node's cgroup and tolerates folders that vanish under
    it: the other real nodes and their pods come and go while it runs (pathlib's rglob
    raised FileNotFoundError in CI when one did), and only this node's are compared."""
    found: set[str] = set()
    for parent, folders, _ in os.walk(root):  # os.walk ignores folders that vanish
        for name in [name for name in folders if name.startswith("margo-node-")]:
            if name.endswith(f"-{node}"):
                found.add(os.path.join(parent, name))
            folders.remove(name)
    return found


def host_state(folder: Path, node: str) -> dict[str, Any]:
    """What a node could leave on the host: mounts where a node mounts (its folder, /run,
    /var/lib, /var/log, /proc/sys), interfaces its CNI bridge or fabric would make,
    iptables rules, the cgroups of `node`, processes and the paths the components use by
    default.
    Docker engines that other tests run meanwhile mount and unmount too: theirs are left
    out by name."""
    places = (str(folder), "/run", "/var/lib", "/var/log", "/proc/sys")
    mounts = {point for point in (line.split()[4] for line in Path(
        "/proc/self/mountinfo").read_text().splitlines())
        if point.startswith(places) and "docker" not in point}
    links = {line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines()
        if re.search(r"^\d+: (cni0|fabric|f\d+)[:@]| master (cni0|fabric) ", line)}
    rules = [line for line in subprocess.run(["iptables-save"], capture_output=True,
                                             text=True, check=True).stdout.splitlines()
             if not line.startswith(("#", ":"))]
    cgroups = _node_cgroups(Path("/sys/fs/cgroup"), node)
    processes = [pid.name for pid in Path("/proc").iterdir()
                 if pid.name.isdigit() and str(folder) in _cmdline(pid)]
    return {"mounts": mounts, "links": links, "iptables": rules, "cgroups": cgroups,
            "processes": processes, "paths": [p for p in HOST_PATHS if Path(p).exists()]}


def test_a_node_stopped_leaves_the_host_as_it_found_it(real_kube: RealCluster,
                                                       tmp_path: Path) -> None:
    """A third node (tainted, as real nodes are unless told otherwise) runs a pod and
    stops: nothing of it is left on the host."""
    plane = real_kube.plane
    folder = tmp_path / "third"
    before = host_state(folder, "real-c")
    with RealNodes(plane, folder) as extra:
        [node] = extra.start(RealNode("real-c"))
        assert node.ip == "172.31.250.3" and node.pod_cidr == "10.244.3.0/24"
        labels = real_kube.admin.get("Node", "real-c")["metadata"]["labels"]
        assert labels[REAL_NODE_LABEL[0]] == REAL_NODE_LABEL[1]
        real_kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "visitor", "namespace": "default"}, "spec": {
            "nodeName": "real-c", "terminationGracePeriodSeconds": 1,
            "tolerations": [{"key": REAL_NODE_TAINT["key"], "operator": "Exists"}],
            "containers": [{"name": "c", "image": "registry.example.com/hello-world:1.0.0"}]}})
        real_kube.until("the pod Ready", lambda: ready(
            real_kube.admin.get("Pod", "visitor", "default")))
        during = host_state(folder, "real-c")
        assert during["processes"] and during["cgroups"] - before["cgroups"]
    real_kube.admin.delete("Pod", "visitor", "default")
    assert real_kube.admin.find("Node", "real-c") is None  # forgotten
    assert host_state(folder, "real-c") == before
    assert not any(folder.iterdir())  # its files are gone too
