"""The `kubernetes` capability provider: a cluster's capabilities, re-reported only when
something placement depends on has really changed.

Pod requests churn all the time (a Job starts, a rollout surges), and every report makes the
server recompute this device's placement. So `gather()` compares a fresh discovery with the
document it last returned and counts as a change only: nodes added or removed, a node's
Ready/schedulable state, roles, taints, GPUs (and who holds them) or labels, which of our
deployments have pods on it, the API surface and classes, what is unknown, the derived
labels, or a node's allocatable or available resource moving by more than `threshold` of its
allocatable amount (default 10%). A change must also hold: it is returned only when two
consecutive gathers at least `debounce_seconds` apart both see it; until then the previous
document is returned. The reporter then sends only when the document's digest differs from
what the server acknowledged.

When the API server cannot be reached the last good document is returned (the cluster did not
change because we cannot see it) and `last_error` says why.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from margo.cluster import EXTENSION_KEY
from margo.quantity import parse_quantity
from reconciler.datadir import LocalClient
from reconciler.kubernetes.client import KubeClient
from reconciler.kubernetes.cluster_documents import capabilities_document
from reconciler.kubernetes.discovery import discover, helm_engine_version
from reconciler.kubernetes.doctor import check_cluster, doctor_labels

__all__ = ["KubernetesProvider", "significant_change"]

log = logging.getLogger("margo.device.kubernetes")

_VOLATILE_PROPERTIES = ("cpus", "memory", "storage")
_NODE_AMOUNTS = ("allocatable", "requested", "available")


def _amount(value: Any) -> Decimal:
    """A node resource value (cores as a number, bytes as a quantity, counts) as a Decimal."""
    if isinstance(value, bool):
        raise ValueError("not an amount")
    if isinstance(value, int | float):
        return Decimal(str(value))
    return parse_quantity(str(value))


def _nodes(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    body = (doc.get(EXTENSION_KEY) or {}).get("cluster") or {}
    nodes = (body.get("resources") or {}).get("nodes")
    return nodes if isinstance(nodes, list) else []


def _structure(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The document without the numbers that churn (they are compared with a threshold) and
    without the wording of `unknown` reasons (which entries exist is what matters)."""
    shape = copy.deepcopy(dict(doc))
    properties = shape.get("properties") or {}
    for key in _VOLATILE_PROPERTIES:
        properties.pop(key, None)
    body = (shape.get(EXTENSION_KEY) or {}).get("cluster") or {}
    resources = body.get("resources")
    if isinstance(resources, dict):
        resources.pop("allocatable", None)
        resources.pop("nodeSummary", None)
        for node in resources.get("nodes") or []:
            for key in _NODE_AMOUNTS:
                node.pop(key, None)
            for workload in node.get("workloads") or []:  # whose pods run here counts,
                workload.pop("pods", None)  # not how many or how much (that churns)
                workload.pop("requested", None)
    if "unknown" in body:
        body["unknown"] = sorted(str(u.get("what")) for u in body["unknown"])
    return shape


def _moved(old: Mapping[str, Any], new: Mapping[str, Any], base: Mapping[str, Any],
           threshold: float) -> bool:
    """True when any amount moved by more than `threshold` of the node's allocatable one."""
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            return True
        before, after = _amount(old[key]), _amount(new[key])
        reference = _amount(base.get(key, new[key]))
        if reference == 0:
            if before != after:
                return True
        elif abs(after - before) > Decimal(str(threshold)) * reference:
            return True
    return False


def significant_change(old: Mapping[str, Any], new: Mapping[str, Any], *,
                       threshold: float = 0.10) -> bool:
    """Whether `new` differs from `old` in a way placement cares about (see the module
    docstring); two documents of one cluster are expected."""
    if _structure(old) != _structure(new):
        return True
    before = {n.get("name"): n for n in _nodes(old)}
    for node in _nodes(new):
        previous = before.get(node.get("name"), {})
        base = node.get("allocatable") or {}
        for key in ("allocatable", "available"):
            if _moved(previous.get(key) or {}, node.get(key) or {}, base, threshold):
                return True
    return False


class KubernetesProvider:
    """Capabilities of the cluster a kubeconfig (or, with `kubeconfig=None`, the pod's own
    service account) reaches, as an rc.3 document (see `discovery.capabilities_document`).

    Each `gather()` opens a fresh read-only client (so a rewritten kubeconfig or a rotated
    certificate is picked up) and closes it again."""

    def __init__(self, device_id: str, *, kubeconfig: Path | None = None,
                 context: str | None = None, vendor: str = "unknown",
                 model_number: str = "unknown", serial_number: str = "unknown",
                 labels: Mapping[str, Any] | None = None, threshold: float = 0.10,
                 debounce_seconds: float = 30.0, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 helm_version: Callable[[], str] | None = helm_engine_version,
                 doctor: bool = False) -> None:
        if not 0 <= threshold < 1:
            raise ValueError(f"threshold must be a fraction in [0, 1), found {threshold!r}")
        if debounce_seconds < 0:
            raise ValueError(f"debounce_seconds must not be negative, found "
                             f"{debounce_seconds!r}")
        self.device_id = device_id
        self.kubeconfig = None if kubeconfig is None else Path(kubeconfig)
        self.context = context
        self.identity = {"vendor": vendor, "model_number": model_number,
                         "serial_number": serial_number}
        self.labels = dict(labels or {})
        self.threshold, self.debounce_seconds = threshold, debounce_seconds
        self.timeout, self.clock, self.helm_version = timeout, clock, helm_version
        #: Also run the conformance checks and report the verdict as labels (docs/kubernetes.md).
        self.doctor = doctor
        #: Why the last gather could not read the cluster (None after a good one).
        self.last_error: Exception | None = None
        self._returned: dict[str, Any] | None = None
        self._change_seen_at: float | None = None
        self._unknown_logged: frozenset[tuple[str, str]] = frozenset()

    @property
    def document(self) -> dict[str, Any] | None:
        """The document last returned (None before the first good gather)."""
        return copy.deepcopy(self._returned)

    @property
    def change_pending(self) -> bool:
        """A relevant change has been seen but not yet returned (debouncing)."""
        return self._change_seen_at is not None

    def _client(self) -> KubeClient:
        if self.kubeconfig is None:
            return KubeClient.in_cluster(timeout=self.timeout)
        return KubeClient.from_kubeconfig(self.kubeconfig, self.context, timeout=self.timeout)

    def observe(self) -> dict[str, Any]:
        """A fresh document, without any debouncing (`KubeError` when unreachable)."""
        labels = self.labels
        with self._client() as client:
            facts = discover(client, helm_version=self.helm_version)
            self._log_unknown(facts.unknown)
            if self.doctor:  # discovered labels win over the operator's, as documented
                report = check_cluster(client, facts, local_client=LocalClient.this_process())
                labels = {**labels, **doctor_labels(report)}
        return capabilities_document(facts, device_id=self.device_id, labels=labels,
                                     **self.identity)

    def _log_unknown(self, unknown: list[dict[str, str]]) -> None:
        """Say in the log what could not be read (a forbidden read, an API not served),
        once per change, so an operator sees why the report leaves facts out."""
        seen = frozenset((u["what"], u["reason"]) for u in unknown)
        if seen != self._unknown_logged:
            for what, reason in sorted(seen - self._unknown_logged):
                log.warning("cluster discovery: %s not reported: %s", what, reason)
            self._unknown_logged = seen

    def gather(self) -> dict[str, Any]:
        """The document to report now: the first one at once, later ones only for changes
        that held through the debounce interval; the last good one while the API server is
        unreachable. Raises (an OSError) only when no document was ever read."""
        try:
            fresh = self.observe()
        except OSError as exc:  # KubeError, or an unreadable kubeconfig or token
            self.last_error = exc
            self._change_seen_at = None  # the change was not seen twice in a row
            if self._returned is None:
                raise
            return copy.deepcopy(self._returned)
        self.last_error = None
        if self._returned is None:
            return self._accept(fresh)
        if not significant_change(self._returned, fresh, threshold=self.threshold):
            self._change_seen_at = None
            return copy.deepcopy(self._returned)
        now = self.clock()
        if self._change_seen_at is None:
            self._change_seen_at = now
        elif now - self._change_seen_at >= self.debounce_seconds:
            return self._accept(fresh)
        return copy.deepcopy(self._returned)

    def _accept(self, doc: dict[str, Any]) -> dict[str, Any]:
        self._returned, self._change_seen_at = doc, None
        return copy.deepcopy(doc)
