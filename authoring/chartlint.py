"""Margo chart lint: the checks behind `margo lint-chart`.

Margo restricts Helm charts (digest sections 1 and 7): `apiVersion: v2` only, and no
`lookup`, hooks or CRD management, because a device may *render* a chart without any access
to a Kubernetes API and must be able to remove everything it installed. A chart that breaks
these rules installs fine on a developer's cluster and fails on the edge, so the checks run
before a chart is published.

Where possible the chart is *rendered* with the real Helm engine (helm_python) and the
resulting objects are inspected, rather than grepping template text: a `nodeName` that only
appears under `{{ if }}` and a replica count that comes from a helper are both seen the way
Kubernetes would see them. Template text is still scanned for what rendering cannot show
(`lookup`, which renders to nothing offline; hooks or node names behind a condition that is
off by default).

With an ApplicationDescription, every parameter pointer aimed at a helm component built
from this chart must name a key the chart defines (values.yaml, or values.schema.json
properties): a pointer with a typo is silently ignored by Helm and the setting never takes
effect on any device.

Everything here works on an already opened chart (`open_chart`) and returns `Finding`s;
printing and exit codes belong to the command.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final

import yaml

from authoring.values import as_list, dig, schema_allows, suggest_key, values_define
from authoring.workloads import containers, fixed_name, missing_resources
from margo.component_values import helm_values, parse_helm_pointer, set_helm_value
from margo.models import ApplicationDescription, Component, ProfileType

if TYPE_CHECKING:
    import helm_python as helm

__all__ = [
    "LEVELS",
    "AppInput",
    "ChartUnusableError",
    "Finding",
    "LoadedChart",
    "TemplateSource",
    "lint_chart",
    "open_chart",
    "schema_allows",
    "values_define",
]

#: Finding levels, most severe first. Only `error` makes the chart unacceptable.
LEVELS: Final = ("error", "warning", "info")

#: Release name and namespace used for lint renders (what `helm template` uses by default).
RELEASE: Final = "release-name"
NAMESPACE: Final = "default"

HOSTNAME_LABEL: Final = "kubernetes.io/hostname"
REPLICA_KEYS: Final = frozenset({"replicaCount", "replicas"})
REPLICATED_KINDS: Final = frozenset({"Deployment", "StatefulSet", "ReplicaSet",
                                     "ReplicationController"})
POD_TEMPLATE_KINDS: Final = REPLICATED_KINDS | {"DaemonSet", "Job"}
HELM_LINT_LEVELS: Final = {3: "error", 2: "warning", 1: "info"}

_ACTION = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|`[^`]*`')
_LOOKUP = re.compile(r"(?<![\w.$])lookup\b")
_HOOK = re.compile(r"""helm\.sh/hook["']?\s*:""")
_CRD_KIND = re.compile(r"""^\s*kind:\s*["']?CustomResourceDefinition\b""", re.MULTILINE)
_NODE_NAME = re.compile(r"^\s*nodeName\s*:", re.MULTILINE)
_API_VERSIONS = re.compile(r"\.Capabilities\.APIVersions\b")
_HELM_LOCATION = re.compile(r"^[^/\s]+/(\S+?):(\d+)(?::\d+)?\b")
_YAML_LINE = re.compile(r"\byaml: line (\d+)\b")


class ChartUnusableError(Exception):
    """The chart cannot be read at all (missing, not a chart, unparsable Chart.yaml)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One lint result: where, how bad, which rule, and what to do about it."""

    file: str
    line: int | None
    level: str
    rule: str
    message: str
    #: The object (and container) a rendered finding is about: one problem of one object is
    #: reported once, however many renders show it (not part of equality or the JSON).
    subject: str = field(default="", compare=False, repr=False)

    def format(self) -> str:
        """`file:line: level: message` (no line when it is unknown), like `margo validate`."""
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.level}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "level": self.level, "rule": self.rule,
                "message": self.message}

    def sort_key(self) -> tuple[str, int, int, str, str]:
        return (self.file, self.line or 0, LEVELS.index(self.level), self.rule, self.message)


@dataclass(frozen=True, slots=True)
class TemplateSource:
    """A template's text, keyed the way rendered output names it (relative to the chart:
    `templates/x.yaml`, `charts/<sub>/templates/y.yaml`) and shown as `display`."""

    rel: str
    display: str
    text: str


@dataclass
class LoadedChart:
    """An opened chart: the Helm engine's view plus what is needed to report locations."""

    chart: helm.Chart
    directory: Path  # on disk (an archive is expanded into a temporary directory)
    display: str  # what the user named: the prefix of every reported file
    templates: list[TemplateSource] = field(default_factory=list)

    def file(self, rel: str) -> str:
        return os.path.join(self.display, rel) if rel else self.display

    def template(self, rel: str) -> TemplateSource | None:
        return next((t for t in self.templates if t.rel == rel), None)


@dataclass(frozen=True, slots=True)
class AppInput:
    """An ApplicationDescription plus a way to find the line of any JSON path in its file."""

    description: ApplicationDescription
    file: str
    locate: Callable[[tuple[str | int, ...]], int | None] = lambda _path: None


# --------------------------------------------------------------------------- opening


def _engine() -> ModuleType:
    """The Helm engine, loaded on first use: it is 80 MB of Go runtime that only linting a
    chart needs, and the CLI imports this module for every command."""
    import helm_python

    return helm_python


def _load(path: Path) -> helm.Chart:
    engine = _engine()
    try:
        return engine.Chart.load(path)  # type: ignore[no-any-return]
    except engine.HelmError as exc:
        raise ChartUnusableError(f"{path}: cannot load the chart: {_one_line(str(exc))}") from None


def _subchart_sources(directory: Path, prefix: str, display: str) -> Iterator[TemplateSource]:
    """Templates of the subcharts under `charts/` (Chart.templates lists only the chart's
    own), named by chart name as rendered output names them."""
    charts = directory / "charts"
    if not charts.is_dir():
        return
    for entry in sorted(charts.iterdir()):
        is_dir_chart = entry.is_dir() and (entry / "Chart.yaml").is_file()
        if not is_dir_chart and not entry.name.endswith(".tgz"):
            continue
        with _load(entry) as sub:
            sub_prefix = f"{prefix}charts/{sub.name}/"
            sub_display = os.path.join(display, "charts", entry.name)
            yield from _sources(sub, sub_prefix, sub_display)
            if is_dir_chart:
                yield from _subchart_sources(entry, sub_prefix, sub_display)


def _sources(chart: helm.Chart, prefix: str, display: str) -> Iterator[TemplateSource]:
    for template in chart.templates:
        yield TemplateSource(prefix + template["name"],
                             os.path.join(display, template["name"]), template["data"])


@contextlib.contextmanager
def open_chart(path: str | os.PathLike[str]) -> Iterator[LoadedChart]:
    """Open a chart directory or `.tgz` archive; raises ChartUnusableError when it cannot be
    used. The Helm handles (and any temporary directory) are released on exit."""
    source = Path(path)
    display = os.fspath(path)
    if not source.exists():
        raise ChartUnusableError(f"{display}: no such chart directory or archive")
    with contextlib.ExitStack() as stack:
        directory = source
        if source.is_file():
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            engine = _engine()
            try:
                engine.expand(scratch, source)
            except engine.HelmError as exc:
                raise ChartUnusableError(
                    f"{display}: not a chart archive: {_one_line(str(exc))}") from None
            expanded = [p for p in scratch.iterdir() if p.is_dir()]
            if len(expanded) != 1:
                raise ChartUnusableError(f"{display}: not a chart archive")
            directory = expanded[0]
        chart = stack.enter_context(_load(directory))
        loaded = LoadedChart(chart, directory, display)
        loaded.templates = [*_sources(chart, "", display),
                            *_subchart_sources(directory, "", display)]
        yield loaded


# --------------------------------------------------------------------------- helpers


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _line_of(text: str, pattern: re.Pattern[str] | str) -> int | None:
    """1-based line of the first match of `pattern` in `text`."""
    match = re.search(pattern, text, re.MULTILINE) if isinstance(pattern, str) \
        else pattern.search(text)
    return text.count("\n", 0, match.start()) + 1 if match else None


# --------------------------------------------------------------------------- chart metadata


def check_api_version(loaded: LoadedChart) -> list[Finding]:
    """Margo accepts only `apiVersion: v2` charts (Helm 3/4 format)."""
    version = loaded.chart.metadata.get("apiVersion")
    if version == "v2":
        return []
    chart_yaml = loaded.directory / "Chart.yaml"
    text = chart_yaml.read_text(errors="replace") if chart_yaml.is_file() else ""
    return [Finding(loaded.file("Chart.yaml"), _line_of(text, r"^apiVersion\s*:"), "error",
                    "chart-api-version",
                    f"chart apiVersion is {version!r}; Margo accepts only apiVersion v2 "
                    "charts")]


def check_crd_files(loaded: LoadedChart) -> list[Finding]:
    """Files under `crds/` are CRDs Helm would install and never upgrade or remove."""
    out = []
    for crd in loaded.chart.crds:
        filename = str(crd.get("filename") or crd.get("name") or "crds/")
        rel = filename.split("/", 1)[1] if filename.split("/", 1)[0] == loaded.chart.name \
            else str(crd.get("name"))
        out.append(Finding(loaded.file(rel), None, "error", "crd",
                           "the chart ships a CustomResourceDefinition in crds/: Margo "
                           "forbids managing CRDs through Helm; install CRDs out of band "
                           "and declare them as a device requirement"))
    return out


# --------------------------------------------------------------------------- template text


def _actions(text: str) -> Iterator[tuple[int, str]]:
    """(offset, code) of every `{{ ... }}` action, with comments and string literals
    blanked so that `"lookup"` in a string or a comment is not taken for a call."""
    for match in _ACTION.finditer(text):
        code = _COMMENT.sub(lambda m: " " * len(m.group()), match.group(1))
        code = _STRING.sub(lambda m: " " * len(m.group()), code)
        yield match.start(1), code


def check_lookup(loaded: LoadedChart) -> list[Finding]:
    """`lookup` reads the live cluster: offline rendering on a device gets an empty result."""
    out = []
    for template in loaded.templates:
        for offset, code in _actions(template.text):
            match = _LOOKUP.search(code)
            if match:
                line = template.text.count("\n", 0, offset + match.start()) + 1
                out.append(Finding(template.display, line, "error", "lookup",
                                   "template uses 'lookup': Margo forbids it (a device may "
                                   "render the chart without access to the Kubernetes API)"))
    return out


def check_capabilities_api_versions(loaded: LoadedChart) -> list[Finding]:
    """`.Capabilities.APIVersions` is probationary: it needs the API list out of band."""
    out = []
    for template in loaded.templates:
        line = _line_of(template.text, _API_VERSIONS)
        if line:
            out.append(Finding(template.display, line, "info", "api-versions",
                               "template branches on .Capabilities.APIVersions: a device that "
                               "renders offline must be given the API list out of band"))
    return out


def _text_findings(loaded: LoadedChart, pattern: re.Pattern[str], level: str, rule: str,
                   message: str, skip: Callable[[str], bool] = lambda _line: False
                   ) -> list[Finding]:
    out = []
    for template in loaded.templates:
        for number, line in enumerate(template.text.splitlines(), start=1):
            if pattern.search(line) and not skip(line):
                out.append(Finding(template.display, number, level, rule, message))
                break
    return out


def text_checks(loaded: LoadedChart) -> list[Finding]:
    """What template text shows even when default values do not render it."""
    return [
        *_text_findings(loaded, _HOOK, "error", "hook",
                        "template declares a Helm hook (helm.sh/hook): Margo forbids hooks"),
        *_text_findings(loaded, _CRD_KIND, "error", "crd",
                        "template defines a CustomResourceDefinition: Margo forbids managing "
                        "CRDs through Helm"),
        *_text_findings(loaded, _NODE_NAME, "warning", "node-name",
                        "template can set nodeName: leave placement to the cluster's "
                        "scheduler (use topologySpreadConstraints)"),
        *_text_findings(loaded, re.compile(re.escape(HOSTNAME_LABEL)), "warning", "node-name",
                        f"template can select nodes by {HOSTNAME_LABEL}: never name a node; "
                        "spread replicas with topologySpreadConstraints instead",
                        skip=lambda line: "topologyKey" in line),
    ]


# --------------------------------------------------------------------------- rendered objects


@dataclass(frozen=True, slots=True)
class Manifest:
    """One rendered Kubernetes object and the template it came from."""

    rel: str
    doc: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind") or "")

    @property
    def name(self) -> str:
        return str(dig(self.doc, "metadata", "name") or "?")

    def pod_spec(self) -> Mapping[str, Any] | None:
        if self.kind == "Pod":
            spec = self.doc.get("spec")
        elif self.kind == "CronJob":
            spec = dig(self.doc, "spec", "jobTemplate", "spec", "template", "spec")
        elif self.kind in POD_TEMPLATE_KINDS:
            spec = dig(self.doc, "spec", "template", "spec")
        else:
            return None
        return spec if isinstance(spec, Mapping) else None

    def replicas(self) -> int:
        value = dig(self.doc, "spec", "replicas")
        try:
            return 1 if value is None else int(value)
        except (TypeError, ValueError):
            return 1


def rendered_manifests(rendered: Mapping[str, str]) -> list[Manifest]:
    """Parse rendered output; unparsable YAML is left to Helm's own lint to report."""
    out: list[Manifest] = []
    for key in sorted(rendered):
        text = rendered[key]
        if key.endswith("NOTES.txt") or not text.strip():
            continue
        rel = key.split("/", 1)[1] if "/" in key else key
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError:
            continue
        out.extend(Manifest(rel, doc) for doc in docs if isinstance(doc, Mapping))
    return out


def _hostname_terms(terms: Any) -> bool:
    for term in as_list(terms):
        expressions = as_list(dig(term, "matchExpressions"))
        fields = as_list(dig(term, "matchFields"))
        if any(dig(e, "key") == HOSTNAME_LABEL for e in expressions) or any(
                dig(f, "key") == "metadata.name" for f in fields):
            return True
    return False


def node_pinning(pod: Mapping[str, Any]) -> str | None:
    """How a pod spec names a node, or None when it does not."""
    if pod.get("nodeName"):
        return f"sets nodeName {pod['nodeName']!r}"
    selector = pod.get("nodeSelector")
    if isinstance(selector, Mapping) and HOSTNAME_LABEL in selector:
        return f"has a nodeSelector on {HOSTNAME_LABEL}"
    affinity = dig(pod, "affinity", "nodeAffinity")
    required = dig(affinity, "requiredDuringSchedulingIgnoredDuringExecution",
                    "nodeSelectorTerms")
    preferred = [dig(p, "preference")
                 for p in as_list(dig(affinity, "preferredDuringSchedulingIgnoredDuringExecution"))]
    if _hostname_terms(required) or _hostname_terms(preferred):
        return "has a node affinity on node names"
    return None


def _template_line(loaded: LoadedChart, rel: str, pattern: str) -> int | None:
    template = loaded.template(rel)
    return _line_of(template.text, pattern) if template else None


def manifest_checks(loaded: LoadedChart, manifests: Iterable[Manifest], why: str
                    ) -> list[Finding]:
    """Hooks, CRDs, node names and unspread replicas in rendered objects. `why` says which
    values produced them (defaults, the application's values, a replica probe)."""
    out = []
    for manifest in manifests:
        file, label = loaded.file(manifest.rel), f"{manifest.kind} {manifest.name!r}"

        def found(pattern: str, level: str, rule: str, message: str, part: str = "",
                  manifest: Manifest = manifest, file: str = file) -> None:
            out.append(Finding(file, _template_line(loaded, manifest.rel, pattern), level,
                               rule, message, f"{manifest.kind}/{manifest.name}/{part}"))

        annotations = dig(manifest.doc, "metadata", "annotations")
        if isinstance(annotations, Mapping) and "helm.sh/hook" in annotations:
            hook = annotations["helm.sh/hook"]
            tests = {h.strip() for h in str(hook).split(",")} & {"test", "test-success"}
            found(_HOOK.pattern, "error", "hook", f"{label} is a Helm hook ({hook}): Margo "
                  "forbids hooks" + (" (a device never runs helm test: check in a readiness "
                                     "probe, or before publishing)" if tests else ""))
        if manifest.kind == "CustomResourceDefinition":
            found(_CRD_KIND.pattern, "error", "crd", f"{label} is a CustomResourceDefinition: "
                  "Margo forbids managing CRDs through Helm")
        if fixed_name(manifest.doc, RELEASE) is not None:
            found(r"^\s*name\s*:", "warning", "fixed-name", f"{label} has a name that does "
                  f"not come from the release ({why}): a second deployment of the chart on a "
                  "device (another release) would collide with it; derive it from "
                  ".Release.Name")
        pod = manifest.pod_spec()
        if pod is None:
            continue
        for container in containers(pod):
            missing = missing_resources(container)
            if missing:
                name = str(container.get("name") or "?")
                found(r"^\s*resources\s*:|^\s*containers\s*:", "warning", "resources",
                      f"container {name!r} of {label} sets no {', '.join(missing[:-1])}"
                      f"{' or ' if len(missing) > 1 else ''}{missing[-1]} ({why}): a small "
                      "edge node is overcommitted unseen and one container can take the "
                      "memory of all; set resources.requests (cpu, memory) and "
                      "resources.limits.memory", name)
        pinning = node_pinning(pod)
        if pinning:
            found(r"nodeName|nodeSelector|nodeAffinity", "warning", "node-name",
                  f"{label} {pinning} ({why}): never name a node, let the cluster schedule "
                  "and spread with topologySpreadConstraints")
        if (manifest.kind in REPLICATED_KINDS and manifest.replicas() > 1
                and not pod.get("topologySpreadConstraints")):
            found(r"^\s*replicas\s*:", "warning", "replicas-spread",
                  f"{label} can run {manifest.replicas()} replicas ({why}) without "
                  "topologySpreadConstraints: Kubernetes may put them all on one node; spread "
                  f"them over {HOSTNAME_LABEL}")
    return out


def _render(loaded: LoadedChart, values: dict[str, Any]) -> list[Manifest]:
    """Render offline with the real engine; HelmError (schema, template) propagates."""
    rendered = loaded.chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return rendered_manifests(rendered)


# --------------------------------------------------------------------------- Helm's own lint


def _helm_lint_location(loaded: LoadedChart, path: str, text: str) -> tuple[str, int | None]:
    match = _HELM_LOCATION.match(text)
    if match and (loaded.directory / match.group(1)).exists():
        return loaded.file(match.group(1)), int(match.group(2))
    rel = "" if os.path.isabs(path) else path.rstrip("/")
    line = _YAML_LINE.search(text)
    return loaded.file(rel), int(line.group(1)) if line else None


def helm_lint(loaded: LoadedChart, values: dict[str, Any] | None = None) -> list[Finding]:
    """Helm's own `helm lint`, its severities mapped to ours (unknown counts as a warning)."""
    report = _engine().lint(loaded.directory, values)
    out = []
    for message in report.get("messages") or []:
        text = _one_line(str(message.get("error", "")))
        file, line = _helm_lint_location(loaded, str(message.get("path") or ""), text)
        level = HELM_LINT_LEVELS.get(int(message.get("severity") or 0), "warning")
        out.append(Finding(file, line, level, "helm-lint", text))
    return out


# --------------------------------------------------------------------------- the application


def _chart_components(chart: helm.Chart, app: ApplicationDescription
                      ) -> list[tuple[int, int, Component]]:
    """(profile index, component index, component) of the helm components built from
    `chart`: the component name is the chart name (the spec uses it as such), or the
    repository's last path segment is."""
    out = []
    for p_index, profile in enumerate(app.profiles):
        if profile.type is not ProfileType.HELM:
            continue
        for c_index, component in enumerate(profile.components):
            repository = (component.properties.repository or "").rstrip("/")
            if chart.name in (component.name, repository.rsplit("/", 1)[-1]):
                out.append((p_index, c_index, component))
    return out


def _raw_parameters(app: ApplicationDescription) -> dict[str, dict[str, Any]]:
    """The description's parameters in the document form `helm_values` reads."""
    out: dict[str, dict[str, Any]] = {}
    for name, parameter in app.parameters.items():
        body: dict[str, Any] = {"targets": [{"pointer": t.pointer, "components": list(t.components)}
                                            for t in parameter.targets]}
        if parameter.has_value:
            body["value"] = parameter.value
        out[name] = body
    return out


@dataclass(frozen=True, slots=True)
class _Pointer:
    parameter: str
    target: int
    pointer: str
    component: str


def _pointers(app: ApplicationDescription, names: set[str]) -> Iterator[_Pointer]:
    for name, parameter in app.parameters.items():
        for index, target in enumerate(parameter.targets):
            for component in target.components:
                if component in names:
                    yield _Pointer(name, index, target.pointer, component)
                    break


def check_pointers(loaded: LoadedChart, app: AppInput, names: set[str]) -> list[Finding]:
    """Every pointer aimed at this chart must name a key the chart defines."""
    values = loaded.chart.values
    schema = loaded.chart.schema
    out = []
    for ref in _pointers(app.description, names):
        line = app.locate(("parameters", ref.parameter, "targets", ref.target, "pointer"))
        subject = (f"parameter {ref.parameter!r} targets {ref.pointer!r} of component "
                   f"{ref.component!r}")
        try:
            path = parse_helm_pointer(ref.pointer)
        except ValueError as exc:
            out.append(Finding(app.file, line, "error", "parameter-pointer",
                               f"{subject}: {exc}"))
            continue
        if values_define(values, path) or (schema is not None and schema_allows(schema, path)):
            continue
        where = "values.yaml" + (" or values.schema.json" if schema is not None else "")
        out.append(Finding(app.file, line, "error", "parameter-pointer",
                           f"{subject}, which chart {loaded.chart.name!r} does not define in "
                           f"{where}{suggest_key(values, path)}: Helm would ignore it"))
    return out


def check_revisions(loaded: LoadedChart, app: AppInput,
                    components: list[tuple[int, int, Component]]) -> list[Finding]:
    """The app should deploy the chart version being linted (`_` stands for `+`)."""
    out = []
    version = loaded.chart.version
    for p_index, c_index, component in components:
        revision = (component.properties.revision or "").replace("_", "+")
        if revision and revision != version:
            line = app.locate(("deploymentProfiles", p_index, "components", c_index,
                               "properties", "revision"))
            out.append(Finding(app.file, line, "warning", "chart-version",
                               f"component {component.name!r} deploys revision "
                               f"{component.properties.revision}, but the chart is version "
                               f"{version}"))
    return out


def _replica_probes(app: ApplicationDescription, names: set[str]
                    ) -> Iterator[tuple[_Pointer, Any]]:
    """Pointers that set a replica count, with a value above 1 to try."""
    for ref in _pointers(app, names):
        try:
            path = parse_helm_pointer(ref.pointer)
        except ValueError:
            continue
        if path[-1] in REPLICA_KEYS:
            value = app.parameters[ref.parameter].value
            is_count = isinstance(value, int) and not isinstance(value, bool)
            yield ref, max(value, 2) if is_count else 2


def app_checks(loaded: LoadedChart, app: AppInput) -> list[Finding]:
    """Pointers, versions, and renders with the application's parameter values."""
    description = app.description
    components = _chart_components(loaded.chart, description)
    if not components:
        helm_names = [c.name for p in description.profiles if p.type is ProfileType.HELM
                      for c in p.components]
        return [Finding(app.file, app.locate(("deploymentProfiles",)), "error", "app-component",
                        f"application {description.id!r} has no helm component built from "
                        f"chart {loaded.chart.name!r} (helm components: "
                        f"{', '.join(helm_names) or 'none'})")]
    names = {c.name for _, _, c in components}
    out = [*check_revisions(loaded, app, components), *check_pointers(loaded, app, names)]
    parameters = _raw_parameters(description)
    for name in sorted(names):
        try:
            values = helm_values(parameters, name)
        except ValueError as exc:
            out.append(Finding(app.file, app.locate(("parameters",)), "error",
                               "parameter-pointer", f"component {name!r}: {exc}"))
            continue
        out.extend(_render_checks(loaded, app.file, values,
                                  f"the application's parameter values for component {name!r}"))
        for ref, count in _replica_probes(description, {name}):
            probe = copy.deepcopy(values)
            set_helm_value(probe, ref.pointer, count)
            with contextlib.suppress(_engine().HelmError):  # the schema forbids it
                out.extend(manifest_checks(loaded, _render(loaded, probe),
                                           f"parameter {ref.parameter!r} can set {ref.pointer} "
                                           "above 1"))
    return out


def _render_checks(loaded: LoadedChart, file: str, values: dict[str, Any], what: str
                   ) -> list[Finding]:
    """Render with `values` and inspect the objects; a render failure is itself an error."""
    engine = _engine()
    try:
        manifests = _render(loaded, values)
    except engine.HelmValuesError as exc:
        return [Finding(file, None, "error", "values-schema",
                        f"{what} do not satisfy the chart's values.schema.json: "
                        f"{_one_line(str(exc))}")]
    except engine.HelmError as exc:
        return [Finding(file, None, "error", "render",
                        f"the chart does not render with {what}: {_one_line(str(exc))}")]
    return manifest_checks(loaded, manifests, what)


# --------------------------------------------------------------------------- all together


def _dedupe(findings: Iterable[Finding]) -> list[Finding]:
    """Drop exact repeats (two renders can show the same object) and sort."""
    return sorted(set(findings), key=Finding.sort_key)


def _once(rendered: list[Finding]) -> list[Finding]:
    """One problem of one object once, as the first render that shows it says it (the
    defaults before the application's values, those before the replica probes): each
    render names its values in the message, so these are no exact repeats."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for finding in rendered:
        key = (finding.file, finding.rule, finding.subject)
        if finding.subject and key in seen:
            continue
        seen.add(key)
        out.append(finding)
    return out


def _prefer_rendered(text: list[Finding], rendered: list[Finding]) -> list[Finding]:
    covered = {(f.file, f.rule) for f in rendered}
    return [f for f in text if (f.file, f.rule) not in covered]


def lint_chart(loaded: LoadedChart, app: AppInput | None = None) -> list[Finding]:
    """Every finding for an opened chart (and the application that deploys it), sorted by
    file and line. Helm's lint runs with the chart's defaults."""
    linted = helm_lint(loaded)
    findings = [*check_api_version(loaded), *check_crd_files(loaded), *check_lookup(loaded),
                *check_capabilities_api_versions(loaded), *linted]
    rendered = _render_checks(loaded, loaded.file("values.yaml"), {}, "values.yaml defaults")
    if any(f.level == "error" for f in linted):
        # Helm's lint renders the defaults too and has already said why they fail.
        rendered = [f for f in rendered if f.rule not in ("render", "values-schema")]
    if app is not None:
        rendered = _once(rendered + app_checks(loaded, app))
    findings += rendered + _prefer_rendered(text_checks(loaded), rendered)
    return _dedupe(findings)
