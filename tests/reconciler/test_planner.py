"""The pure planner and the desired-document parsing it relies on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from margo.errors import DocumentError
from reconciler.desired import DesiredDeployment, parse_deployment, parse_duration
from reconciler.planner import plan
from reconciler.releases import (
    InstalledRelease,
    ReleaseState,
    ownership_labels,
    release_from_labels,
    release_name,
    short_digest,
    unmanaged_release,
    with_drift,
)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden-fleet"
SPEC = ROOT / "tests" / "fixtures" / "spec-examples" / "valid"

TWO_COMPONENTS = b"""\
id: 0b7c3c55-3f0a-5d55-9d3a-3f1b8c1d2e01
metadata:
  name: two-parts
  namespace: shop
  deviceId: edge-1
spec:
  applicationId: com-example-two
  deploymentProfile:
    type: helm
    components:
      - name: database
        properties: {repository: oci://127.0.0.1:5000/charts/db, revision: 1.0.0}
      - name: frontend
        properties: {repository: oci://127.0.0.1:5000/charts/web, revision: 2.0.0,
                     wait: false, timeout: 1m30s}
  parameters:
    greeting:
      value: Hi
      targets: [{pointer: config.greeting, components: [frontend]}]
"""


def two(**replace: str) -> DesiredDeployment:
    text = TWO_COMPONENTS.decode()
    for old, new in replace.items():
        text = text.replace(old.replace("_", " "), new)
    return parse_deployment(text.encode())


def installed_from(deployment: DesiredDeployment, *, skip: tuple[str, ...] = (),
                   healthy: bool = True,
                   state: ReleaseState | None = None) -> list[InstalledRelease]:
    out = []
    for component in deployment.components:
        if component.name in skip:
            continue
        labels = ownership_labels(deployment.deployment_id, component.name,
                                  desired_digest=deployment.digest,
                                  spec_digest=component.spec_digest,
                                  values_digest=component.values_digest)
        found = state or (ReleaseState.DEPLOYED if healthy else ReleaseState.FAILED)
        release = release_from_labels(labels, release_name=release_name(
            deployment.deployment_id, component.name), namespace=deployment.namespace,
            state=found, detail=str(found))
        assert release.managed
        out.append(release)
    return out


def actions(the_plan) -> list[tuple[str, str]]:
    return [(str(s.action), s.component) for d in the_plan.deployments for s in d.steps]


def test_parse_reads_components_values_and_timeouts() -> None:
    deployment = two()
    assert deployment.deployment_id == "0b7c3c55-3f0a-5d55-9d3a-3f1b8c1d2e01"
    assert [c.name for c in deployment.components] == ["database", "frontend"]
    database, frontend = deployment.components
    assert database.wait and database.timeout_seconds == 300
    assert not frontend.wait and frontend.timeout_seconds == 90
    assert frontend.values == {"config": {"greeting": "Hi"}}
    assert database.values == {}
    assert deployment.digest.startswith("sha256:")


def test_every_golden_and_spec_deployment_parses() -> None:
    files = sorted(GOLDEN.glob("*/*.yaml")) + sorted(SPEC.glob("ApplicationDeployment-*.yaml"))
    assert len(files) >= 10
    for file in files:
        parsed = parse_deployment(file.read_bytes(), file=str(file))
        assert parsed.components, file


def test_invalid_documents_are_located_errors() -> None:
    with pytest.raises(DocumentError) as caught:
        parse_deployment(TWO_COMPONENTS.replace(b"type: helm", b"type: rpm"), file="x.yaml")
    assert "x.yaml:" in str(caught.value.problems[0].format())
    with pytest.raises(ValueError, match="timeout"):
        parse_deployment(TWO_COMPONENTS.replace(b"1m30s", b"soon"))


def test_durations() -> None:
    assert parse_duration("8m30s") == 510
    assert parse_duration("1h") == 3600
    assert parse_duration("500ms") == 0.5
    for bad in ("", "5", "m5", "5x", "1h 2m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_fresh_device_installs_in_listed_order() -> None:
    assert actions(plan([two()], [])) == [("install", "database"), ("install", "frontend")]


def test_converged_device_has_nothing_to_do() -> None:
    deployment = two()
    the_plan = plan([deployment], installed_from(deployment))
    assert actions(the_plan) == [("unchanged", "database"), ("unchanged", "frontend")]
    assert the_plan.changes == ()


def test_revision_change_is_an_upgrade_and_values_change_a_reconfigure() -> None:
    before = two()
    newer = two(**{"2.0.0": "2.1.0"})
    assert actions(plan([newer], installed_from(before))) == [
        ("unchanged", "database"), ("upgrade", "frontend")]
    reconfigured = two(**{"value:_Hi": "value: Hello"})
    assert actions(plan([reconfigured], installed_from(before))) == [
        ("unchanged", "database"), ("reconfigure", "frontend")]


def test_unhealthy_release_is_reapplied() -> None:
    deployment = two()
    steps = plan([deployment], installed_from(deployment, healthy=False)).changes
    assert [(str(s.action), s.reason) for s in steps] == [
        ("upgrade", "the installed release is failed")] * 2


def test_removed_deployment_goes_first_in_reverse_component_order() -> None:
    old = two()
    other = two(**{"0b7c3c55-3f0a-5d55-9d3a-3f1b8c1d2e01": "ffffffff-3f0a-5d55-9d3a-3f1b8c1d2e01"})
    the_plan = plan([other], installed_from(old),
                    component_order={old.deployment_id: ["database", "frontend"]})
    assert actions(the_plan) == [("remove", "frontend"), ("remove", "database"),
                                 ("install", "database"), ("install", "frontend")]
    assert the_plan.deployments[0].deployment is None


def test_component_dropped_from_a_deployment_is_removed_before_installs() -> None:
    old = two()
    text = TWO_COMPONENTS.replace(b"name: frontend", b"name: web").replace(
        b"components: [frontend]", b"components: [web]")
    new = parse_deployment(text)
    assert actions(plan([new], installed_from(old))) == [
        ("remove", "frontend"), ("unchanged", "database"), ("install", "web")]


def test_namespace_change_moves_the_release() -> None:
    old = two()
    moved = two(**{"namespace:_shop": "namespace: store"})
    steps = plan([moved], installed_from(old)).changes
    assert [(str(s.action), s.namespace) for s in steps] == [
        ("remove", "shop"), ("install", "store"), ("remove", "shop"), ("install", "store")]


def test_releases_without_all_our_labels_are_unmanaged() -> None:
    deployed = ReleaseState.DEPLOYED
    assert release_from_labels({"app": "mine"}, release_name="x", namespace="n",
                               state=deployed).state is ReleaseState.UNMANAGED
    labels = ownership_labels("d", "c", desired_digest="sha256:" + "a" * 64,
                              spec_digest="sha256:" + "b" * 64, values_digest="sha256:" + "c" * 64)
    del labels["margo-gitops.dev/component"]
    half = release_from_labels(labels, release_name="x", namespace="n", state=deployed)
    assert (half.state, half.managed, half.deployment_id) == (ReleaseState.UNMANAGED, False, "")


@pytest.mark.parametrize(("state", "action", "reason"), [
    (ReleaseState.DEPLOYED, "unchanged", "up to date"),
    (ReleaseState.FAILED, "upgrade", "the installed release is failed"),
    (ReleaseState.PENDING_INSTALL, "reinstall", "the installed release is pending-install"),
    (ReleaseState.PENDING_UPGRADE, "recover", "the installed release is pending-upgrade"),
])
def test_what_was_found_decides_the_action(state: ReleaseState, action: str,
                                           reason: str) -> None:
    deployment = two()
    steps = plan([deployment], installed_from(deployment, state=state)).deployments[0].steps
    assert [(str(s.action), s.reason) for s in steps] == [(action, reason)] * 2


def test_a_name_taken_by_what_is_not_ours_is_skipped_and_never_removed() -> None:
    deployment = two()
    database = release_name(deployment.deployment_id, "database")
    taken = [unmanaged_release(database, "shop"), unmanaged_release("by-hand", "shop"),
             unmanaged_release(release_name(deployment.deployment_id, "frontend"), "other")]
    [dplan] = plan([deployment], taken).deployments
    assert [(str(s.action), s.component) for s in dplan.steps] == [
        ("skip", "database"), ("install", "frontend")]  # another namespace: no clash
    assert dplan.steps[0].reason == (f"release {database} in namespace shop exists but is not "
                                     "managed by margo-gitops; it is left alone")
    assert plan([], taken).deployments == ()


def test_duplicate_claims_keep_the_deterministic_name() -> None:
    deployment = two()
    [database, frontend] = installed_from(deployment)
    copy = InstalledRelease(**{**database.__dict__, "release_name": "database-copy"})
    the_plan = plan([deployment], [copy, database, frontend])
    removals = [s.release_name for s in the_plan.changes]
    assert removals == ["database-copy"]


def test_release_names_are_short_valid_and_distinct() -> None:
    names = {release_name("0b7c3c55-3f0a-5d55-9d3a-3f1b8c1d2e01", c)
             for c in ("database", "Database", "x" * 200, "9lives", "a_b", "a-b", "---")}
    assert len(names) == 7
    for name in names:
        assert len(name) <= 53
        assert name[0].isalpha() and name.replace("-", "").isalnum() and name == name.lower()
    assert release_name("d", "c") == release_name("d", "c")
    assert len(short_digest("sha256:" + "0" * 64)) == 40


def test_plans_are_deterministic() -> None:
    a, b = two(), two(**{"0b7c3c55": "1b7c3c55"})
    first = plan([a, b], installed_from(a, skip=("frontend",)))
    second = plan([b, a], list(reversed(installed_from(a, skip=("frontend",)))))
    assert first == second


def test_drift_is_repaired_only_when_the_policy_says_so() -> None:
    desired = two()
    database, frontend = installed_from(desired)
    found = "edited: database/templates/configmap.yaml"
    warned = replace(database, drift=found)
    assert actions(plan([desired], [warned, frontend])) == [
        ("unchanged", "database"), ("unchanged", "frontend")]
    repairing = with_drift(database, found, "repair")
    the_plan = plan([desired], [repairing, frontend])
    assert actions(the_plan) == [("repair", "database"), ("unchanged", "frontend")]
    step = the_plan.changes[0]
    assert (step.reason, step.installed, step.desired) == (
        f"drifted: {found}", repairing, desired.components[0])
    assert with_drift(database, found, "warn") == warned
    assert with_drift(database, found, "off") == database
    with pytest.raises(ValueError, match="off, warn, repair"):
        with_drift(database, found, "fix")


def test_a_changed_package_or_values_wins_over_drift() -> None:
    old = two()
    drifted = [with_drift(r, "missing: Deployment shop/x", "repair") for r in installed_from(old)]
    assert actions(plan([two(**{"revision: 1.0.0": "revision: 1.1.0",
                                "value: Hi": "value: Hey"})], drifted)) == [
        ("upgrade", "database"), ("reconfigure", "frontend")]
