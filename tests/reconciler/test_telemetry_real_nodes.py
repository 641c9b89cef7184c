"""The Margo telemetry variables on real nodes (issue 36 with issue 31): what the Helm
driver's post-render step injected is read back from the environment of the RUNNING
container (exec through the API server to the kubelet, not the pod spec), and that
container's OTLP/HTTP request reaches a collector DaemonSet on the same cluster through its
Service, by the name the device injected (CoreDNS and kube-proxy). The doctor and the
capability report find that collector.

The collector here is a stand-in that only receives: busybox `nc` on the OTLP/HTTP port,
printing each request it gets to its log and answering 200 `{}` (no Collector image can be
pulled or built for these nodes; the real OpenTelemetry Collector receives the same request
from a container on the Docker engine in test_telemetry_engines.py). To the doctor it is a
collector like any other: a DaemonSet named as one, with a Service on the OTLP ports.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.chartkit import (
    actions,
    converge,
    deployment_template,
    make_deployment,
    publish_chart,
    write_chart,
)
from kits.kubekit import RealCluster

from reconciler.charts import ChartCache
from reconciler.drivers.helm import HelmDriver
from reconciler.kubernetes.client import KubeClient
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.discovery import discover
from reconciler.kubernetes.doctor import doctor
from reconciler.telemetry import Injection, with_injection

NAMESPACE, COLLECTOR_NS = "observed", "observability"
ENDPOINT = f"http://otel-collector.{COLLECTOR_NS}:4318"
HTTP, PROTOCOL = "HTTP_OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"
IMAGE = "registry.example.com/greeter:1.0.0"  # busybox: sh, nc, wget
MARKER = "margo-real-node-log-record"

#: The receiver's handler, run by `nc` for each connection (stdin and stdout: the socket):
#: the request line, headers and body (Content-Length bytes) to the log, then 200 `{}`.
HANDLER = r"""n=0
cr=$(printf '\r')
while IFS= read -r line; do
  line=${line%"$cr"}
  echo "$line" >&2
  case "$line" in [Cc]ontent-[Ll]ength:*) n=${line#*:}; n=${n# };; '') break;; esac
done
head -c "$n" >&2
echo >&2
printf 'HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}'
"""
RECEIVE = f"cat > /tmp/otlp.sh <<'EOF'\n{HANDLER}EOF\nexec nc -ll -p 4318 -e sh /tmp/otlp.sh"


def collector() -> list[dict[str, Any]]:
    """The stand-in collector: a DaemonSet labelled as an OpenTelemetry Collector, and the
    Service by the name the device injects."""
    labels = {"app.kubernetes.io/name": "opentelemetry-collector", "app": "otel-collector"}
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet",
                 "metadata": {"name": "otel-collector", "namespace": COLLECTOR_NS,
                              "labels": labels},
                 "spec": {"selector": {"matchLabels": {"app": "otel-collector"}},
                          "template": {"metadata": {"labels": labels}, "spec": {
                              "terminationGracePeriodSeconds": 1,
                              "containers": [{"name": "receiver", "image": IMAGE,
                                              "command": ["sh", "-c", RECEIVE]}]}}}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "otel-collector", "namespace": COLLECTOR_NS},
               "spec": {"selector": {"app": "otel-collector"},
                        "ports": [{"name": "otlp-http", "port": 4318}]}}
    return [daemonset, service]


def otlp_log() -> str:
    """An OTLP/HTTP JSON export request with one log record, as an SDK would send it."""
    return json.dumps({"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"body": {"stringValue": MARKER}}]}]}]}, separators=(",", ":"))


def sender_deployment(script: str) -> str:
    """The workload: sends one log record to the injected endpoint, then keeps running."""
    return deployment_template(f"          image: {IMAGE}\n          command: [sh, -c, {script}]\n",
                               pod="      terminationGracePeriodSeconds: 1\n")


@pytest.fixture
def sender_chart(registry: str, tmp_path: Path) -> str:
    # (busybox 1.35's wget crashes with -T or --header here, so neither is given.)
    script = (f"until wget -q -O - --post-data {shlex.quote(otlp_log())} "
              f"\"${HTTP}/v1/logs\"; do sleep 1; done; echo sent; exec sleep 3600")
    chart = write_chart(tmp_path / "src", version="1.0.0")
    (chart / "templates" / "deployment.yaml").write_text(
        sender_deployment(json.dumps(script)))
    return publish_chart(registry, chart, repo_path="telemetry-real")


@pytest.fixture
def driver(real_kube: RealCluster, tmp_path: Path) -> Iterator[HelmDriver]:
    with ChartCache(tmp_path / "cache") as cache:
        helm = HelmDriver(cache, kubeconfig=real_kube.device_kubeconfig(),
                          injection=Injection(http_endpoint=ENDPOINT))
        yield helm
        helm.close()


def running(kube: RealCluster, namespace: str, count: int = 1) -> list[dict[str, Any]]:
    """The namespace's `count` pods, once every one's container has started."""
    def started() -> list[dict[str, Any]] | None:
        pods = [p for p in kube.pods(namespace) if not p["metadata"].get("deletionTimestamp")]
        return pods if len(pods) == count and all(
            any(s.get("started") for s in (p.get("status") or {}).get("containerStatuses")
                or []) for p in pods) else None

    found: list[dict[str, Any]] = kube.until(f"{count} running pod(s) in {namespace}", started,
                                             timeout=90)
    return found


def test_the_running_container_has_the_variables_and_reaches_the_collector(
        driver: HelmDriver, real_kube: RealCluster, sender_chart: str) -> None:
    real_kube.apply({"apiVersion": "v1", "kind": "Namespace",
                     "metadata": {"name": COLLECTOR_NS}})
    for obj in collector():
        real_kube.apply(obj)
    receivers = running(real_kube, COLLECTOR_NS, count=2)  # one per node

    desired = with_injection([make_deployment({"sender": (sender_chart, "1.0.0")},
                                              namespace=NAMESPACE)], driver.injection)
    assert actions(converge(driver, desired)) == ["install:sender"]
    [pod] = running(real_kube, NAMESPACE)

    # The container's own environment, as the process in it sees it.
    code, env, _ = real_kube.pod_exec(NAMESPACE, pod["metadata"]["name"], ["env"])
    variables = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    assert code == 0 and variables[HTTP] == ENDPOINT, env
    assert variables[PROTOCOL] == "http/protobuf"  # the default, made explicit

    # Its request, received by the collector through the Service name it was given.
    name = pod["metadata"]["name"]
    def received() -> str:
        return "".join(real_kube.pod_log(COLLECTOR_NS, receiver["metadata"]["name"])
                       for receiver in receivers)  # whichever node's kube-proxy picked

    try:
        real_kube.until("the sender's request sent", lambda: "sent" in real_kube.pod_log(
            NAMESPACE, name), timeout=60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the sender: {real_kube.pod_log(NAMESPACE, name)!r}; "
                             f"the collector: {received()!r}") from None
    log = received()
    assert "POST /v1/logs HTTP/1.1" in log and MARKER in log, log

    # The doctor and the capability report find the collector that received it.
    with KubeClient.from_kubeconfig(real_kube.device_kubeconfig()) as client:
        report = doctor(client)
        document = capabilities_document(discover(client), device_id="real-nodes")
    check = report.check("otel-collector")
    assert check.status == "pass", check
    assert check.message == (f"DaemonSet {COLLECTOR_NS}/otel-collector receives OTLP through "
                             f"Service {COLLECTOR_NS}/otel-collector")
    assert document["properties"]["otelCollector"] is True
