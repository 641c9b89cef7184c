"""What is installed, how our releases are named and how they are marked as ours.

Drivers read installed releases from the engine's own records (Helm release records,
Compose project labels, the render driver's ledger) and describe each as an
`InstalledRelease` in a closed `ReleaseState`. Only releases carrying all our ownership
labels are ours; the others are reported `UNMANAGED`, so the planner never installs one of
our components over them and never removes them.

Drift: what a driver applied is not always what is there now (a file edited, a container
stopped, an object deleted by hand). A driver that sees it names it in `InstalledRelease.drift`
(`with_drift`), and the device's drift policy (`DRIFT_POLICIES`, per driver default in
`DEFAULT_DRIFT`) says whether the planner repairs it (`repair`) or it is only reported.

Label values follow the Kubernetes label rules (at most 63 characters of
`[A-Za-z0-9._-]`), because Helm stores release labels on its Secret records: digests are
therefore stored as their first 40 hex digits (160 bits), plenty to notice a change.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DEFAULT_DRIFT", "DRIFT_POLICIES", "LABEL_COMPONENT", "LABEL_DEPLOYMENT",
           "LABEL_DESIRED", "LABEL_MANAGED_BY", "LABEL_SPEC", "LABEL_VALUES", "MANAGER",
           "MAX_RELEASE_NAME", "InstalledRelease", "ReleaseState", "ownership_labels",
           "release_from_labels", "release_name", "short_digest", "unmanaged_release",
           "with_drift"]

LABEL_MANAGED_BY = "margo-gitops.dev/managed-by"
LABEL_DEPLOYMENT = "margo-gitops.dev/deployment"
LABEL_COMPONENT = "margo-gitops.dev/component"
LABEL_DESIRED = "margo-gitops.dev/desired-digest"
LABEL_SPEC = "margo-gitops.dev/spec-digest"
LABEL_VALUES = "margo-gitops.dev/values-digest"
MANAGER = "margo-gitops"
MAX_RELEASE_NAME = 53  # Helm's limit (release names become label values with suffixes)

#: What a driver does about drift: `off`, not checked; `warn`, reported (the component is
#: `failed` with code `DRIFTED`, nothing is touched); `repair`, the planner applies the
#: component again (`Action.REPAIR`) and the report says what was repaired.
DRIFT_POLICIES = ("off", "warn", "repair")
#: Each driver's policy when the configuration names none (docs/device.md, "Drift"): the
#: render and Compose drivers own what they wrote and rewriting it is idempotent, so they
#: heal as a GitOps agent would; a cluster is shared with people and controllers, and Helm
#: keeps a revision per repair, so the Helm driver only reports.
DEFAULT_DRIFT = {"helm": "warn", "render": "repair", "compose": "repair"}

_UNSAFE = re.compile(r"[^a-z0-9-]+")


def short_digest(digest: str) -> str:
    """`sha256:<hex>` → its first 40 hex digits, a valid Kubernetes label value."""
    return digest.partition(":")[2][:40] if ":" in digest else digest[:40]


def release_name(deployment_id: str, component: str) -> str:
    """A deterministic Helm release / Compose project name for one component.

    `<component, lower-cased and cleaned, at most 42 chars>-<10 hex of sha256(id/component)>`:
    readable, at most 53 characters, a valid DNS label, and distinct for every (deployment,
    component) pair even when component names collide after cleaning."""
    tag = hashlib.sha256(f"{deployment_id}/{component}".encode()).hexdigest()[:10]
    readable = _UNSAFE.sub("-", component.lower()).strip("-")[:42].strip("-") or "component"
    if not readable[0].isalpha():
        readable = "c" + readable[:41]
    return f"{readable}-{tag}"


def ownership_labels(deployment_id: str, component: str, *, desired_digest: str,
                     spec_digest: str, values_digest: str) -> dict[str, str]:
    """Labels that mark a release as ours and record what it was installed from."""
    return {
        LABEL_MANAGED_BY: MANAGER,
        LABEL_DEPLOYMENT: deployment_id,
        LABEL_COMPONENT: component,
        LABEL_DESIRED: short_digest(desired_digest),
        LABEL_SPEC: short_digest(spec_digest),
        LABEL_VALUES: short_digest(values_digest),
    }


class ReleaseState(StrEnum):
    """What a driver found, in the few words the planner decides on (the engine's own
    status word stays in `InstalledRelease.detail`, for people)."""

    #: Running as recorded (it may still have drifted: `InstalledRelease.drift`).
    DEPLOYED = "deployed"
    #: The last operation failed, or the workload is not healthy (a container crashing or
    #: failing its health check, an interrupted Compose `up`).
    FAILED = "failed"
    #: A first install that did not finish (the client crashed): nothing to go back to.
    PENDING_INSTALL = "pending-install"
    #: A later operation (upgrade, rollback) that did not finish: a revision to go back to.
    PENDING_UPGRADE = "pending-upgrade"
    #: Not ours (no margo-gitops labels, or not all of them): never touched. Reported so that
    #: one of our components is never installed over it.
    UNMANAGED = "unmanaged"


@dataclass(frozen=True)
class InstalledRelease:
    """One installed component, as the engine's own records describe it. An `UNMANAGED`
    release has no deployment or component (and empty digests)."""

    release_name: str
    namespace: str
    deployment_id: str
    component: str
    desired_digest: str  # short digests (40 hex), as stored in the labels
    spec_digest: str
    values_digest: str
    state: ReleaseState
    detail: str = ""  # the engine's status word, for messages ("deployed", "failed", ...)
    chart_version: str = ""
    #: What no longer matches what the driver applied (objects deleted, files edited,
    #: containers stopped out of band), one short sentence for people; empty when nothing
    #: drifted or drift is not checked.
    drift: str = ""
    #: The drift is to be repaired (the device's drift policy is `repair`): the planner
    #: applies the component again instead of reporting it `DRIFTED`.
    repair: bool = False

    @property
    def healthy(self) -> bool:
        return self.state is ReleaseState.DEPLOYED

    @property
    def managed(self) -> bool:
        return self.state is not ReleaseState.UNMANAGED


def with_drift(release: InstalledRelease, drift: str, policy: str) -> InstalledRelease:
    """`release` as found drifted (`drift`, one sentence), marked for repair when `policy`
    is `repair`. Drivers call this instead of changing the release's state: drift is not a
    failed operation, and the planner alone decides what follows from it."""
    if policy not in DRIFT_POLICIES:
        raise ValueError(f"drift policy must be one of {', '.join(DRIFT_POLICIES)}, "
                         f"not {policy!r}")
    if not drift or policy == "off":
        return release
    return dataclasses.replace(release, drift=drift, repair=policy == "repair")


def unmanaged_release(release_name: str, namespace: str, detail: str = "") -> InstalledRelease:
    """A release (or project) the engine has under a name, that is not ours."""
    return InstalledRelease(release_name, namespace, "", "", "", "", "", ReleaseState.UNMANAGED,
                            detail)


def release_from_labels(labels: Mapping[str, str], *, release_name: str, namespace: str,
                        state: ReleaseState, detail: str = "",
                        chart_version: str = "") -> InstalledRelease:
    """An `InstalledRelease` from a release's labels; `UNMANAGED` when they do not prove it
    ours (no managed-by label, or a half-labelled release)."""
    if labels.get(LABEL_MANAGED_BY) != MANAGER:
        return unmanaged_release(release_name, namespace, detail)
    try:
        return InstalledRelease(
            release_name=release_name, namespace=namespace,
            deployment_id=labels[LABEL_DEPLOYMENT], component=labels[LABEL_COMPONENT],
            desired_digest=labels.get(LABEL_DESIRED, ""), spec_digest=labels.get(LABEL_SPEC, ""),
            values_digest=labels.get(LABEL_VALUES, ""), state=state, detail=detail,
            chart_version=chart_version)
    except KeyError:
        return unmanaged_release(release_name, namespace, detail)
