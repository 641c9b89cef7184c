"""`margo lint-chart`: Margo's chart rules checked with the real Helm engine.

Charts are written to temporary directories and linted through the command (in process, so
the Helm engine loads once; one test runs the real entry point as a subprocess). Every rule
is tested both ways: a chart that breaks it is reported with file, line and rule, and the
look-alike that does not break it (a `lookup` in a comment, a `topologyKey` on hostnames)
is not.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from authoring.chartlint import schema_allows, values_define
from margo_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "examples" / "fleet" / "apps"
HA_WEB = APPS / "com-example-ha-web"

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: {{ .Values.replicaCount }}
  selector:
    matchLabels:
      app: {{ .Release.Name }}
  template:
    metadata:
      labels:
        app: {{ .Release.Name }}
    spec:
      {{- with .Values.pod }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      containers:
        - name: web
          image: "registry.example.com/web:1.0.0"
          resources:
            requests: {cpu: 10m, memory: 16Mi}
            limits: {memory: 32Mi}
"""

SPREAD = {"topologySpreadConstraints": [
    {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
     "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": {"app": "x"}}}]}


def write_chart(root: Path, *, name: str = "demo", api_version: str = "v2",
                values: dict[str, Any] | None = None, templates: dict[str, str] | None = None,
                schema: dict[str, Any] | None = None, crds: dict[str, str] | None = None,
                version: str = "1.0.0") -> Path:
    """A chart directory; by default one Deployment whose pod spec comes from `.Values.pod`."""
    chart = root / name
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        f"apiVersion: {api_version}\nname: {name}\nversion: {version}\n"
        "icon: https://example.com/icon.svg\n")
    (chart / "values.yaml").write_text(yaml.safe_dump(
        values if values is not None else {"replicaCount": 1, "pod": {}}, sort_keys=False))
    for file, text in (templates if templates is not None
                       else {"deployment.yaml": DEPLOYMENT}).items():
        (chart / "templates" / file).write_text(text)
    if schema is not None:
        (chart / "values.schema.json").write_text(json.dumps(schema))
    for file, text in (crds or {}).items():
        (chart / "crds").mkdir(exist_ok=True)
        (chart / "crds" / file).write_text(text)
    return chart


def write_app(root: Path, *, component: str = "demo", revision: str = "1.0.0",
              parameters: dict[str, Any] | None = None) -> Path:
    """An rc.3 ApplicationDescription with one helm component."""
    doc = {
        "apiVersion": "margo.org/v1-alpha1", "kind": "ApplicationDescription", "id": "com-x",
        "metadata": {"name": "X", "version": "1.0.0",
                     "catalog": {"organization": [{"name": "Example"}]}},
        "deploymentProfiles": [{"type": "helm", "id": "x-helm", "components": [
            {"name": component,
             "properties": {"repository": f"oci://127.0.0.1:5000/charts/{component}",
                            "revision": revision}}]}],
        "parameters": parameters or {},
    }
    path = root / "margo.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def target(pointer: str, value: Any = 1, component: str = "demo") -> dict[str, Any]:
    return {"value": value, "targets": [{"pointer": pointer, "components": [component]}]}


def lint(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, list[dict]]:
    """Run `margo lint-chart ... --json` in process: (exit status, findings)."""
    status = main(["lint-chart", *map(str, args), "--json"])
    return status, json.loads(capsys.readouterr().out)


def rules(findings: list[dict]) -> list[tuple[str, str, str, int | None]]:
    """(level, rule, file name relative to the chart root, line) of each finding."""
    return [(f["level"], f["rule"], f["file"].split("/demo/", 1)[-1], f["line"])
            for f in findings if f["level"] != "info"]


# --------------------------------------------------------------------------- the examples


def test_the_ha_example_lints_clean_through_the_real_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "lint-chart",
         "examples/fleet/apps/com-example-ha-web/charts/ha-web",
         "--app", "examples/fleet/apps/com-example-ha-web/margo.yaml"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ("examples/fleet/apps/com-example-ha-web/charts/ha-web: "
                             "0 error(s), 0 warning(s)\n")


def test_the_ha_example_spreads_and_guards_only_when_replicated() -> None:
    """Two replicas get a PodDisruptionBudget and a hostname spread; one replica no budget
    (it would block every node drain); no manifest names a node."""
    with helm.Chart.load(HA_WEB / "charts" / "ha-web") as chart:
        one = chart.render({}, name="web")
        two = chart.render({"replicaCount": 2}, name="web")
        with pytest.raises(helm.HelmValuesError):
            chart.render({"replicaCount": 0}, name="web")
    assert not one["ha-web/templates/pdb.yaml"].strip()
    pdb = yaml.safe_load(two["ha-web/templates/pdb.yaml"])
    assert (pdb["kind"], pdb["spec"]["minAvailable"]) == ("PodDisruptionBudget", 1)
    deployment = yaml.safe_load(two["ha-web/templates/deployment.yaml"])
    assert deployment["spec"]["replicas"] == 2
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
    assert spread[0]["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread[0]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"][
        "matchLabels"]
    assert all("nodeName" not in text and "nodeSelector" not in text for text in two.values())


def test_every_example_chart_is_free_of_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """The example fleet passes; hello-world's `replicas` parameter can reach 2 without a
    spread, which the parameter probe reports as a warning (exit 0), each once."""
    warnings = {}
    for chart in sorted(APPS.glob("*/charts/*")):
        status, findings = lint(capsys, chart, "--app", chart.parents[1] / "margo.yaml")
        assert status == 0, findings
        warnings[chart.name] = [(f["rule"], f["message"]) for f in findings
                                if f["level"] == "warning"]
    assert warnings["ha-web"] == []
    assert warnings["hello-world"] == [(
        "replicas-spread",
        "Deployment 'release-name' can run 2 replicas (parameter 'replicas' can set "
        "replicaCount above 1) without topologySpreadConstraints: Kubernetes may put them "
        "all on one node; spread them over kubernetes.io/hostname"), (
        "resources",
        "container 'hello-world' of Deployment 'release-name' sets no cpu request, memory "
        "request or memory limit (values.yaml defaults): a small edge node is overcommitted "
        "unseen and one container can take the memory of all; set resources.requests (cpu, "
        "memory) and resources.limits.memory")]
    # The other small examples ask for no resources either (ha-web shows how).
    assert {name: [rule for rule, _ in found] for name, found in warnings.items()
            if name not in ("ha-web", "hello-world")} == {
        "inference-server": ["resources"], "line-monitor": ["resources"],
        "model-cache": ["resources"]}


# --------------------------------------------------------------------------- forbidden features


def test_forbidden_chart_features_are_errors(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, api_version="v1", templates={
        "_helpers.tpl": '{{- define "demo.secret" -}}\n'
                        '{{- $s := lookup "v1" "Secret" .Release.Namespace "x" }}\n'
                        '{{- end }}\n',
        "job.yaml": "apiVersion: batch/v1\nkind: Job\nmetadata:\n"
                    "  name: {{ .Release.Name }}-migrate\n"
                    "  annotations:\n    \"helm.sh/hook\": pre-install\nspec:\n  template:\n"
                    "    spec:\n      restartPolicy: Never\n      containers:\n"
                    "        - name: m\n          image: x:1\n"
                    "          resources: {limits: {cpu: 100m, memory: 8Mi}}\n",
        "crd.yaml": "apiVersion: apiextensions.k8s.io/v1\n"
                    "kind: CustomResourceDefinition\nmetadata:\n  name: widgets.example.com\n",
    }, crds={"gadgets.yaml": "apiVersion: apiextensions.k8s.io/v1\n"
                             "kind: CustomResourceDefinition\n"
                             "metadata:\n  name: gadgets.example.com\n"})
    status, findings = lint(capsys, chart)
    assert status == 1
    assert rules(findings) == [
        ("error", "chart-api-version", "Chart.yaml", 1),
        ("error", "crd", "crds/gadgets.yaml", None),
        ("error", "lookup", "templates/_helpers.tpl", 2),
        ("error", "crd", "templates/crd.yaml", 2),
        ("error", "hook", "templates/job.yaml", 6),
    ]
    messages = {f["rule"]: f["message"] for f in findings}
    assert messages["hook"] == ("Job 'release-name-migrate' is a Helm hook (pre-install): "
                                "Margo forbids hooks")
    assert "'v1'" in messages["chart-api-version"]


def test_forbidden_features_behind_a_condition_are_found_in_the_text(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Off by default, so nothing renders; the template text still shows the hook."""
    chart = write_chart(tmp_path, values={"migrate": False}, templates={
        "job.yaml": "{{- if .Values.migrate }}\napiVersion: v1\nkind: ConfigMap\nmetadata:\n"
                    "  name: x\n  annotations:\n    helm.sh/hook: post-upgrade\n{{- end }}\n"})
    status, findings = lint(capsys, chart)
    assert status == 1
    assert rules(findings) == [("error", "hook", "templates/job.yaml", 7)]


def test_a_helm_test_hook_is_a_forbidden_hook(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`helm create`'s templates/tests/test-connection.yaml: a device never runs helm test."""
    chart = write_chart(tmp_path)
    (chart / "templates" / "tests").mkdir()
    (chart / "templates" / "tests" / "test-connection.yaml").write_text(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: \"{{ .Release.Name }}-test\"\n"
        "  annotations:\n    \"helm.sh/hook\": test\nspec:\n  restartPolicy: Never\n"
        "  containers:\n    - name: wget\n      image: busybox\n"
        "      resources: {limits: {cpu: 10m, memory: 8Mi}}\n")
    status, findings = lint(capsys, chart)
    assert status == 1
    assert rules(findings) == [("error", "hook", "templates/tests/test-connection.yaml", 6)]
    assert findings[-1]["message"] == (
        "Pod 'release-name-test' is a Helm hook (test): Margo forbids hooks (a device never "
        "runs helm test: check in a readiness probe, or before publishing)")


def test_capabilities_api_versions_has_needs_the_list_out_of_band(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={"monitor": True}, templates={
        "sm.yaml": '{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}\n'
                   "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata:\n"
                   "  name: {{ .Release.Name }}\n{{- end }}\n"})
    status, findings = lint(capsys, chart)
    assert status == 0
    assert [(f["level"], f["rule"], f["line"]) for f in findings] == [
        ("info", "api-versions", 1)]
    assert "given the API list out of band" in findings[0]["message"]


def test_lookup_look_alikes_are_not_reported(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={"lookup": "table"}, templates={
        "cm.yaml": "{{/* never use lookup here */}}\napiVersion: v1\nkind: ConfigMap\n"
                   "metadata:\n  name: {{ .Release.Name }}\ndata:\n"
                   "  a: {{ .Values.lookup | quote }}\n  b: {{ \"lookup\" | quote }}\n"
                   "  c: lookup\n"})
    status, findings = lint(capsys, chart)
    assert (status, rules(findings)) == (0, [])


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize(("pod", "says"), [
    ({"nodeName": "edge-node-1"}, "sets nodeName 'edge-node-1'"),
    ({"nodeSelector": {"kubernetes.io/hostname": "edge-node-1"}},
     "has a nodeSelector on kubernetes.io/hostname"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["a"]}]}]}}}},
     "has a node affinity on node names"),
    ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["a"]}]}}]}}},
     "has a node affinity on node names"),
])
def test_naming_a_node_is_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    pod: dict[str, Any], says: str) -> None:
    """The pod spec comes from values, so the template has no line to point at."""
    chart = write_chart(tmp_path, values={"replicaCount": 1, "pod": pod})
    status, findings = lint(capsys, chart)
    assert status == 0
    assert rules(findings) == [("warning", "node-name", "templates/deployment.yaml", None)]
    assert findings[-1]["message"].startswith(
        f"Deployment 'release-name' {says} (values.yaml defaults): never name a node")


def test_node_selection_that_names_no_node_is_fine(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    pod = {**SPREAD, "nodeSelector": {"kubernetes.io/arch": "arm64"},
           "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
               {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                 "labelSelector": {}}}]}}}
    chart = write_chart(tmp_path, values={"replicaCount": 3, "pod": pod})
    assert lint(capsys, chart) == (0, [])


def test_a_node_name_behind_a_condition_is_found_in_the_text(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = DEPLOYMENT.replace(
        "      containers:",
        "      {{- if .Values.pin }}\n      nodeName: {{ .Values.pin }}\n      {{- end }}\n"
        "      containers:")
    chart = write_chart(tmp_path, values={"replicaCount": 1, "pod": {}, "pin": ""},
                        templates={"deployment.yaml": template})
    status, findings = lint(capsys, chart)
    assert status == 0
    assert rules(findings) == [("warning", "node-name", "templates/deployment.yaml", 19)]


def test_replicas_without_a_spread_are_a_warning(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path / "bare", values={"replicaCount": 3, "pod": {}})
    status, findings = lint(capsys, chart)
    assert status == 0
    assert rules(findings) == [("warning", "replicas-spread", "templates/deployment.yaml", 6)]
    assert "can run 3 replicas (values.yaml defaults)" in findings[-1]["message"]
    spread = write_chart(tmp_path / "spread", values={"replicaCount": 3, "pod": SPREAD})
    assert lint(capsys, spread) == (0, [])


# --------------------------------------------------------------------------- sharing a device


@pytest.mark.parametrize(("resources", "missing"), [
    ({}, "cpu request, memory request or memory limit"),
    ({"requests": {"cpu": "10m", "memory": "16Mi"}}, "memory limit"),
    ({"limits": {"memory": "32Mi"}}, "cpu request"),
    ({"requests": {"memory": "16Mi"}, "limits": {"cpu": "1", "memory": "32Mi"}}, None),
])
def test_containers_must_say_what_they_need(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            resources: dict[str, Any], missing: str | None
                                            ) -> None:
    """A cpu and a memory request (a limit stands for its request) and a memory limit, on
    init containers too."""
    template = DEPLOYMENT.replace(
        "      containers:",
        "      initContainers:\n        - name: setup\n          image: x:1\n"
        "          resources: {{ toJson .Values.setup }}\n      containers:")
    chart = write_chart(tmp_path, values={"replicaCount": 1, "pod": {}, "setup": resources},
                        templates={"deployment.yaml": template})
    status, findings = lint(capsys, chart)
    assert status == 0
    if missing is None:
        assert findings == []
        return
    assert rules(findings) == [("warning", "resources", "templates/deployment.yaml", 21)]
    assert findings[0]["message"].startswith(
        f"container 'setup' of Deployment 'release-name' sets no {missing} (values.yaml "
        "defaults): ")


def test_object_names_must_come_from_the_release(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A fixed name, in the chart or through a value (fullnameOverride), collides when a
    device runs the chart twice; a name built from .Release.Name does not."""
    chart = write_chart(tmp_path, values={"fullnameOverride": ""}, templates={
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n---\n"
                   "apiVersion: v1\nkind: ConfigMap\nmetadata:\n"
                   "  name: {{ .Values.fullnameOverride | default .Release.Name }}-data\n"})
    status, findings = lint(capsys, chart)
    assert status == 0
    assert rules(findings) == [("warning", "fixed-name", "templates/cm.yaml", 4)]
    assert findings[0]["message"] == (
        "ConfigMap 'settings' has a name that does not come from the release (values.yaml "
        "defaults): a second deployment of the chart on a device (another release) would "
        "collide with it; derive it from .Release.Name")
    app = write_app(tmp_path, parameters={"name": target("fullnameOverride", "shop")})
    status, findings = lint(capsys, chart, "--app", app)
    assert [(f["rule"], f["message"].split(" has ")[0]) for f in findings] == [
        ("fixed-name", "ConfigMap 'settings'"), ("fixed-name", "ConfigMap 'shop-data'")]
    assert "(the application's parameter values for component 'demo')" in \
        findings[1]["message"]


def test_with_the_app_each_problem_is_reported_once(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults, the application's values and the replica probe all render the same
    pinned, unspread Deployment: each problem is printed once, as the defaults show it."""
    chart = write_chart(tmp_path, values={"replicaCount": 3, "pod": {"nodeName": "edge-1"}})
    app = write_app(tmp_path, parameters={"replicas": target("replicaCount", 3)})
    assert main(["lint-chart", str(chart), "--app", str(app)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": warning: ")[1].split(" (")[0] for line in out[:-1]] == [
        "Deployment 'release-name' sets nodeName 'edge-1'",
        "Deployment 'release-name' can run 3 replicas"]
    assert all("(values.yaml defaults)" in line for line in out[:-1]), out
    assert out[-1] == f"{chart}: 0 error(s), 2 warning(s)"


# --------------------------------------------------------------------------- with --app


def test_parameter_pointers_must_exist_in_the_chart(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={
        "replicaCount": 1, "pod": {}, "resources": {}, "image": {"tag": "1.0"},
        "ports": [{"port": 80}]})
    app = write_app(tmp_path, parameters={
        "good": target("image.tag", "2.0"),
        "openMap": target("resources.limits.cpu", "1"),
        "listItem": target("ports[1].port", 81),
        "typo": target("image.tga", "2.0"),
    })
    status, findings = lint(capsys, chart, "--app", app)
    assert status == 1
    errors = [(f["file"], f["line"], f["rule"], f["message"]) for f in findings
              if f["level"] == "error"]
    lines = app.read_text().splitlines()
    typo_line = 1 + next(i for i, line in enumerate(lines) if "image.tga" in line)
    assert errors == [
        (str(app), typo_line, "parameter-pointer",
         "parameter 'typo' targets 'image.tga' of component 'demo', which chart 'demo' does "
         "not define in values.yaml (did you mean 'tag'?): Helm would ignore it")]


def test_values_schema_properties_allow_a_pointer(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    schema = {"type": "object", "properties": {
        "replicaCount": {"type": "integer"}, "pod": {"type": "object"},
        "tuning": {"$ref": "#/definitions/tuning"}},
        "definitions": {"tuning": {"type": "object", "properties": {
            "level": {"type": "integer", "maximum": 5}}}}}
    chart = write_chart(tmp_path, schema=schema)
    app = write_app(tmp_path, parameters={"level": target("tuning.level", 3)})
    assert lint(capsys, chart, "--app", app) == (0, [])
    app = write_app(tmp_path, parameters={"level": target("tuning.level", 9)})
    status, findings = lint(capsys, chart, "--app", app)
    assert status == 1
    assert [(f["rule"], f["file"]) for f in findings] == [("values-schema", str(app))]
    assert "parameter values for component 'demo' do not satisfy the chart's " \
           "values.schema.json" in findings[0]["message"]
    assert "maximum" in findings[0]["message"]
    app = write_app(tmp_path, parameters={"level": target("tuning.levle", 3)})
    status, findings = lint(capsys, chart, "--app", app)
    assert status == 1
    assert "does not define in values.yaml or values.schema.json" in findings[0]["message"]


def test_a_replica_parameter_is_probed_above_one(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """replicaCount defaults to 1, but the application lets users raise it: warn. When the
    chart's schema caps it at 1, more replicas are impossible: no warning."""
    chart = write_chart(tmp_path / "open")
    app = write_app(tmp_path, parameters={"replicas": target("replicaCount", 1)})
    status, findings = lint(capsys, chart, "--app", app)
    assert status == 0
    assert rules(findings) == [("warning", "replicas-spread", "templates/deployment.yaml", 6)]
    assert "(parameter 'replicas' can set replicaCount above 1)" in findings[0]["message"]
    capped = write_chart(tmp_path / "capped", schema={"type": "object", "properties": {
        "replicaCount": {"type": "integer", "maximum": 1}, "pod": {"type": "object"}}})
    assert lint(capsys, capped, "--app", app) == (0, [])


def test_the_app_must_use_this_chart_at_its_version(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path)
    other = write_app(tmp_path, component="something-else")
    status, findings = lint(capsys, chart, "--app", other)
    assert status == 1
    assert [(f["rule"], f["message"]) for f in findings] == [(
        "app-component", "application 'com-x' has no helm component built from chart "
        "'demo' (helm components: something-else)")]
    older = write_app(tmp_path, revision="0.9.0")
    status, findings = lint(capsys, chart, "--app", older)
    assert status == 0
    assert [(f["level"], f["rule"], f["message"]) for f in findings] == [(
        "warning", "chart-version",
        "component 'demo' deploys revision 0.9.0, but the chart is version 1.0.0")]


def test_a_chart_that_fails_with_the_apps_values_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={"greeting": "hi"}, templates={
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n"
                   "  name: {{ .Release.Name }}\ndata:\n"
                   "  g: {{ required \"greeting is required\" .Values.greeting | quote }}\n"
                   "  {{- if .Capabilities.APIVersions.Has \"monitoring.coreos.com/v1\" }}\n"
                   "  monitored: \"yes\"\n  {{- end }}\n"})
    app = write_app(tmp_path, parameters={"greeting": target("greeting", "")})
    status, findings = lint(capsys, chart, "--app", app)
    assert status == 1
    assert [(f["level"], f["rule"], f["file"], f["line"]) for f in findings] == [
        ("info", "api-versions", f"{chart}/templates/cm.yaml", 7),
        ("error", "render", str(app), None)]
    assert findings[1]["message"].startswith(
        "the chart does not render with the application's parameter values for component "
        "'demo': ")
    assert "greeting is required" in findings[1]["message"]


# --------------------------------------------------------------------------- Helm's own lint


def test_helm_lint_findings_keep_their_location(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A template that fails to render is one error (Helm's), located by Helm's message."""
    chart = write_chart(tmp_path, values={"a": 1}, templates={
        "cm.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n"
                   "  a: {{ .Values.a.b.c }}\n"})
    status, findings = lint(capsys, chart)
    assert status == 1
    assert rules(findings) == [("error", "helm-lint", "templates/cm.yaml", 6)]
    assert "can't evaluate field b" in findings[0]["message"]


def test_helm_lint_severities_map_to_levels(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 1.0.0\n")
    status, findings = lint(capsys, chart)
    assert status == 0
    assert [(f["level"], f["rule"], f["message"]) for f in findings] == [
        ("info", "helm-lint", "icon is recommended")]


def test_defaults_that_break_the_schema_are_reported_once_by_helm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={"replicaCount": 20, "pod": {}}, schema={
        "type": "object", "properties": {"replicaCount": {"type": "integer", "maximum": 10}}})
    status, findings = lint(capsys, chart)
    assert status == 1
    assert {f["rule"] for f in findings} == {"helm-lint"}
    assert all("maximum: got 20, want 10" in f["message"] for f in findings)


# --------------------------------------------------------------------------- inputs and output


def test_a_packaged_chart_is_linted_like_its_directory(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path / "src", values={"replicaCount": 2, "pod": {}})
    archive = helm.package(chart, destination=tmp_path)
    status, findings = lint(capsys, archive)
    assert status == 0
    assert [(f["file"], f["line"], f["rule"]) for f in findings] == [
        (f"{archive}/templates/deployment.yaml", 6, "replicas-spread")]


def test_human_output_is_one_line_per_finding(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path, values={"replicaCount": 2, "pod": {"nodeName": "n1"}})
    assert main(["lint-chart", str(chart)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{chart}/templates/deployment.yaml: warning: Deployment 'release-name' sets "
        "nodeName 'n1' (values.yaml defaults): never name a node, let the cluster schedule "
        "and spread with topologySpreadConstraints",
        f"{chart}/templates/deployment.yaml:6: warning: Deployment 'release-name' can run 2 "
        "replicas (values.yaml defaults) without topologySpreadConstraints: Kubernetes may "
        "put them all on one node; spread them over kubernetes.io/hostname",
        f"{chart}: 0 error(s), 2 warning(s)",
    ]


def test_unusable_input_exits_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint-chart", str(tmp_path / "missing")]) == 2
    assert "missing: error: no such chart directory or archive" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "Chart.yaml").write_text("apiVersion: v2\nname: [broken\n")
    status, findings = lint(capsys, broken)
    assert status == 2
    assert [(f["file"], f["rule"]) for f in findings] == [(str(broken), "chart-unusable")]
    assert "cannot load Chart.yaml" in findings[0]["message"]
    not_an_archive = tmp_path / "chart.tgz"
    not_an_archive.write_bytes(b"not gzip")
    assert main(["lint-chart", str(not_an_archive)]) == 2
    assert "not a chart archive" in capsys.readouterr().err


def test_an_unusable_application_exits_two(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    chart = write_chart(tmp_path)
    assert main(["lint-chart", str(chart), "--app", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: error: cannot read" in capsys.readouterr().err
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text("apiVersion: margo.org/v1-alpha1\nkind: ApplicationDescription\n"
                       "id: Bad_Id\n")
    status, findings = lint(capsys, chart, "--app", invalid)
    assert status == 2
    assert {f["rule"] for f in findings} == {"app-invalid"}
    assert any(f["line"] == 3 and f["message"].startswith("$.id:") for f in findings)


# --------------------------------------------------------------------------- the value walkers


def test_values_define_and_schema_allows() -> None:
    values = {"image": {"tag": "1"}, "resources": {}, "extra": None, "ports": [{"port": 1}],
              "empty": []}
    assert values_define(values, ("image", "tag"))
    assert values_define(values, ("resources", "limits", "cpu"))
    assert values_define(values, ("extra", "anything"))
    assert values_define(values, ("ports", 3, "port"))
    assert values_define(values, ("empty", 0, "x"))
    assert not values_define(values, ("ports", 0, "name"))
    assert not values_define(values, ("image", "tag", "deeper"))
    assert not values_define(values, ("image", 0))
    assert not values_define({}, ("anything",))
    schema = {"properties": {"a": {"additionalProperties": {"type": "string"}},
                             "b": {"type": "array", "items": {"properties": {"c": {}}}},
                             "d": {"patternProperties": {"^x-": {}}},
                             "e": {"anyOf": [{"properties": {"f": {}}}, {"type": "null"}]}}}
    assert schema_allows(schema, ("a", "any"))
    assert schema_allows(schema, ("b", 4, "c"))
    assert schema_allows(schema, ("d", "x-1"))
    assert schema_allows(schema, ("e", "f"))
    assert not schema_allows(schema, ("d", "y"))
    assert not schema_allows(schema, ("b", 0, "z"))
    assert not schema_allows({"type": "object"}, ("typo",))
    assert not schema_allows({"$ref": "#/loop", "loop": {"$ref": "#/loop"}}, ("a",))


def test_the_command_is_documented() -> None:
    guide = (ROOT / "docs" / "helm-charts.md").read_text()
    assert "margo lint-chart" in guide
    for rule in ("lookup", "hook", "crd", "replicas-spread", "node-name", "parameter-pointer",
                 "api-versions", "resources", "fixed-name"):
        assert f"`{rule}`" in guide, rule
    assert textwrap.dedent(guide).count("topologySpreadConstraints") >= 2
