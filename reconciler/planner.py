"""The pure planner: desired deployments x installed releases → ordered steps.

No I/O and no clock: the same inputs always give the same plan, which is what makes the
reconciler testable and a crash at any point safe (re-planning after a restart sees what
was really installed and continues from there).

The planner alone decides what to do with what a driver found (`ReleaseState`); drivers
execute one action each and never decide again:

| found | action |
|---|---|
| nothing | `install` |
| `deployed`, other package | `upgrade` |
| `deployed`, other values | `reconfigure` |
| `deployed`, same | `unchanged` |
| `deployed`, same, drifted, policy `repair` | `repair`: apply the same component again |
| `deployed`, same, drifted, policy `warn` | `unchanged` (the runner reports `DRIFTED`) |
| `failed` | `upgrade` (apply again) |
| `pending-install` (a first install that crashed) | `reinstall`: clear it, install |
| `pending-upgrade` (a later operation that crashed) | `recover`: roll back, upgrade |
| `unmanaged`, with the name one of our components needs | `skip`: never touched |

Drift (`InstalledRelease.drift`: what the driver saw no longer matches what it applied) comes
with the device's policy on the release (`InstalledRelease.repair`), so the plan stays a
function of its inputs. A changed package or changed values win over drift: the upgrade or
reconfigure applies everything anew, which repairs it too.

Order of execution:
1. deployments no longer desired are removed first (freeing resources for what follows),
   each one's components in reverse listed order;
2. then each desired deployment in a stable order (deployment id): components it no longer
   lists are removed (reverse order), then its components are installed, upgraded or
   reconfigured in listed order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from reconciler.desired import DesiredComponent, DesiredDeployment
from reconciler.releases import InstalledRelease, ReleaseState, release_name, short_digest

__all__ = ["Action", "DeploymentPlan", "Plan", "Step", "plan"]


class Action(StrEnum):
    INSTALL = "install"
    UPGRADE = "upgrade"
    RECONFIGURE = "reconfigure"
    #: A first install that crashed: clear what it left, install again.
    REINSTALL = "reinstall"
    #: A later operation that crashed: go back to the last revision, then upgrade.
    RECOVER = "recover"
    REMOVE = "remove"
    UNCHANGED = "unchanged"
    #: The name is taken by something that is not ours: nothing is done (a failure).
    SKIP = "skip"
    #: Found deployed as desired but drifted, and the policy is `repair`: apply the same
    #: desired component again (render: rewrite its files; Compose: `up`; Helm: upgrade
    #: onto the same chart and values).
    REPAIR = "repair"


@dataclass(frozen=True)
class Step:
    """One component's action. `desired` is None for removals, `installed` for installs."""

    action: Action
    deployment_id: str
    component: str
    release_name: str
    namespace: str
    desired: DesiredComponent | None
    installed: InstalledRelease | None
    reason: str


@dataclass(frozen=True)
class DeploymentPlan:
    """Steps for one deployment, in execution order. `deployment` is None when it is being
    removed entirely."""

    deployment_id: str
    deployment: DesiredDeployment | None
    steps: tuple[Step, ...]

    @property
    def changes(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.action is not Action.UNCHANGED)


@dataclass(frozen=True)
class Plan:
    deployments: tuple[DeploymentPlan, ...]

    @property
    def changes(self) -> tuple[Step, ...]:
        return tuple(s for d in self.deployments for s in d.changes)

    def summary(self) -> dict[str, int]:
        counts = {a.value: 0 for a in Action}
        for deployment in self.deployments:
            for step in deployment.steps:
                counts[step.action.value] += 1
        return counts


def _compare(component: DesiredComponent, installed: InstalledRelease) -> tuple[Action, str]:
    state = installed.state
    if state is ReleaseState.PENDING_INSTALL:
        return Action.REINSTALL, f"the installed release is {installed.detail or state}"
    if state is ReleaseState.PENDING_UPGRADE:
        return Action.RECOVER, f"the installed release is {installed.detail or state}"
    if state is not ReleaseState.DEPLOYED:
        return Action.UPGRADE, f"the installed release is {installed.detail or 'not healthy'}"
    if installed.spec_digest != short_digest(component.spec_digest):
        return Action.UPGRADE, f"package changed (now {component.repository}:{component.revision})"
    if installed.values_digest != short_digest(component.values_digest):
        return Action.RECONFIGURE, "parameter values changed"
    if installed.drift and installed.repair:
        return Action.REPAIR, f"drifted: {installed.drift}"
    return Action.UNCHANGED, "up to date"


def _removal(release: InstalledRelease, reason: str) -> Step:
    return Step(Action.REMOVE, release.deployment_id, release.component, release.release_name,
                release.namespace, None, release, reason)


@dataclass
class _Found:
    """The installed releases sorted for planning: ours by deployment and component, the
    second claimants of a component (to be removed), and the names taken by releases that
    are not ours (release name -> namespaces)."""

    by_deployment: dict[str, dict[str, InstalledRelease]] = field(
        default_factory=lambda: defaultdict(dict))
    duplicates: list[InstalledRelease] = field(default_factory=list)
    foreign: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))


def _sort_installed(installed: Iterable[InstalledRelease]) -> _Found:
    found = _Found()
    for release in installed:
        if not release.managed:
            found.foreign[release.release_name].add(release.namespace)
            continue
        slot = found.by_deployment[release.deployment_id]
        if release.component not in slot:
            slot[release.component] = release
            continue
        # Two releases claim the same component (a renamed release, a manual copy with our
        # labels): keep the one with our deterministic name, remove the other.
        if release.release_name == release_name(release.deployment_id, release.component):
            found.duplicates.append(slot[release.component])
            slot[release.component] = release
        else:
            found.duplicates.append(release)
    return found


def _removal_plan(deployment_id: str, releases: dict[str, InstalledRelease],
                  known: list[str]) -> DeploymentPlan:
    """A deployment no longer desired: its components removed in reverse of the order they
    were installed in (`known`), unknown ones after them in reverse name order."""
    ranked = sorted(releases, key=lambda name: (known.index(name) if name in known
                                                else len(known), name), reverse=True)
    return DeploymentPlan(deployment_id, None, tuple(
        _removal(releases[name], "the deployment is no longer desired") for name in ranked))


def _component_steps(deployment: DesiredDeployment, component: DesiredComponent,
                     current: InstalledRelease | None, taken: set[str]) -> list[Step]:
    """The steps of one listed component: install it, skip it when its name is taken by a
    release that is not ours (`taken`: the namespaces where it is), move a Helm release to
    its new namespace, or compare what is installed with what is desired."""
    deployment_id = deployment.deployment_id
    name = release_name(deployment_id, component.name)
    helm = deployment.profile_type == "helm"
    if current is None:
        if deployment.namespace in taken or (not helm and taken):
            where = f" in namespace {deployment.namespace}" if helm else ""
            return [Step(Action.SKIP, deployment_id, component.name, name, deployment.namespace,
                         component, None, f"release {name}{where} exists but is not managed "
                         "by margo-gitops; it is left alone")]
        return [Step(Action.INSTALL, deployment_id, component.name, name, deployment.namespace,
                     component, None, "not installed")]
    if current.namespace != deployment.namespace and helm:
        # A Helm release cannot move between namespaces: remove, then install anew.
        return [_removal(current, f"namespace changed to {deployment.namespace}"),
                Step(Action.INSTALL, deployment_id, component.name, name, deployment.namespace,
                     component, None, f"moved from namespace {current.namespace}")]
    action, reason = _compare(component, current)
    return [Step(action, deployment_id, component.name, current.release_name,
                 current.namespace, component, current, reason)]


def _desired_plan(deployment: DesiredDeployment, releases: dict[str, InstalledRelease],
                  foreign: dict[str, set[str]]) -> DeploymentPlan:
    """A desired deployment: components it no longer lists removed (reverse name order),
    then each listed component's steps in listed order."""
    listed = {c.name for c in deployment.components}
    steps = [_removal(releases[name], "the component is no longer listed")
             for name in sorted(set(releases) - listed, reverse=True)]
    for component in deployment.components:
        taken = foreign.get(release_name(deployment.deployment_id, component.name), set())
        steps += _component_steps(deployment, component, releases.get(component.name), taken)
    return DeploymentPlan(deployment.deployment_id, deployment, tuple(steps))


def plan(desired: Iterable[DesiredDeployment], installed: Iterable[InstalledRelease],
         *, component_order: dict[str, list[str]] | None = None) -> Plan:
    """Plan the convergence of `installed` onto `desired`.

    `component_order` gives, for deployments no longer desired, the component order they
    were installed with (from the device's own records) so removal can run in reverse; when
    unknown, releases are removed in reverse name order (deterministic)."""
    wanted = {d.deployment_id: d for d in desired}
    found = _sort_installed(installed)
    order = component_order or {}
    plans = [_removal_plan(deployment_id, found.by_deployment[deployment_id],
                           order.get(deployment_id, []))
             for deployment_id in sorted(set(found.by_deployment) - set(wanted))]
    plans += [_desired_plan(wanted[deployment_id], found.by_deployment.get(deployment_id, {}),
                            found.foreign)
              for deployment_id in sorted(wanted)]
    if found.duplicates:
        extra = tuple(_removal(r, "a second release claims this component")
                      for r in sorted(found.duplicates, key=lambda r: r.release_name))
        plans.insert(0, DeploymentPlan("", None, extra))
    return Plan(tuple(plans))
