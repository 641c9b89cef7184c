"""RenderDriver: real charts from the real OCI registry, rendered by the real Helm engine into
a directory, with the ledger as its release records. Steps come from the real planner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kits.chartkit import (
    DEPLOYMENT_ID,
    actions,
    converge,
    greeter,
    publish_chart,
    write_chart,
)

from margo.digests import digest_of
from reconciler.charts import ChartCache
from reconciler.desired import DesiredDeployment
from reconciler.drivers.render import LEDGER_NAME, RenderDriver
from reconciler.errors import ApplyError
from reconciler.planner import Action, Step, plan
from reconciler.releases import LABEL_MANAGED_BY, release_name, short_digest

RELEASE = release_name(DEPLOYMENT_ID, "greeter")


@pytest.fixture(scope="module")
def repository(registry: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """greeter 1.0.0 (with a Deployment), 2.0.0 (ConfigMap only) and a broken 3.0.0."""
    src = tmp_path_factory.mktemp("charts")
    publish_chart(registry, write_chart(src, version="1.0.0", deployment=True),
                  repo_path="render")
    publish_chart(registry, write_chart(src, version="2.0.0"), repo_path="render")
    # 4.0.0 writes what Helm tells a template about the render (repairs must not change it).
    release = write_chart(src, version="4.0.0")
    (release / "templates" / "release.yaml").write_text(
        "revision: {{ .Release.Revision }}\ninstall: {{ .Release.IsInstall }}\n")
    publish_chart(registry, release, repo_path="render")
    return publish_chart(registry, write_chart(src, version="3.0.0", broken=True),
                         repo_path="render")


@pytest.fixture
def charts(tmp_path: Path) -> Iterator[ChartCache]:
    with ChartCache(tmp_path / "cache") as cache:
        yield cache


@pytest.fixture
def driver(tmp_path: Path, charts: ChartCache) -> RenderDriver:
    return RenderDriver(tmp_path / "out", charts)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def ledger(driver: RenderDriver) -> dict:
    return json.loads((driver.output_dir / LEDGER_NAME).read_text())["releases"]


def release_files(driver: RenderDriver) -> dict[str, bytes]:
    return tree(driver.output_dir / "edge" / RELEASE)


def test_install_writes_one_file_per_manifest_and_records_the_release(
        driver: RenderDriver, repository: str) -> None:
    desired = greeter(repository, greeting="Hi there", replicas=3)
    assert actions(converge(driver, [desired])) == ["install:greeter"]

    files = release_files(driver)
    assert sorted(files) == ["greeter/templates/configmap.yaml",
                             "greeter/templates/deployment.yaml"]  # no NOTES.txt, no helpers
    configmap = files["greeter/templates/configmap.yaml"].decode()
    assert f"name: {RELEASE}-config" in configmap
    assert 'greeting: "Hi there"' in configmap
    assert 'replicas: "3"' in configmap

    entry = ledger(driver)[f"edge/{RELEASE}"]
    assert entry["status"] == "deployed"
    assert entry["revision"] == 1
    assert entry["chart"] == {"name": "greeter", "version": "1.0.0"}
    assert entry["labels"][LABEL_MANAGED_BY] == "margo-gitops"

    [installed] = driver.installed()
    component = desired.components[0]
    assert (installed.release_name, installed.namespace, installed.component) == (
        RELEASE, "edge", "greeter")
    assert installed.healthy and installed.detail == "deployed"
    assert installed.chart_version == "1.0.0"
    assert installed.desired_digest == short_digest(desired.digest)
    assert installed.values_digest == short_digest(component.values_digest)
    # Converged: a second pass has nothing to do.
    assert actions(converge(driver, [desired])) == []


def test_upgrade_to_a_newer_chart_replaces_the_whole_render(driver: RenderDriver,
                                                            repository: str) -> None:
    converge(driver, [greeter(repository, "1.0.0")])
    assert actions(converge(driver, [greeter(repository, "2.0.0")])) == ["upgrade:greeter"]
    files = release_files(driver)
    # 2.0.0 has no Deployment: the old file is gone, not left over.
    assert sorted(files) == ["greeter/templates/configmap.yaml"]
    assert b'chartVersion: "2.0.0"' in files["greeter/templates/configmap.yaml"]
    entry = ledger(driver)[f"edge/{RELEASE}"]
    assert (entry["revision"], entry["status"], entry["chart"]["version"]) == (2, "deployed",
                                                                             "2.0.0")
    assert [p.name for p in (driver.output_dir / "edge").iterdir()] == [RELEASE]


def test_reconfigure_renders_the_new_values(driver: RenderDriver, repository: str) -> None:
    converge(driver, [greeter(repository, "2.0.0", greeting="Hello")])
    the_plan = converge(driver, [greeter(repository, "2.0.0", greeting="Servus")])
    assert actions(the_plan) == ["reconfigure:greeter"]
    assert b'greeting: "Servus"' in release_files(driver)["greeter/templates/configmap.yaml"]
    assert ledger(driver)[f"edge/{RELEASE}"]["revision"] == 2


def test_remove_deletes_the_directory_and_the_entry_idempotently(driver: RenderDriver,
                                                                 repository: str) -> None:
    converge(driver, [greeter(repository, "2.0.0")])
    the_plan = converge(driver, [])
    assert actions(the_plan) == ["remove:greeter"]
    assert not (driver.output_dir / "edge").exists()
    assert ledger(driver) == {}
    assert driver.installed() == []
    driver.apply(the_plan.changes[0], None)  # removing again is fine
    assert ledger(driver) == {}


def test_a_crash_mid_render_is_unhealthy_and_applied_again(driver: RenderDriver,
                                                           repository: str) -> None:
    desired = greeter(repository, "2.0.0", greeting="Hello")
    converge(driver, [desired])
    # What a crash during the next upgrade leaves: the entry still pending, and a
    # half-written staging directory beside the release.
    path = driver.output_dir / LEDGER_NAME
    document = json.loads(path.read_text())
    document["releases"][f"edge/{RELEASE}"]["status"] = "pending-upgrade"
    path.write_text(json.dumps(document))
    staging = driver.output_dir / "edge" / f".{RELEASE}.new-0123456789ab"
    staging.mkdir()
    (staging / "partial.yaml").write_text("apiVersion: v1\nkind: Conf")

    [installed] = driver.installed()
    assert not installed.healthy and installed.detail == "pending-upgrade"
    the_plan = converge(driver, [desired])
    assert [(s.action, s.reason) for s in the_plan.changes] == [
        (Action.RECOVER, "the installed release is pending-upgrade")]
    assert driver.installed()[0].healthy
    assert not staging.exists()
    assert ledger(driver)[f"edge/{RELEASE}"]["revision"] == 2


@pytest.mark.parametrize(("policy", "action"), [("repair", "repair:greeter"),
                                                 ("off", "upgrade:greeter")])
def test_a_vanished_output_directory_is_rendered_again(tmp_path: Path, charts: ChartCache,
                                                       repository: str, policy: str,
                                                       action: str) -> None:
    driver = RenderDriver(tmp_path / "out", charts, drift=policy)
    desired = greeter(repository, "2.0.0")
    converge(driver, [desired])
    before = release_files(driver)
    for file in sorted((driver.output_dir / "edge").rglob("*"), reverse=True):
        file.unlink() if file.is_file() else file.rmdir()
    [installed] = driver.installed()
    if policy == "off":  # drift unchecked: the ledger's release is unhealthy, as before
        assert (installed.healthy, installed.detail) == (False,
                                                         "deployed (output directory missing)")
    else:
        assert (installed.healthy, installed.repair, installed.drift) == (
            True, True, f"the rendered directory edge/{RELEASE} is missing")
    assert actions(converge(driver, [desired])) == [action]
    assert release_files(driver) == before


@pytest.mark.parametrize("content", [b"{not json", b"[]", b'{"format": 1}',
                                     b'{"format": 1, "releases": {"no-slash": {}}}',
                                     b'{"format": 1, "releases": {"a/b": {"files": []}}}',
                                     b'{"format": 1, "releases": {"a/b": {"files": {"x": 1}}}}',
                                     b'{"format": 99, "releases": {}}'])
def test_a_corrupt_ledger_is_an_error_not_an_empty_device(driver: RenderDriver,
                                                          repository: str,
                                                          content: bytes) -> None:
    driver.output_dir.mkdir(parents=True)
    (driver.output_dir / LEDGER_NAME).write_bytes(content)
    with pytest.raises(ApplyError) as caught:
        driver.installed()
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert str(driver.output_dir / LEDGER_NAME) in caught.value.message
    desired = greeter(repository, "2.0.0")
    step = plan([desired], []).changes[0]
    with pytest.raises(ApplyError) as caught:
        driver.apply(step, desired)
    assert caught.value.code == "ENGINE_UNAVAILABLE"
    assert (driver.output_dir / LEDGER_NAME).read_bytes() == content  # left for a person


def test_a_template_error_is_a_render_failure_with_helms_message(driver: RenderDriver,
                                                                 repository: str) -> None:
    converge(driver, [greeter(repository, "2.0.0", greeting="Hello")])
    before = release_files(driver)
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repository, "3.0.0")])
    assert caught.value.code == "RENDER_FAILED"
    assert "config.token must be set" in caught.value.message
    assert "broken.yaml" in caught.value.message
    assert not caught.value.retryable
    # Like a failed Helm upgrade: the release is marked failed, the previous render stays.
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    assert release_files(driver) == before


@pytest.mark.parametrize(("greeting", "replicas", "expected"), [
    ("x" * 40, None, "maxLength"),
    (None, "three", "got string, want integer"),
    (None, 99, "maximum"),
])
def test_values_that_break_the_chart_schema_fail_with_helms_message(
        driver: RenderDriver, repository: str, greeting: str | None, replicas: object,
        expected: str) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter(repository, "2.0.0", greeting=greeting, replicas=replicas)])
    assert caught.value.code == "RENDER_FAILED"
    assert expected in caught.value.message
    [installed] = driver.installed()
    assert (installed.healthy, installed.detail) == (False, "failed")
    assert not (driver.output_dir / "edge" / RELEASE).exists()


def test_a_pull_failure_changes_nothing(driver: RenderDriver) -> None:
    with pytest.raises(ApplyError) as caught:
        converge(driver, [greeter("oci://127.0.0.1:1/render/greeter", "2.0.0")])
    assert caught.value.code == "PULL_FAILED"
    assert not driver.output_dir.exists()


def test_the_same_inputs_give_byte_identical_output(tmp_path: Path, charts: ChartCache,
                                                    repository: str) -> None:
    outputs = []
    for name in ("a", "b"):
        driver = RenderDriver(tmp_path / name, charts)
        converge(driver, [greeter(repository, "1.0.0", greeting="Hi", replicas=2)])
        outputs.append(tree(tmp_path / name))
    assert outputs[0] == outputs[1]
    assert LEDGER_NAME in outputs[0]  # the ledger too: no timestamps, sorted keys


def test_entries_that_are_not_ours_are_ignored_and_kept(driver: RenderDriver,
                                                        repository: str) -> None:
    driver.output_dir.mkdir(parents=True)
    foreign = {"namespace": "edge", "labels": {"team": "other"}, "revision": 1,
               "status": "deployed", "chart": {"name": "x", "version": "1"}}
    (driver.output_dir / LEDGER_NAME).write_text(json.dumps(
        {"format": 1, "releases": {"edge/hand-made": foreign}}))
    assert driver.installed() == []
    converge(driver, [greeter(repository, "2.0.0")])
    converge(driver, [])
    assert ledger(driver) == {"edge/hand-made": foreign}


def test_names_that_would_escape_the_output_directory_are_refused(driver: RenderDriver) -> None:
    for namespace, name in (("../etc", RELEASE), ("edge", "../../x"), ("Edge", RELEASE),
                            ("edge\n", RELEASE), ("edge", RELEASE + "\n")):
        step = Step(Action.REMOVE, DEPLOYMENT_ID, "greeter", name, namespace, None, None, "t")
        with pytest.raises(ApplyError) as caught:
            driver.apply(step, None)
        assert caught.value.code == "INVALID_STEP"


def tamper(driver: RenderDriver) -> None:
    """What a person with a shell does to a release's directory: one file edited, one
    deleted, one added."""
    directory = driver.output_dir / "edge" / RELEASE / "greeter" / "templates"
    configmap = directory / "configmap.yaml"
    configmap.write_text(configmap.read_text().replace("Hello", "Hacked"))
    (directory / "deployment.yaml").unlink()
    (directory / "extra.yaml").write_text("kind: Secret\n")


DRIFT = ("rendered files changed: edited greeter/templates/configmap.yaml; deleted "
         "greeter/templates/deployment.yaml; added greeter/templates/extra.yaml")


def test_edited_deleted_and_added_files_are_drift_repaired_byte_for_byte(
        driver: RenderDriver, repository: str) -> None:
    desired = greeter(repository, "1.0.0", greeting="Hello")
    converge(driver, [desired])
    before, entry = release_files(driver), ledger(driver)[f"edge/{RELEASE}"]
    assert sorted(entry["files"]) == sorted(before)  # the ledger records what it wrote
    assert driver.installed()[0].drift == ""
    tamper(driver)
    [drifted] = driver.installed()
    assert (drifted.healthy, drifted.repair, drifted.drift) == (True, True, DRIFT)
    the_plan = converge(driver, [desired])
    assert [(s.action, s.reason) for s in the_plan.changes] == [
        (Action.REPAIR, f"drifted: {DRIFT}")]
    assert release_files(driver) == before
    assert ledger(driver)[f"edge/{RELEASE}"] == entry  # same revision, same digests
    assert driver.installed()[0].drift == ""
    assert actions(converge(driver, [desired])) == []


def test_a_repair_renders_the_same_revision_as_the_same_kind_of_operation(
        driver: RenderDriver, repository: str) -> None:
    converge(driver, [greeter(repository, "4.0.0", greeting="Hello")])
    desired = greeter(repository, "4.0.0", greeting="Servus")
    converge(driver, [desired])
    written = driver.output_dir / "edge" / RELEASE / "greeter" / "templates" / "release.yaml"
    assert written.read_text() == "revision: 2\ninstall: false\n"
    written.unlink()
    assert actions(converge(driver, [desired])) == ["repair:greeter"]
    assert written.read_text() == "revision: 2\ninstall: false\n"
    assert ledger(driver)[f"edge/{RELEASE}"]["revision"] == 2


def test_with_warn_drift_is_reported_and_nothing_is_rewritten(
        tmp_path: Path, charts: ChartCache, repository: str) -> None:
    driver = RenderDriver(tmp_path / "out", charts, drift="warn")
    desired = greeter(repository, "1.0.0")
    converge(driver, [desired])
    tamper(driver)
    tampered = release_files(driver)
    [drifted] = driver.installed()
    assert (drifted.healthy, drifted.repair, drifted.drift) == (True, False, DRIFT)
    assert actions(converge(driver, [desired])) == []
    assert release_files(driver) == tampered


def test_a_ledger_from_before_digests_is_read_and_gets_them_on_the_next_render(
        driver: RenderDriver, repository: str) -> None:
    converge(driver, [greeter(repository, "2.0.0")])
    path = driver.output_dir / LEDGER_NAME
    document = json.loads(path.read_text())
    for entry in document["releases"].values():
        del entry["files"], entry["install"]
    path.write_text(json.dumps(document))
    (driver.output_dir / "edge" / RELEASE / "greeter" / "templates" / "extra.yaml").write_text(
        "kind: Secret\n")
    [installed] = driver.installed()
    assert (installed.healthy, installed.drift) == (True, "")  # nothing recorded to compare
    desired = greeter(repository, "2.0.0", greeting="Servus")
    assert actions(converge(driver, [desired])) == ["reconfigure:greeter"]
    assert sorted(ledger(driver)[f"edge/{RELEASE}"]["files"]) == [
        "greeter/templates/configmap.yaml"]


class FaultyDisk(RenderDriver):
    """A test double for a fault, not something the real driver does: right after each
    step's files are written, and before they are read back, the disk changes one of
    them (a failing disk, or another process writing into the output directory)."""

    def apply(self, step: Step, deployment: DesiredDeployment | None) -> None:
        super().apply(step, deployment)
        if step.action is not Action.REMOVE:
            tamper(self)


def test_files_that_differ_from_what_was_written_fail_the_read_back(
        tmp_path: Path, charts: ChartCache, repository: str) -> None:
    """Without the read-back, this step would be reported installed (`converge` returns);
    with it, the step fails naming each file, the digest written and the one found."""
    driver = FaultyDisk(tmp_path / "out", charts)
    desired = greeter(repository, "1.0.0", greeting="Hello")
    with pytest.raises(ApplyError) as caught:
        converge(driver, [desired])
    written = ledger(driver)[f"edge/{RELEASE}"]["files"]
    found = {name: digest_of(data) for name, data in release_files(driver).items()}
    edited, deleted, added = (f"greeter/templates/{name}.yaml"
                              for name in ("configmap", "deployment", "extra"))
    assert caught.value.code == "READBACK_MISMATCH"
    assert caught.value.retryable
    assert caught.value.message == (
        f"the rendered release edge/{RELEASE} is not what was applied: "
        f"file {edited}: expected {written[edited]}, found {found[edited]}; "
        f"file {deleted}: expected {written[deleted]}, found nothing; "
        f"file {added}: expected nothing, found {found[added]}")
    # The next pass sees the same files as drift and writes them again (a sound disk).
    assert actions(converge(RenderDriver(tmp_path / "out", charts), [desired])) == [
        "repair:greeter"]


def test_a_removal_is_read_back_as_gone(driver: RenderDriver, repository: str) -> None:
    converge(driver, [greeter(repository, "2.0.0")])
    [remove] = plan([], driver.installed()).changes
    driver.apply(remove, None)
    driver.confirm(remove, None)
    (driver.output_dir / "edge" / RELEASE).mkdir(parents=True)  # left behind: not gone
    with pytest.raises(ApplyError) as caught:
        driver.confirm(remove, None)
    assert caught.value.message == (f"the rendered release edge/{RELEASE} is not what was "
                                    "applied: directory: expected nothing, found present")
