"""Cluster conformance: does a Kubernetes cluster meet the Margo cluster requirements?

Margo asks a cluster leader for a WFM client, an OpenTelemetry collector, a healthy control
plane (API server, scheduler, controller manager) and a Helm engine, and asks every worker
for a Ready kubelet with an OCI container runtime, at a version the API server supports.
`margo device doctor` answers each of these as a `Check` with status pass, warn, fail or
unknown, so an operator sees what to fix before a deployment fails on the device.

The module reads in two steps and then judges without I/O: `discover()` (the same facts the
capability report is built from, so the doctor and the report never disagree) plus a few
reads of its own (`observe`: the health endpoints, the kube-system control-plane pods, the
WFM client's pods), then `run_checks()` is pure. A read the RBAC rules forbid makes its check
`unknown`, never `pass`: a conformance verdict that claims what it could not see is worse
than none. An unreachable API server ends the whole run (`KubeError`), as in discovery.

`doctor_labels()` turns a report into two capability labels, so the fleet can see (and a
`labelSelector` can require) a conformant cluster.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from margo.cluster import LABEL_PREFIX
from reconciler.datadir import LocalClient
from reconciler.kubernetes.client import KubeClient, KubeError
from reconciler.kubernetes.discovery import discover, helm_engine_version
from reconciler.kubernetes.facts import ClusterFacts, NodeFacts

__all__ = ["CHECK_IDS", "Check", "DoctorReport", "NodeResult", "Observation",
           "Probe", "Read", "check_cluster", "doctor", "doctor_labels", "kubelet_skew",
           "observe", "run_checks"]

Status = Literal["pass", "warn", "fail", "unknown"]
Scope = Literal["leader", "worker", "cluster"]

#: Every check, in report order.
CHECK_IDS = ("wfm-client", "otel-collector", "apiserver", "scheduler", "controller-manager",
             "helm-engine", "kubelet-ready", "container-runtime", "version-skew")
#: The label the device client's pods carry (charts and manifests in docs/kubernetes.md).
WFM_CLIENT_SELECTOR = "app.kubernetes.io/name=margo-device"
#: Container runtimes known to run OCI images, by the scheme of `containerRuntimeVersion`
#: (`docker://` on Kubernetes >= 1.24 means cri-dockerd, still Docker's OCI engine).
_OCI_RUNTIMES = ("containerd", "cri-o", "docker")
#: Platforms whose scheduler and controller manager run inside the server process, so no
#: pod exists to inspect. (rke2 runs them as static pods, which the pod check finds.)
_EMBEDDED = {"k3s": "k3s runs {component} inside its server process"}
_HIDDEN = {"k0s": "k0s runs {component} as a process on its controller nodes, outside "
                  "what the API shows",
           "eks": "EKS runs {component} in the managed control plane, which is not visible",
           "gke": "GKE runs {component} in the managed control plane, which is not visible",
           "aks": "AKS runs {component} in the managed control plane, which is not visible"}
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")
#: How much older than its duration a leader-election Lease may be before its holder counts
#: as stopped: the renew time is the holder's clock, which may run behind ours.
LEASE_CLOCK_SKEW_SECONDS = 30
_HEALTH_PATHS = ("/livez", "/readyz")


# --- results --------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeResult:
    """One node's part of a worker or cluster check."""

    name: str
    status: Status
    message: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "message": self.message}


@dataclass(frozen=True)
class Check:
    """One Margo cluster requirement, judged. `nodes` holds the per-node results of checks
    that look at every node."""

    id: str
    scope: Scope
    status: Status
    message: str
    nodes: tuple[NodeResult, ...] = ()

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "scope": self.scope, "status": self.status,
                                "message": self.message}
        if self.nodes:
            body["nodes"] = [n.to_json() for n in self.nodes]
        return body


@dataclass(frozen=True)
class DoctorReport:
    """All checks of one run. The verdict is `fail` when any check failed, `warn` when any
    warned or could not tell (unknown is never counted as a pass), else `pass`."""

    checks: tuple[Check, ...]
    server: str = ""
    kubernetes_version: str = ""
    platform: str | None = None

    @property
    def verdict(self) -> Literal["pass", "warn", "fail"]:
        statuses = {c.status for c in self.checks}
        if "fail" in statuses:
            return "fail"
        if statuses & {"warn", "unknown"}:
            return "warn"
        return "pass"

    @property
    def failures(self) -> list[str]:
        """Ids of the failed checks, in report order."""
        return [c.id for c in self.checks if c.status == "fail"]

    def check(self, check_id: str) -> Check:
        return next(c for c in self.checks if c.id == check_id)

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "checks": [c.to_json() for c in self.checks]}


def doctor_labels(report: DoctorReport) -> dict[str, Any]:
    """The verdict as capability labels: `k8s.margo-gitops.dev/conformance` (pass, warn or
    fail) and `k8s.margo-gitops.dev/conformance-failures` (the failed check ids)."""
    return {f"{LABEL_PREFIX}conformance": report.verdict,
            f"{LABEL_PREFIX}conformance-failures": report.failures}


# --- what is read ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Read:
    """The items of one LIST, or (items None) why they could not be read."""

    items: list[dict[str, Any]] | None
    reason: str = ""


@dataclass(frozen=True)
class Probe:
    """One health endpoint's answer: `status` is the HTTP status; `body` the text (for a
    failure, what the server said about its failed checks)."""

    path: str
    status: int
    body: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def denied(self) -> bool:
        return self.status in (401, 403)

    def failed_checks(self) -> list[str]:
        """The `[-]name failed` lines of a verbose answer, as names."""
        return [line[3:].split(" ", 1)[0] for line in self.body.splitlines()
                if line.startswith("[-]")]


@dataclass
class Observation:
    """Everything the checks judge: discovery's facts and the doctor's own reads."""

    facts: ClusterFacts
    health: dict[str, Probe] = field(default_factory=dict)
    system_pods: Read = field(default_factory=lambda: Read(None, "not read"))
    client_pods: Read = field(default_factory=lambda: Read(None, "not read"))
    client_deployments: Read = field(default_factory=lambda: Read(None, "not read"))
    #: kube-system Leases: the scheduler's and controller manager's leader election.
    leases: Read = field(default_factory=lambda: Read(None, "not read"))
    local_client: LocalClient | None = None
    server: str = ""
    observed_at: datetime = field(default_factory=lambda: datetime.now(UTC))


def _labelled(items: Iterable[dict[str, Any]], selector: str) -> list[dict[str, Any]]:
    """`key=value` selected again here: not every server (nor the test emulator) filters."""
    key, value = selector.split("=", 1)
    return [i for i in items
            if str(((i.get("metadata") or {}).get("labels") or {}).get(key)) == value]


def _list(client: KubeClient, path: str, selector: str | None = None) -> Read:
    """LIST `path` (optionally label-selected); an HTTP failure becomes the reason, an
    unreachable server propagates."""
    try:
        items = client.list(path, {"labelSelector": selector} if selector else None)
    except KubeError as exc:
        if exc.unreachable:
            raise
        return Read(None, exc.describe())
    return Read(_labelled(items, selector) if selector else items)


def _probe(client: KubeClient, path: str) -> Probe:
    """GET a health endpoint with `?verbose` (plain text: every check's line, and on failure
    which ones failed)."""
    status, text = client.get_text(path, {"verbose": ""})
    return Probe(path, status) if status == 200 else Probe(path, status, text[:2000])


def _read_health(client: KubeClient) -> dict[str, Probe]:
    """/livez and /readyz; /healthz stands in only when the server has neither (< 1.16)."""
    probes = {path: _probe(client, path) for path in _HEALTH_PATHS}
    if all(p.status == 404 for p in probes.values()):
        probes["/healthz"] = _probe(client, "/healthz")
    return probes


def observe(client: KubeClient, facts: ClusterFacts, *,
            local_client: LocalClient | None = None) -> Observation:
    """The doctor's own reads next to discovery's facts (`KubeError` when unreachable)."""
    found = Observation(facts=facts, local_client=local_client, server=client.access.server)
    found.health = _read_health(client)
    found.system_pods = _list(client, "/api/v1/namespaces/kube-system/pods")
    found.leases = _list(client, "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases")
    found.client_pods = _list(client, "/api/v1/pods", WFM_CLIENT_SELECTOR)
    if found.client_pods.items is None:
        found.client_deployments = _list(client, "/apis/apps/v1/deployments",
                                         WFM_CLIENT_SELECTOR)
    return found


# --- leader checks --------------------------------------------------------------------------

def _pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or [])


def _pod_name(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def _wfm_in_cluster(found: Observation) -> tuple[Status, str] | None:
    """The verdict from the cluster's side: pods, else (pods unreadable) deployments."""
    pods = found.client_pods.items
    if pods:
        ready = [_pod_name(p) for p in pods if _pod_ready(p)]
        if ready:
            return "pass", f"device client pod Ready: {', '.join(sorted(ready))}"
        names = ", ".join(sorted(_pod_name(p) for p in pods))
        return "fail", f"device client pod(s) found but none Ready: {names}"
    deployments = found.client_deployments.items
    if pods is None and deployments:
        ready = [_pod_name(d) for d in deployments
                 if int((d.get("status") or {}).get("readyReplicas") or 0) > 0]
        if ready:
            return "pass", f"device client deployment has ready replicas: {', '.join(ready)}"
        return "fail", "device client deployment(s) found but no replica is ready"
    return None


def check_wfm_client(found: Observation) -> Check:
    """A WFM client runs for this cluster: in it (a Ready pod labelled
    app.kubernetes.io/name=margo-device) or on this host (the data directory's lock)."""
    local = found.local_client
    if local is not None and local.running:
        return Check("wfm-client", "leader", "pass", local.detail)
    in_cluster = _wfm_in_cluster(found)
    if in_cluster is not None:
        return Check("wfm-client", "leader", *in_cluster)
    readable = found.client_pods.items is not None or found.client_deployments.items is not None
    if not readable:
        why = found.client_pods.reason
        extra = f"; {local.detail}" if local is not None else ""
        return Check("wfm-client", "leader", "unknown",
                     f"cannot list pods labelled {WFM_CLIENT_SELECTOR}: {why}{extra}")
    if local is not None and local.running is False:
        return Check("wfm-client", "leader", "fail",
                     f"no pod or deployment labelled {WFM_CLIENT_SELECTOR}, and "
                     f"{local.detail}")
    hint = (local.detail if local is not None else
            "a client running outside the cluster cannot be seen from here (run with "
            "--config on its host)")
    return Check("wfm-client", "leader", "unknown",
                 f"no pod or deployment labelled {WFM_CLIENT_SELECTOR}; {hint}")


def _unknown_reason(facts: ClusterFacts, what: str) -> str | None:
    return next((u["reason"] for u in facts.unknown if u["what"] == what), None)


def _schedulable(nodes: Iterable[NodeFacts]) -> list[NodeFacts]:
    return [n for n in nodes if n.ready and n.schedulable]


def check_otel_collector(found: Observation) -> Check:
    """A collector workload with a Service exposing OTLP (discovery's definition, so the
    check and the reported `otelCollector` agree; `facts.collector_verdict`)."""
    facts = found.facts
    if facts.otel_collector is None:
        why = _unknown_reason(facts, "capabilities.otelCollector") or "not checked"
        return Check("otel-collector", "leader", "unknown", f"cannot tell: {why}")
    detail = facts.otel_collector_detail or "no OpenTelemetry collector"
    if facts.otel_collector:
        return Check("otel-collector", "leader", "pass", detail)
    return Check("otel-collector", "leader", "fail",
                 f"{detail} (Margo requires one on hosting devices)")


def check_apiserver(found: Observation) -> Check:
    """/livez and /readyz (or /healthz on old servers) answer 200."""
    probes = list(found.health.values())
    if "/healthz" in found.health:
        probes = [found.health["/healthz"]]
    failed = [p for p in probes if not p.ok and not p.denied and p.status != 404]
    if failed:
        parts = []
        for probe in failed:
            names = probe.failed_checks()
            parts.append(f"{probe.path} answered {probe.status}"
                         + (f" (failed: {', '.join(names)})" if names else ""))
        return Check("apiserver", "leader", "fail", "; ".join(parts))
    if probes and all(p.ok for p in probes):
        return Check("apiserver", "leader", "pass",
                     " and ".join(p.path for p in probes) + " answer ok")
    unclear = [f"{p.path} {'forbidden' if p.denied else f'answered {p.status}'}"
               for p in probes if not p.ok]
    return Check("apiserver", "leader", "unknown",
                 "cannot tell: " + ("; ".join(unclear) or "no health endpoint was read"))


def _component_pods(pods: Iterable[dict[str, Any]], component: str) -> list[dict[str, Any]]:
    """kubeadm, kind and rke2 label static pods `component`; some installers `k8s-app`."""
    return [p for p in pods
            if component in (((p.get("metadata") or {}).get("labels") or {}).get("component"),
                             ((p.get("metadata") or {}).get("labels") or {}).get("k8s-app"))]


def _check_component(found: Observation, check_id: str, component: str) -> Check:
    pods = found.system_pods.items
    if pods is None:
        return Check(check_id, "leader", "unknown",
                     f"cannot list kube-system pods: {found.system_pods.reason}")
    mine = _component_pods(pods, component)
    if mine:
        ready = sorted(_pod_name(p) for p in mine if _pod_ready(p))
        waiting = sorted(_pod_name(p) for p in mine if not _pod_ready(p))
        if not waiting:
            return Check(check_id, "leader", "pass", f"{component} Ready: {', '.join(ready)}")
        status: Status = "warn" if ready else "fail"  # HA: one leader is enough to work
        return Check(check_id, "leader", status,
                     f"{component} not Ready: {', '.join(waiting)}"
                     + (f" (Ready: {', '.join(ready)})" if ready else ""))
    platform = found.facts.platform or ""
    leased = _check_lease(found, check_id, component)
    if leased is not None:
        return leased
    if platform in _EMBEDDED:
        text = _EMBEDDED[platform].format(component=component)
        if check_apiserver(found).status == "pass":
            return Check(check_id, "leader", "pass",
                         f"{text} (no pod to inspect); that process answers its health checks")
        return Check(check_id, "leader", "unknown",
                     f"{text} (no pod to inspect), and the API server's health is not known "
                     "to be good")
    if platform in _HIDDEN:
        return Check(check_id, "leader", "unknown", _HIDDEN[platform].format(
            component=component))
    return Check(check_id, "leader", "unknown",
                 f"no kube-system pod labelled component={component}; it may run outside "
                 "the cluster (a system service), which the API does not show")


def _renewed(lease: Mapping[str, Any]) -> datetime | None:
    text = str((lease.get("spec") or {}).get("renewTime") or "")
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


def _check_lease(found: Observation, check_id: str, component: str) -> Check | None:
    """When no pod shows the component: its leader-election Lease (`kube-system/<name>`,
    held while it runs with leader election, the default), or None when there is none to
    read. A component running as a system service is seen this way too."""
    leases = found.leases.items
    if not leases:
        return None
    lease = next((item for item in leases
                  if (item.get("metadata") or {}).get("name") == component), None)
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    holder = str(spec.get("holderIdentity") or "")
    renewed = _renewed(lease)
    duration = int(spec.get("leaseDurationSeconds") or 15)
    if not holder or renewed is None:
        return Check(check_id, "leader", "fail", f"{component}'s leader-election Lease "
                     f"kube-system/{component} has no holder: no {component} is running")
    age = (found.observed_at - renewed).total_seconds()
    if age > duration + LEASE_CLOCK_SKEW_SECONDS:
        return Check(check_id, "leader", "fail", f"{component}'s leader-election Lease "
                     f"(held by {holder}) was last renewed {age:.0f} s ago, more than its "
                     f"{duration} s duration: {component} has stopped")
    return Check(check_id, "leader", "pass", f"{component} holds its leader-election Lease "
                 f"kube-system/{component} ({holder}, renewed {max(age, 0):.0f} s ago)")


def check_scheduler(found: Observation) -> Check:
    """kube-scheduler static pods Ready, or the distribution's equivalent."""
    return _check_component(found, "scheduler", "kube-scheduler")


def check_controller_manager(found: Observation) -> Check:
    """kube-controller-manager static pods Ready, or the distribution's equivalent."""
    return _check_component(found, "controller-manager", "kube-controller-manager")


def check_helm_engine(found: Observation) -> Check:
    """The in-process Helm engine (helm_python) loads and reports its version."""
    facts = found.facts
    if facts.helm_version:
        return Check("helm-engine", "leader", "pass", f"Helm engine {facts.helm_version}")
    why = _unknown_reason(facts, "helmVersion")
    if why is not None:
        return Check("helm-engine", "leader", "fail", why)
    return Check("helm-engine", "leader", "unknown", "the Helm engine was not checked")


# --- worker and cluster checks --------------------------------------------------------------

def _nodes_unknown(check_id: str, scope: Scope, facts: ClusterFacts) -> Check:
    why = _unknown_reason(facts, "resources") or "the nodes were not read"
    return Check(check_id, scope, "unknown", f"cannot list nodes: {why}")


def _summarize(check_id: str, scope: Scope, results: list[NodeResult], good: str) -> Check:
    """One check from per-node results: the worst status wins, and its nodes are named."""
    if not results:
        return Check(check_id, scope, "fail", "the cluster has no nodes")
    for status in ("fail", "warn", "unknown"):
        bad = [r for r in results if r.status == status]
        if bad:
            names = ", ".join(f"{r.name} ({r.message})" for r in bad)
            return Check(check_id, scope, status, f"{len(bad)} of {len(results)} node(s): "
                                                  f"{names}", tuple(results))
    return Check(check_id, scope, "pass", f"{good} on all {len(results)} node(s)",
                 tuple(results))


def check_kubelet_ready(found: Observation) -> Check:
    """Every node's kubelet reports Ready."""
    nodes = found.facts.nodes
    if nodes is None:
        return _nodes_unknown("kubelet-ready", "worker", found.facts)
    results = [NodeResult(n.name, "pass", "Ready") if n.ready
               else NodeResult(n.name, "fail", "NotReady") for n in nodes]
    return _summarize("kubelet-ready", "worker", results, "kubelet Ready")


def _runtime(node: NodeFacts) -> NodeResult:
    reported = node.container_runtime or ""
    scheme = reported.split("://", 1)[0] if "://" in reported else ""
    if not reported:
        return NodeResult(node.name, "fail", "no container runtime reported")
    if scheme in _OCI_RUNTIMES:
        return NodeResult(node.name, "pass", reported)
    return NodeResult(node.name, "warn", f"{reported}: not a runtime known to run OCI images")


def check_container_runtime(found: Observation) -> Check:
    """Every node reports an OCI container runtime (containerd, CRI-O, Docker)."""
    nodes = found.facts.nodes
    if nodes is None:
        return _nodes_unknown("container-runtime", "worker", found.facts)
    return _summarize("container-runtime", "worker", [_runtime(n) for n in nodes],
                      "an OCI container runtime")


def _minor(version: str) -> tuple[int, int] | None:
    match = _VERSION.match(version.strip())
    return (int(match[1]), int(match[2])) if match else None


def kubelet_skew(server_version: str, kubelet_version: str) -> tuple[Status, str]:
    """Kubernetes' version skew policy for one kubelet: never newer than the API server,
    and at most 3 minor versions older when the API server is 1.28 or later (2 before)."""
    server, kubelet = _minor(server_version), _minor(kubelet_version)
    if server is None or kubelet is None:
        return "unknown", f"cannot read version {kubelet_version or '(none)'!r}"
    if kubelet[0] != server[0]:
        return "fail", f"kubelet {kubelet_version} is another major version than the API server"
    allowed = 3 if server >= (1, 28) else 2
    lag = server[1] - kubelet[1]
    if lag < 0:
        return "fail", f"kubelet {kubelet_version} is newer than the API server"
    if lag > allowed:
        return "fail", (f"kubelet {kubelet_version} is {lag} minor versions older (at most "
                        f"{allowed} allowed)")
    return "pass", f"kubelet {kubelet_version}"


def check_version_skew(found: Observation) -> Check:
    """Every kubelet within the supported skew of the API server's version (only the server
    answering this read is seen: HA servers at different versions are not)."""
    facts = found.facts
    if facts.nodes is None:
        return _nodes_unknown("version-skew", "cluster", facts)
    if _minor(facts.git_version) is None:
        return Check("version-skew", "cluster", "unknown",
                     f"cannot read the API server version {facts.git_version!r}")
    results = [NodeResult(n.name, *kubelet_skew(facts.git_version, n.kubelet_version or ""))
               for n in facts.nodes]
    return _summarize("version-skew", "cluster", results,
                      f"within skew of API server {facts.git_version}")


# --- running --------------------------------------------------------------------------------

_CHECKS: tuple[Callable[[Observation], Check], ...] = (
    check_wfm_client, check_otel_collector, check_apiserver, check_scheduler,
    check_controller_manager, check_helm_engine, check_kubelet_ready, check_container_runtime,
    check_version_skew)


def run_checks(found: Observation) -> DoctorReport:
    """Judge an observation (pure: no reads)."""
    return DoctorReport(checks=tuple(check(found) for check in _CHECKS), server=found.server,
                        kubernetes_version=found.facts.git_version,
                        platform=found.facts.platform)


def check_cluster(client: KubeClient, facts: ClusterFacts, *,
                  local_client: LocalClient | None = None) -> DoctorReport:
    """Read what discovery did not and judge (for a caller that already discovered)."""
    return run_checks(observe(client, facts, local_client=local_client))


def doctor(client: KubeClient, *,
           helm_version: Callable[[], str] | None = helm_engine_version,
           local_client: LocalClient | None = None) -> DoctorReport:
    """Discover, read and judge the cluster `client` reaches. `KubeError` when the API
    server cannot be reached (or /version cannot be read)."""
    facts = discover(client, helm_version=helm_version)
    return check_cluster(client, facts, local_client=local_client)
