"""The telemetry variables on the real engines, read back from what they run:

- **Compose** on the session's Docker engine: every container's environment as the engine
  reports it (`docker inspect`), the workload's own value kept, and a container that sends
  an OTLP/HTTP JSON log record (busybox `wget --post-data`) to
  `$HTTP_OTEL_EXPORTER_OTLP_ENDPOINT` is received by the real collector;
- **Helm** on the real control plane: the post-render step (our Helm plugin, run by the
  in-process Helm engine) put the variables into the pods the ReplicaSet controller made
  (their spec, read from the API server), into the init container, into the CronJob's and
  the Job's templates, and left the chart's own value alone; an upgrade keeps them;
- a change of what is injected reconfigures what runs.

Kubernetes' doctor with a collector workload and its Service is in test_kube_real.py.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kits.chartkit import actions, converge, make_deployment, publish_chart, write_chart
from kits.composekit import PROJECT, compose_deployment
from kits.dockerkit import (
    DockerEngine,
    ImageSet,
    clear_engine,
    compose_package,
    environment,
    web_service,
)
from kits.kubekit import KubeCluster
from kits.otelkit import Collector

from reconciler.charts import ChartCache
from reconciler.drivers.compose import ComposeDriver
from reconciler.drivers.helm import HelmDriver
from reconciler.oci import OciClient
from reconciler.releases import release_name
from reconciler.telemetry import Injection, with_injection

HTTP, GRPC = "HTTP_OTEL_EXPORTER_OTLP_ENDPOINT", "GRPC_OTEL_EXPORTER_OTLP_ENDPOINT"
PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"


def otlp_log(service: str, body: str) -> str:
    """An OTLP/HTTP JSON export request with one log record (what an SDK would send)."""
    return json.dumps({"resourceLogs": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeLogs": [{"logRecords": [{"severityText": "INFO",
                                       "body": {"stringValue": body}}]}]}]})


@pytest.fixture
def engine(docker_engine: DockerEngine, test_images: ImageSet) -> Iterator[DockerEngine]:
    yield docker_engine
    clear_engine(docker_engine, test_images.web_1)


def test_compose_containers_get_the_variables_and_reach_the_collector(
        engine: DockerEngine, test_images: ImageSet, registry: str, tmp_path: Path,
        otel_collector: Collector) -> None:
    # The sender shares the host's network (the test collector listens on loopback only);
    # `$$` is Compose's literal dollar, so its shell expands the injected variable.
    send = (f"wget -q -O- --header 'Content-Type: application/json' --post-data \"$$BODY\" "
            f"\"$${HTTP}/v1/logs\" && echo sent; "
            'trap "exit 0" TERM; sleep 3600 & wait')
    services = {
        "web": web_service(test_images.web_1, environment={"GREETING": "${GREETING}",
                                                           PROTOCOL: "http/json"}),
        "sender": {"image": test_images.web_1, "network_mode": "host",
                   "environment": {"BODY": otlp_log("compose-sender", "hello from compose")},
                   "command": ["sh", "-c", send]}}
    injection = Injection(http_endpoint=otel_collector.http, grpc_endpoint=otel_collector.grpc)
    with OciClient(timeout=10.0) as oci:
        repository = compose_package(oci, f"oci://{registry}/telemetry/compose", "1.0.0",
                                     services)
        driver = ComposeDriver(tmp_path / "work", oci, docker=engine.docker,
                               compose=engine.compose, docker_host=engine.host,
                               injection=injection, grace_seconds=5.0, command_timeout=60.0)
        desired = with_injection([compose_deployment(repository)], injection)
        assert actions(converge(driver, desired)) == ["install:hello-world"]
        web = environment(engine, f"{PROJECT}-web-1")
        assert (web[HTTP], web[GRPC]) == (otel_collector.http, otel_collector.grpc)
        assert web[PROTOCOL] == "http/json"  # the workload's own value wins
        assert web["GREETING"] == "Hello"
        sender = environment(engine, f"{PROJECT}-sender-1")
        assert (sender[HTTP], sender[PROTOCOL]) == (otel_collector.http, "http/protobuf")
        (record,) = otel_collector.wait_for("the container's log record", lambda: [
            r for r in otel_collector.received().logs
            if r.resource.get("service.name") == "compose-sender"])
        assert record.body == "hello from compose"
        # Another collector address is a reconfigure: the containers are recreated with it.
        moved = Injection(http_endpoint="http://127.0.0.1:1")
        driver.injection = moved
        assert actions(converge(driver, with_injection([compose_deployment(repository)],
                                                       moved))) == ["reconfigure:hello-world"]
        assert environment(engine, f"{PROJECT}-web-1")[HTTP] == "http://127.0.0.1:1"


JOBS = textwrap.dedent("""\
    apiVersion: batch/v1
    kind: CronJob
    metadata: {name: {{ .Release.Name }}-tick}
    spec:
      schedule: "0 3 * * *"
      jobTemplate:
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{name: tick, image: registry.example.com/greeter:1.0.0}]
    ---
    apiVersion: batch/v1
    kind: Job
    metadata: {name: {{ .Release.Name }}-once}
    spec:
      template:
        spec:
          restartPolicy: Never
          containers: [{name: once, image: registry.example.com/greeter:1.0.0}]
    """)
# The greeter chart's Deployment, with an init container and a container of its own that
# sets the protocol itself.
INIT = ("      initContainers: [{name: migrate, image: registry.example.com/greeter:1.0.0}]\n"
        "      containers:\n")
OWN_ENV = ("          env: [{name: OTEL_EXPORTER_OTLP_PROTOCOL, value: grpc}]\n"
           "          resources:\n")


@pytest.fixture(scope="module")
def chart_repository(registry: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    src = tmp_path_factory.mktemp("telemetry-charts")
    for version in ("1.0.0", "2.0.0"):
        chart = write_chart(src, name="observed", version=version, deployment=True)
        deployment = chart / "templates" / "deployment.yaml"
        text = deployment.read_text().replace("      containers:\n", INIT, 1)
        deployment.write_text(text.replace("          resources:\n", OWN_ENV, 1))
        (chart / "templates" / "jobs.yaml").write_text(JOBS)
        repository = publish_chart(registry, chart, repo_path="telemetry")
    return repository


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_helm_post_render_injects_into_every_pod_template(
        kube: KubeCluster, chart_repository: str, tmp_path: Path) -> None:
    injection = Injection(http_endpoint="http://otel-collector.observability:4318",
                          grpc_endpoint="http://otel-collector.observability:4317")
    namespace = "observed"
    name = release_name("5f0c7a52-7f5e-4c1e-9d43-0b5a1d9e2a10", "observed")
    with ChartCache(tmp_path / "charts") as charts:
        driver = HelmDriver(charts, kubeconfig=kube.device_kubeconfig(), injection=injection)
        try:
            desired = with_injection([make_deployment(
                {"observed": (chart_repository, "1.0.0")}, namespace=namespace)], injection)
            assert actions(converge(driver, desired)) == ["install:observed"]
            pods = kube.until("the Deployment's pod", lambda: kube.pods(
                namespace, f"app.kubernetes.io/instance={name}"))
            spec = pods[0]["spec"]  # made by the ReplicaSet controller from the template
            assert env_of(spec["containers"][0]) == {
                HTTP: injection.http_endpoint, GRPC: injection.grpc_endpoint,
                PROTOCOL: "grpc"}  # the chart's own protocol, not ours
            assert env_of(spec["initContainers"][0]) == {
                HTTP: injection.http_endpoint, GRPC: injection.grpc_endpoint,
                PROTOCOL: "http/protobuf"}
            base = f"/apis/batch/v1/namespaces/{namespace}"
            cron = kube.admin.request("GET", f"{base}/cronjobs/{name}-tick").json()
            job = kube.admin.request("GET", f"{base}/jobs/{name}-once").json()
            for template in (cron["spec"]["jobTemplate"]["spec"]["template"],
                             job["spec"]["template"]):
                assert env_of(template["spec"]["containers"][0])[HTTP] == injection.http_endpoint
            # An upgrade runs the same post-render step.
            desired = with_injection([make_deployment(
                {"observed": (chart_repository, "2.0.0")}, namespace=namespace)], injection)
            assert actions(converge(driver, desired)) == ["upgrade:observed"]
            manifest = driver.config(namespace).status(name)["manifest"]
            assert manifest.count(f"value: {injection.http_endpoint}") == 4
        finally:
            driver.close()
