"""Putting the Margo telemetry variables into the containers the device deploys (pure: text
and data in, text and data out, so the Compose driver, the Helm post-renderer, the render
driver and `margo device plan` all inject exactly alike).

The workload's own explicit values win, everywhere:

- **Compose**: a service that sets a variable in its `environment` (map or list form, even
  without a value: `- OTEL_EXPORTER_OTLP_PROTOCOL` passes the host's) or in one of its
  `env_file`s keeps it. The others go into the override file the Compose driver already
  writes, with `$` doubled (Compose would interpolate it). A configured certificate file
  is bind-mounted read-only at the injected path, only where the variable is injected.
- **Kubernetes manifests** (Helm's post-render step and the render driver): every
  container and init container of every pod template gets the variables its `env` does
  not set, appended after the chart's own entries. A name that an `envFrom` source
  rendered in the same release (a ConfigMap's or Secret's keys, with the source's prefix)
  provides is left alone too: `env` would override it. An `envFrom` source the release does
  not render cannot be read at render time; its keys lose to the injected variables.

Which objects: any object that embeds a pod spec, found by its shape (a mapping whose
`containers` is a list of mappings with a `name`, at least one with an `image`), wherever it
sits: `Pod`, `PodTemplate`, Deployments, ReplicaSets, StatefulSets, DaemonSets, `Job`
(`spec.template`), `CronJob` (`spec.jobTemplate.spec.template`), and third-party custom
resources that embed a pod template (Argo Rollouts, Knative Services, KEDA ScaledJobs...).
Pods an operator builds from a custom resource that embeds no pod template (only an image
name, say) are the operator's: nothing in the release describes them.

Documents without a pod spec, and pod specs that need nothing, are passed through as the
chart rendered them, byte for byte; only changed documents are written again (as YAML).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from reconciler.telemetry import CERTIFICATE, Injection

__all__ = ["ContainerInjection", "ServiceInjection", "compose_injection", "env_file_names",
           "inject_files", "inject_manifests", "pod_specs"]

_SEPARATOR = re.compile(r"^---[ \t]*(?:#.*)?$", re.MULTILINE)
_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*(?:=|$)")


# --------------------------------------------------------------------------- Compose


@dataclass(frozen=True)
class ServiceInjection:
    """What one Compose service gets: `added` (name → value) and the variables it `kept`
    (set by the workload itself)."""

    service: str
    added: dict[str, str]
    kept: tuple[str, ...]
    mount: str | None = None  # "host:container:ro", with the certificate

    def override(self) -> dict[str, Any]:
        """This service's part of the Compose override document."""
        entry: dict[str, Any] = {}
        if self.added:
            entry["environment"] = {k: v.replace("$", "$$") for k, v in self.added.items()}
        if self.mount:
            entry["volumes"] = [self.mount]
        return entry


def env_file_names(text: bytes) -> set[str]:
    """The variable names a Compose `env_file` sets (comments and blank lines skipped)."""
    names = set()
    for line in text.decode("utf-8", errors="replace").splitlines():
        if line.lstrip().startswith("#"):
            continue
        match = _ENV_LINE.match(line)
        if match:
            names.add(match.group(1))
    return names


def _service_env_names(service: Mapping[str, Any], files: Mapping[str, bytes]) -> set[str]:
    names: set[str] = set()
    environment = service.get("environment")
    if isinstance(environment, Mapping):
        names |= {str(k) for k in environment}
    elif isinstance(environment, list):
        names |= {str(item).split("=", 1)[0] for item in environment}
    env_files = service.get("env_file") or []
    for entry in [env_files] if isinstance(env_files, (str, Mapping)) else env_files:
        path = entry.get("path") if isinstance(entry, Mapping) else entry
        name = str(path or "").removeprefix("./")
        if name in files:
            names |= env_file_names(files[name])
    return names


def compose_injection(compose: Mapping[str, Any], files: Mapping[str, bytes],
                      injection: Injection | None) -> list[ServiceInjection]:
    """Per service of the package's `compose.yaml` (`files`: the package's files by path
    relative to its top directory, for `env_file`s): what it gets and what it keeps."""
    if injection is None:
        return []
    variables = injection.variables()
    out = []
    for name, service in sorted((compose.get("services") or {}).items()):
        own = _service_env_names(service if isinstance(service, Mapping) else {}, files)
        added = {k: v for k, v in variables.items() if k not in own}
        mount = None
        if CERTIFICATE in added and injection.certificate_file is not None:
            mount = f"{injection.certificate_file}:{injection.certificate}:ro"
        out.append(ServiceInjection(str(name), added,
                                    tuple(k for k in variables if k in own), mount))
    return out


# --------------------------------------------------------------------------- manifests


@dataclass(frozen=True)
class ContainerInjection:
    """What one container of one object got (for `margo device plan` and tests)."""

    object: str  # "Deployment/web"
    container: str  # "app", or "init:migrate" for an init container
    added: tuple[str, ...]
    kept: tuple[str, ...]


@dataclass
class _Sources:
    """Keys of the ConfigMaps and Secrets a release renders (for `envFrom`)."""

    config_maps: dict[str, set[str]] = field(default_factory=dict)
    secrets: dict[str, set[str]] = field(default_factory=dict)


def _is_pod_spec(node: Mapping[str, Any]) -> bool:
    containers = node.get("containers")
    return (isinstance(containers, list) and bool(containers)
            and all(isinstance(c, Mapping) and isinstance(c.get("name"), str)
                    for c in containers)
            and any("image" in c for c in containers))


def pod_specs(node: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec inside a document, by shape (see the module docstring)."""
    if isinstance(node, dict):
        if _is_pod_spec(node):
            yield node
            return
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from pod_specs(item)


def _from_sources(container: Mapping[str, Any], sources: _Sources) -> set[str]:
    names: set[str] = set()
    for entry in container.get("envFrom") or []:
        if not isinstance(entry, Mapping):
            continue
        prefix = str(entry.get("prefix") or "")
        for key, known in (("configMapRef", sources.config_maps), ("secretRef", sources.secrets)):
            ref = entry.get(key)
            if isinstance(ref, Mapping):
                names |= {prefix + k for k in known.get(str(ref.get("name")), set())}
    return names


def _inject_container(container: dict[str, Any], variables: Mapping[str, str],
                      sources: _Sources) -> tuple[tuple[str, ...], tuple[str, ...]]:
    env = container.get("env")
    if not isinstance(env, list):
        env = []
    own = {str(e.get("name")) for e in env if isinstance(e, Mapping)}
    own |= _from_sources(container, sources)
    added = tuple(k for k in variables if k not in own)
    if added:
        container["env"] = [*env, *({"name": k, "value": variables[k]} for k in added)]
    return added, tuple(k for k in variables if k in own)


def _object_name(document: Mapping[str, Any]) -> str:
    metadata = document.get("metadata") or {}
    return f"{document.get('kind', '?')}/{metadata.get('name', '?')}"


def _collect_sources(documents: list[Any]) -> _Sources:
    sources = _Sources()
    for document in documents:
        if not isinstance(document, Mapping):
            continue
        name = str((document.get("metadata") or {}).get("name", ""))
        if document.get("kind") == "ConfigMap":
            keys = {*(document.get("data") or {}), *(document.get("binaryData") or {})}
            sources.config_maps[name] = {str(k) for k in keys}
        elif document.get("kind") == "Secret":
            keys = {*(document.get("data") or {}), *(document.get("stringData") or {})}
            sources.secrets[name] = {str(k) for k in keys}
    return sources


def _split(stream: str) -> list[str]:
    """The documents of a YAML stream, each with its own leading comments (Helm's
    `# Source:` lines)."""
    return [part for part in _SEPARATOR.split(stream) if part.strip()]


def inject_files(files: Mapping[str, str], injection: Injection | None
                 ) -> tuple[dict[str, str], list[ContainerInjection]]:
    """`inject_manifests` over a rendered chart's files (template path → YAML stream), with
    `envFrom` sources looked up across all of them."""
    if injection is None:
        return dict(files), []
    parsed = {name: [yaml.safe_load(c) for c in _split(text)] for name, text in files.items()}
    sources = _collect_sources([d for documents in parsed.values() for d in documents])
    out: dict[str, str] = {}
    report: list[ContainerInjection] = []
    for name, text in files.items():
        out[name], found = inject_manifests(text, injection, sources=sources)
        report += found
    return out, report


def inject_manifests(stream: str, injection: Injection | None, *,
                     sources: _Sources | None = None) -> tuple[str, list[ContainerInjection]]:
    """Inject into every container of every pod spec of a multi-document YAML stream (what
    Helm hands a post-renderer). Returns the new stream and what each container got.
    `yaml.YAMLError` for a stream that is not YAML."""
    if injection is None:
        return stream, []
    chunks = _split(stream)
    parsed = [yaml.safe_load(chunk) for chunk in chunks]
    variables = injection.variables()
    sources = sources or _collect_sources(parsed)
    report: list[ContainerInjection] = []
    out: list[str] = []
    touched = False
    for chunk, document in zip(chunks, parsed, strict=True):
        changed = False
        for spec in pod_specs(document):
            for key, label in (("initContainers", "init:"), ("containers", "")):
                for container in spec.get(key) or []:
                    if not isinstance(container, dict):
                        continue
                    added, kept = _inject_container(container, variables, sources)
                    changed = changed or bool(added)
                    report.append(ContainerInjection(_object_name(document),
                                                     f"{label}{container.get('name')}",
                                                     added, kept))
        if changed:
            touched = True
            comments = "".join(line + "\n" for line in chunk.lstrip("\n").splitlines()
                               if line.startswith("#"))
            chunk = comments + yaml.safe_dump(document, sort_keys=False,
                                              default_flow_style=False)
        out.append(chunk if chunk.endswith("\n") else chunk + "\n")
    if not touched:
        return stream, report
    return "".join(f"---\n{chunk.lstrip(chr(10))}" for chunk in out), report

