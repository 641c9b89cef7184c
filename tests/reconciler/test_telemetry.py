"""The Margo telemetry requirements on the device, with a real OpenTelemetry Collector
(tools/otel, built from its Go modules) on loopback:

- what is injected, and where the workload's own values win (pure functions, the same the
  drivers and `margo device plan` use: Compose services and every pod template of a
  rendered chart, Jobs, CronJobs and custom resources included);
- the configuration's located errors;
- the device client's own metrics and log records, parsed from what the collector wrote,
  and a cycle that does not wait for a collector that is away;
- the doctor of a device that is no cluster: the collector answers, or it says why not.

The real engines (Docker, the Kubernetes control plane) are in test_telemetry_engines.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.chartkit import publish_example_charts
from kits.devicekit import Device, new_device, once, steps
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.netkit import unanswered_port
from kits.otelkit import Collector

from margo.errors import DocumentError
from margo.loading import load_document
from margo_cli.main import main
from reconciler.config import parse_config
from reconciler.datadir import exclusive
from reconciler.telemetry import Injection
from reconciler.telemetry.inject import compose_injection, inject_files, inject_manifests

INJECTION = Injection(http_endpoint="http://collector:4318",
                      grpc_endpoint="http://collector:4317", protocol="grpc")
ALL = ["HTTP_OTEL_EXPORTER_OTLP_ENDPOINT", "GRPC_OTEL_EXPORTER_OTLP_ENDPOINT",
       "OTEL_EXPORTER_OTLP_PROTOCOL"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_compose_services_get_what_they_do_not_set_themselves() -> None:
    compose = {"services": {
        "web": {"image": "web", "environment": {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}},
        "worker": {"image": "w", "environment": ["GRPC_OTEL_EXPORTER_OTLP_ENDPOINT"],
                   "env_file": ["./otel.env"]},
        "plain": {"image": "p"}}}
    files = {"otel.env": b"# mine\nHTTP_OTEL_EXPORTER_OTLP_ENDPOINT=http://mine:4318\n"}
    found = {s.service: s for s in compose_injection(compose, files, INJECTION)}
    assert list(found["plain"].added) == ALL and found["plain"].kept == ()
    assert list(found["web"].added) == ALL[:2]
    assert found["web"].kept == ("OTEL_EXPORTER_OTLP_PROTOCOL",)
    assert list(found["worker"].added) == ["OTEL_EXPORTER_OTLP_PROTOCOL"]
    assert set(found["worker"].kept) == set(ALL[:2])
    # `$` would be interpolated by Compose: doubled in the override.
    odd = Injection(http_endpoint="http://c:4318/$x")
    (entry,) = compose_injection({"services": {"a": {"image": "a"}}}, {}, odd)
    assert entry.override()["environment"]["HTTP_OTEL_EXPORTER_OTLP_ENDPOINT"] == \
        "http://c:4318/$$x"
    assert compose_injection(compose, files, None) == []


MANIFESTS = textwrap.dedent("""\
    ---
    # Source: app/templates/config.yaml
    apiVersion: v1
    kind: ConfigMap
    metadata: {name: app-otel}
    data: {OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf, other: "on"}
    ---
    # Source: app/templates/deployment.yaml
    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: web}
    spec:
      selector: {matchLabels: {app: web}}
      template:
        metadata: {labels: {app: web}}
        spec:
          initContainers: [{name: migrate, image: busybox}]
          containers:
            - name: app
              image: busybox
              env: [{name: HTTP_OTEL_EXPORTER_OTLP_ENDPOINT, value: "http://mine:4318"}]
            - name: side
              image: busybox
              envFrom: [{configMapRef: {name: app-otel}}]
    ---
    # Source: app/templates/cronjob.yaml
    apiVersion: batch/v1
    kind: CronJob
    metadata: {name: tick}
    spec:
      schedule: "*/5 * * * *"
      jobTemplate:
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{name: tick, image: busybox}]
    ---
    # Source: app/templates/rollout.yaml
    apiVersion: argoproj.io/v1alpha1
    kind: Rollout
    metadata: {name: canary}
    spec:
      template:
        spec:
          containers: [{name: app, image: busybox}]
    """)


def test_every_container_of_every_pod_template_keeps_its_own_values() -> None:
    stream, report = inject_manifests(MANIFESTS, INJECTION)
    documents = {d["kind"]: d for d in yaml.safe_load_all(stream)}
    assert "# Source: app/templates/deployment.yaml" in stream  # Helm's file markers kept
    assert documents["ConfigMap"]["data"]["other"] == "on"  # untouched documents verbatim
    pod = documents["Deployment"]["spec"]["template"]["spec"]
    assert env_of(pod["initContainers"][0]) == {
        "HTTP_OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "GRPC_OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    app, side = pod["containers"]
    assert env_of(app)["HTTP_OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://mine:4318"
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" not in env_of(side)  # its ConfigMap sets it
    cron = documents["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert list(env_of(cron["containers"][0])) == ALL
    rollout = documents["Rollout"]["spec"]["template"]["spec"]["containers"][0]
    assert list(env_of(rollout)) == ALL
    rows = {(r.object, r.container): (r.added, r.kept) for r in report}
    assert rows[("Deployment/web", "app")] == (tuple(ALL[1:]), (ALL[0],))
    assert rows[("Deployment/web", "init:migrate")] == (tuple(ALL), ())
    # Files of a rendered chart: envFrom looked up across them; a file without pods kept
    # byte for byte.
    config, rest = MANIFESTS.split("---\n# Source: app/templates/deployment.yaml")
    files, _ = inject_files({"config.yaml": config, "rest.yaml": "---\n# Source: x" + rest},
                            INJECTION)
    assert files["config.yaml"] == config
    side = yaml.safe_load_all(files["rest.yaml"]).__next__()["spec"]["template"]["spec"]
    assert "OTEL_EXPORTER_OTLP_PROTOCOL" not in env_of(side["containers"][1])


def config_problems(tmp_path: Path, telemetry: dict[str, Any], *, driver: str = "compose",
                    host: dict[str, Any] | None = None) -> list[str]:
    doc = {"device": {"id": "d"}, "server": {"url": "http://s", "clientId": "c",
                                             "tokenFile": "t"},
           "source": {"type": "margo-rest"}, "driver": {"type": driver}, "dataDir": "data",
           "telemetry": telemetry}
    if host is not None:
        doc["capabilities"] = {"host": host}
    path = tmp_path / "device.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        parse_config(load_document(path.read_bytes(), file=str(path)), base=tmp_path)
    except DocumentError as exc:
        return [p.format() for p in exc.problems]
    return []


def test_bad_telemetry_configuration_is_a_located_error(tmp_path: Path) -> None:
    (problem,) = config_problems(tmp_path, {"collector": "http://127.0.0.1:4318",
                                            "inject": {"protocol": "grpc"}})
    assert "device.yaml:" in problem and "$.telemetry.inject.protocol" in problem
    assert "needs telemetry.inject.grpcEndpoint" in problem
    (problem,) = config_problems(tmp_path, {"collector": "http://c:4318", "inject": {
        "certificate": str(tmp_path / "missing.pem")}})
    assert "$.telemetry.inject.certificate" in problem and "not a readable file" in problem
    assert config_problems(tmp_path, {"collector": "http://c:4318", "inject": {
        "certificate": "/etc/otel/ca.pem"}}, driver="helm") == []  # a path in the pod
    (problem,) = config_problems(tmp_path, {"collector": "ftp://c"})
    assert "$.telemetry.collector" in problem
    (problem,) = config_problems(tmp_path, {"collector": "http://c:4318"},
                                 host={"otelCollector": True})
    assert "$.capabilities.host.otelCollector" in problem and "found, not declared" in problem


@pytest.fixture(scope="module")
def server(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    workdir = tmp_path_factory.mktemp("telemetry")
    publish_example_charts(registry)
    with fleet_server(workdir, fleet=write_fleet(workdir / "fleet", registry=registry,
                                                 intents={})) as running:
        yield running


def with_telemetry(device: Device, telemetry: dict[str, Any]) -> None:
    config = yaml.safe_load(device.config.read_text())
    config["telemetry"] = telemetry
    device.config.write_text(yaml.safe_dump(config))


def test_the_device_client_sends_its_metrics_and_logs_to_the_collector(
        server: FleetServer, otel_collector: Collector) -> None:
    device = new_device(server, "telemetry-own")
    with_telemetry(device, {"collector": otel_collector.http, "interval": "1s"})
    done = subprocess.run([sys.executable, "-m", "margo_cli.main", "device", "once", "--config",
                           str(device.config), "--json", "--log-level", "info"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert steps(json.loads(done.stdout.splitlines()[-1])) == [("install", "ok")]
    deployment = str(server.device(device.device_id)["deployments"][0]["deploymentId"])
    me = {"margo.device.id": device.device_id}
    (cycle,) = otel_collector.wait_for("the cycle counted", lambda: otel_collector.metric_points(
        "margo.device.reconcile.cycles", result="converged", **me))
    assert cycle.value == 1 and cycle.resource["service.name"] == "margo-device"
    (duration,) = otel_collector.metric_points("margo.device.reconcile.duration", **me)
    assert duration.count == 1 and duration.sum > 0
    (apply,) = otel_collector.metric_points("margo.device.applies", **me)
    assert (apply.attributes, apply.value) == ({"action": "install", "outcome": "ok"}, 1)
    (version,) = otel_collector.metric_points("margo.device.manifest.version", **me)
    assert version.value >= 1 and version.attributes == {"source": "margo-rest"}
    (journal,) = otel_collector.metric_points("margo.device.journal.depth", **me)
    assert journal.value == 0
    assert otel_collector.metric_points("margo.device.sync.last_success", **me)[0].value > 0
    installed = otel_collector.wait_for("the install's log record", lambda: [
        r for r in otel_collector.log_records(**me) if "install of" in str(r.body)])
    assert installed[0].attributes["margo.deployment.id"] == deployment
    assert installed[0].severity == "INFO"
    # The render driver wrote the injected manifests; `margo device plan` shows them.
    (rendered,) = device.output.glob("*/*/hello-world/templates/deployment.yaml")
    assert f"value: {otel_collector.http}" in rendered.read_text()
    shown = subprocess.run([sys.executable, "-m", "margo_cli.main", "device", "plan",
                            "--config", str(device.config)], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    assert f"HTTP_OTEL_EXPORTER_OTLP_ENDPOINT={otel_collector.http}" in shown
    assert "  unchanged   " in shown and "hello-world: up to date" in shown
    assert ": + HTTP_OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL" in shown
    plan_json = json.loads(subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "device", "plan", "--config",
         str(device.config), "--json"], capture_output=True, text=True, timeout=120,
        check=True).stdout)
    (step,) = plan_json["steps"]
    assert step["action"] == "unchanged" and step["deploymentId"] == deployment
    assert [row["where"].split("/")[0] for row in step["injection"]] == ["Deployment"]


def test_a_collector_that_is_away_costs_the_cycle_nothing(server: FleetServer) -> None:
    device = new_device(server, "telemetry-away")
    with unanswered_port() as port:
        with_telemetry(device, {"collector": f"http://127.0.0.1:{port}", "timeout": "1s"})
        report = once(device)  # exit 0: converged
    assert steps(report) == [("install", "ok")] and report["converged"]


def test_the_host_doctor_finds_the_collector_or_says_why_not(
        server: FleetServer, otel_collector: Collector, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    device = new_device(server, "telemetry-doctor", with_intent=False)
    assert main(["device", "doctor", "--config", str(device.config)]) == 1
    output = capsys.readouterr().out
    assert "otel-collector      fail" in output and "no collector is configured" in output
    with unanswered_port() as port:
        with_telemetry(device, {"collector": f"http://127.0.0.1:{port}"})
        assert main(["device", "doctor", "--config", str(device.config), "--json"]) == 1
    checks = {c["id"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["otel-collector"]["status"] == "fail"
    assert f"no OTLP/HTTP receiver answers at http://127.0.0.1:{port}" in \
        checks["otel-collector"]["message"]
    with_telemetry(device, {"collector": otel_collector.http,
                            "inject": {"grpcEndpoint": otel_collector.grpc}})
    assert main(["device", "rotate-key", "--config", str(device.config)]) == 0  # its key
    capsys.readouterr()
    with exclusive(device.data):  # as a running `margo device run` holds it
        assert main(["device", "doctor", "--config", str(device.config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "pass"
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["otel-collector"] == {
        "id": "otel-collector", "scope": "leader", "status": "pass",
        "message": f"an OTLP/HTTP receiver answers at {otel_collector.http}"}
    assert checks["wfm-client"]["status"] == "pass"
    # The host capability report's otelCollector is the same finding.
    config = yaml.safe_load(device.config.read_text())
    config["capabilities"] = {"host": {"vendor": "ACME"}}
    device.config.write_text(yaml.safe_dump(config))
    assert main(["device", "capabilities", "--config", str(device.config)]) == 0
    assert json.loads(capsys.readouterr().out)["properties"]["otelCollector"] is True
    with unanswered_port() as port:
        with_telemetry(device, {"collector": f"http://127.0.0.1:{port}"})
        assert main(["device", "capabilities", "--config", str(device.config)]) == 0
    assert json.loads(capsys.readouterr().out)["properties"]["otelCollector"] is False


def test_a_device_without_telemetry_never_loads_the_sdk(tmp_path: Path) -> None:
    """A Compose device loads neither the Helm engine nor, without `telemetry:`, the
    OpenTelemetry SDK; with it, the SDK only (in a fresh interpreter, as a device starts)."""
    (tmp_path / "token").write_text("t")
    config = {"device": {"id": "lazy"}, "server": {"url": "http://127.0.0.1:1",
                                                   "clientId": "c", "tokenFile": "token"},
              "source": {"type": "margo-rest"}, "driver": {"type": "compose"},
              "dataDir": "data"}
    probe = ("import sys; from reconciler.assembly import open_reconciler; "
             "from reconciler.config import load_config\n"
             "with open_reconciler(load_config(sys.argv[1])):\n"
             "    print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'helm_python', 'opentelemetry'}))")
    for telemetry, loaded in ((None, "[]"), ({"collector": "http://127.0.0.1:1",
                                              "timeout": "1s"}, "['opentelemetry']")):
        path = tmp_path / "device.yaml"
        path.write_text(yaml.safe_dump({**config, **({"telemetry": telemetry}
                                                     if telemetry else {})}))
        done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                              text=True, timeout=60, check=True)
        assert done.stdout.strip() == loaded
