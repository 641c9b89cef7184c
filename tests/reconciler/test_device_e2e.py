"""The device client end to end: a real `margo serve`, a real OCI registry, the real Helm
engine (render driver), the `margo device` command in its own process.

Each test has its own device and intent on one shared server, so tests stay independent:
deploy, stay unchanged, reconfigure, upgrade to a newer chart, remove; through the REST
manifest and through Git; and the faults the issue lists (server unreachable while applying,
registry down, a chart that fails to render, a manifest rollback, SIGKILL mid-apply).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kits.chartkit import publish_chart, publish_example_charts, write_chart
from kits.devicekit import (
    HELLO,
    Device,
    cycle_losing_the_link,
    head,
    intent,
    new_device,
    once,
    steps,
    wait_for_new_commit,
)
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.netkit import cuttable_proxy
from kits.registrykit import running_registry

from reconciler.assembly import open_reconciler
from reconciler.config import load_config
from reconciler.desired import DesiredState

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class World:
    server: FleetServer
    registry: str
    spare_registry_port: int
    workdir: Path


def _app_copy(fleet: Path, app_id: str, repository: str, revision: str) -> None:
    """Another application: hello-world's descriptor under a new id and package."""
    source = (fleet / "apps" / HELLO / "margo.yaml").read_text()
    description = yaml.safe_load(source)
    description["id"] = app_id
    description["deploymentProfiles"] = [p for p in description["deploymentProfiles"]
                                         if p["type"] == "helm"]
    component = description["deploymentProfiles"][0]["components"][0]
    component["properties"].update({"repository": repository, "revision": revision})
    for parameter in description["parameters"].values():
        parameter["targets"] = [t for t in parameter["targets"]
                                if t["components"] == [component["name"]]]
    target = fleet / "apps" / app_id / "margo.yaml"
    target.parent.mkdir(parents=True)
    target.write_text(yaml.safe_dump(description, sort_keys=False))


@pytest.fixture(scope="module")
def world(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    workdir = tmp_path_factory.mktemp("device-e2e")
    publish_example_charts(registry)
    # A newer hello-world chart for the upgrade test.
    newer = workdir / "charts" / "hello-world"
    shutil.copytree(ROOT / "examples/fleet/apps" / HELLO / "charts/hello-world", newer)
    chart_yaml = newer / "Chart.yaml"
    chart_yaml.write_text(chart_yaml.read_text().replace("version: 1.0.0", "version: 1.1.0"))
    publish_chart(registry, newer)
    broken = publish_chart(registry, write_chart(workdir / "charts", "broken", broken=True))
    fleet = write_fleet(workdir / "fleet", registry=registry, intents={})
    _app_copy(fleet, "com-example-broken", broken, "1.0.0")
    # An application whose chart lives in a registry the registry-outage test stops.
    spare_dir = workdir / "spare-registry"
    with running_registry(spare_dir) as spare:
        spare_repo = publish_chart(spare, write_chart(workdir / "charts", "spare"))
    _app_copy(fleet, "com-example-spare", spare_repo, "1.0.0")
    with fleet_server(workdir, fleet=fleet) as server:
        yield World(server, registry, int(spare.rpartition(":")[2]), workdir)


def ledger(device: Device) -> dict[str, Any]:
    path = device.output / ".ledger.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ledger_releases(device: Device) -> dict[str, Any]:
    """The ledger's releases, tolerating a read that races the driver's atomic replace."""
    try:
        releases: dict[str, Any] = ledger(device).get("releases", {})
    except (json.JSONDecodeError, FileNotFoundError):
        return {}
    return releases


def rendered_config(device: Device) -> str:
    files = sorted(device.output.glob("*/*/*/templates/configmap.yaml"))
    assert len(files) == 1, files
    return files[0].read_text()


def deployment_id(world: World, device: Device) -> str:
    deployments = world.server.device(device.device_id)["deployments"]
    assert len(deployments) == 1, deployments
    return str(deployments[0]["deploymentId"])


def history(world: World, deployment: str) -> list[str]:
    """Overall states the server recorded for a deployment, in arrival order."""
    with sqlite3.connect(world.server.data_dir / "wfm.sqlite") as conn:
        rows = conn.execute("SELECT state FROM status_reports WHERE deployment_id = ? "
                            "ORDER BY id", (deployment,)).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("source", ["margo-rest", "git"])
def test_deploy_reconfigure_upgrade_and_remove(world: World, source: str) -> None:
    device = new_device(world.server, f"life-{source}", source=source)
    server = world.server

    first = once(device)
    assert steps(first) == [("install", "ok")]
    assert "GREETING: \"Hello\"" in rendered_config(device)
    deployment = deployment_id(world, device)
    assert server.statuses(deployment)["state"] == "installed"
    assert history(world, deployment) == ["pending", "installing", "installed"]

    again = once(device)
    assert again["steps"] == [] and again["converged"]

    commit = head(world.server, device)
    server.set_parameter(device.device_id, "greeting", "Bonjour")
    wait_for_new_commit(world.server, device, commit)
    assert steps(once(device)) == [("reconfigure", "ok")]
    assert "GREETING: \"Bonjour\"" in rendered_config(device)
    [release] = ledger(device)["releases"].values()
    assert release["chart"]["version"] == "1.0.0"

    # A newer chart: the application descriptor moves to revision 1.1.0.
    app = server.source_dir / "apps" / HELLO / "margo.yaml"
    commit = head(world.server, device)
    original = app.read_text()
    try:
        app.write_text(original.replace("revision: 1.0.0", "revision: 1.1.0"))
        wait_for_new_commit(world.server, device, commit)
        assert steps(once(device)) == [("upgrade", "ok")]
        [release] = ledger(device)["releases"].values()
        assert release["chart"]["version"] == "1.1.0"
    finally:
        app.write_text(original)
    wait_for_new_commit(world.server, device, head(world.server, device))
    assert steps(once(device)) == [("upgrade", "ok")]

    server.remove_intent(device.device_id)
    server.wait_for(lambda: not server.device(device.device_id)["deployments"],
                    what="the deployment to leave the branch")
    assert steps(once(device)) == [("remove", "ok")]
    assert ledger(device)["releases"] == {}
    assert not list(device.output.glob("*/*/*/templates/configmap.yaml"))
    states = history(world, deployment)
    assert states[-2:] == ["removing", "removed"], states
    assert states.count("pending") == 1  # one deployment, never re-created


def test_reports_made_while_the_server_is_unreachable_arrive_later_in_order(
        world: World) -> None:
    port = int(world.server.base.rpartition(":")[2])
    with cuttable_proxy(port) as proxy:
        device = new_device(world.server, "cut-link", url=proxy.url)
        config = load_config(device.config)
        with open_reconciler(config) as reconciler:
            result = cycle_losing_the_link(reconciler, proxy)
            assert [s[3] for s in result.steps] == ["ok"]
            assert result.delivered == 0 and result.pending_reports == 3
            deployment = deployment_id(world, device)
            assert history(world, deployment) == []

            proxy.restore()
            # Deferred reports wait out their backoff (about a second) and then go in order.
            deadline = time.monotonic() + 20
            while True:
                result = reconciler.cycle()
                assert result.steps == [] and result.converged
                if result.pending_reports == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert result.pending_reports == 0
    assert history(world, deployment) == ["pending", "installing", "installed"]


def test_registry_down_is_a_clear_failure_retried_next_cycle(world: World) -> None:
    device = new_device(world.server, "registry-down", app="com-example-spare")
    failed = once(device, expect=1)
    assert steps(failed) == [("install", "failed: PULL_FAILED")]
    assert "connection refused" in " ".join(failed["failures"])
    deployment = deployment_id(world, device)
    status = world.server.statuses(deployment)
    assert status["state"] == "failed"
    assert status["components"][0]["error"]["code"] == "PULL_FAILED"

    with running_registry(world.workdir / "spare-registry", port=world.spare_registry_port):
        assert steps(once(device)) == [("install", "ok")]
    assert history(world, deployment) == ["pending", "installing", "failed", "installing",
                                          "installed"]


def test_a_chart_that_fails_to_render_reports_helms_message(world: World) -> None:
    device = new_device(world.server, "broken-chart", app="com-example-broken")
    failed = once(device, expect=1)
    assert steps(failed) == [("install", "failed: RENDER_FAILED")]
    status = world.server.statuses(deployment_id(world, device))
    error = status["components"][0]["error"]
    assert "config.token must be set" in error["message"]
    assert status["state"] == "failed"
    # Not retryable without a change: a running client tries once (a fresh process may try
    # again: the wait is kept in memory), then waits for the desired state to change.
    with open_reconciler(load_config(device.config)) as reconciler:
        assert [s[3] for s in reconciler.cycle().steps] == ["failed: RENDER_FAILED"]
        second = reconciler.cycle()
    assert second.steps == [] and not second.converged


def test_a_manifest_rollback_is_rejected_and_the_device_keeps_its_state(world: World) -> None:
    device = new_device(world.server, "rollback")
    once(device)
    config = load_config(device.config)
    with open_reconciler(config) as reconciler:
        adopted = reconciler.state.adopted()
        # The device remembers a far newer version than the server will now serve (say the
        # server was restored from an old backup).
        documents = reconciler.state.desired_documents()
        from reconciler.desired import parse_deployment
        reconciler.state.adopt(DesiredState(
            source="margo-rest", version="1000000", manifest_version=1_000_000,
            etag=adopted.etag, deployments=tuple(parse_deployment(d) for d in documents)))
        commit = head(world.server, device)
        _, served = world.server.manifest()
        world.server.set_parameter(device.device_id, "greeting", "Changed")
        wait_for_new_commit(world.server, device, commit)
        # (the branch moves before the server serves the new manifest: wait for that too)
        world.server.wait_for_change(served)
        result = reconciler.cycle()
    assert result.fetched == "rejected"
    assert result.steps == []
    assert any("ROLLBACK" in f or "manifestVersion" in f for f in result.failures)
    assert "GREETING: \"Hello\"" in rendered_config(device)


def test_sigkill_mid_apply_converges_without_duplicates(world: World) -> None:
    device = new_device(world.server, "killed", with_intent=False)
    for index in range(6):
        world.server.edit_intent(f"killed-{index}", intent(
            f"killed-{index}", device=device.device_id, greeting=f"Hi{index}",
            namespace=f"kill-{index}"))
    world.server.wait_for_deployments(6, device_id=device.device_id)
    command = [sys.executable, "-m", "margo_cli.main", "device", "run", "--config",
               str(device.config), "--log-level", "warning"]
    partial: list[dict[str, str]] = []
    for target in (1, 3, 5):
        # Kill as soon as the engine's ledger shows `target` releases: the client is then in
        # the middle of applying the rest (and of journaling and delivering their statuses).
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while len(ledger_releases(device)) < target and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        partial.append({k: v["status"] for k, v in ledger_releases(device).items()})
    assert any(len(seen) < 6 for seen in partial), partial  # some kill landed mid-apply
    final = once(device)
    assert final["converged"]
    releases = ledger(device)["releases"]
    assert len(releases) == 6
    assert {r["status"] for r in releases.values()} == {"deployed"}
    assert len({(r["labels"]["margo-gitops.dev/deployment"]) for r in releases.values()}) == 6
    for summary in world.server.device(device.device_id)["deployments"]:
        states = history(world, summary["deploymentId"])
        assert summary["state"] == "installed", states
        assert states[0] == "pending" and states[-1] == "installed", states
        assert states.count("pending") == 1, states


def test_nothing_is_contacted_during_downtime(world: World) -> None:
    device = new_device(world.server, "downtime")
    config = yaml.safe_load(device.config.read_text())
    config["schedule"]["downtime"] = ["00:00-24:00"]
    device.config.write_text(yaml.safe_dump(config))
    report = once(device)
    assert report == {**report, "contacted": False, "fetched": "skipped", "steps": []}
    assert not (device.data / "git").exists()
    assert history(world, deployment_id(world, device)) == []
    assert ledger(device) == {}


def reports(world: World, deployment: str) -> list[dict[str, Any]]:
    """The status reports the server stored for a deployment, in arrival order."""
    with sqlite3.connect(world.server.data_dir / "wfm.sqlite") as conn:
        rows = conn.execute("SELECT document FROM status_reports WHERE deployment_id = ? "
                            "ORDER BY id", (deployment,)).fetchall()
    return [json.loads(row[0]) for row in rows]


def test_rendered_files_changed_by_hand_are_repaired_and_the_report_says_so(
        world: World) -> None:
    device = new_device(world.server, "drift-repair")
    assert steps(once(device)) == [("install", "ok")]
    deployment = deployment_id(world, device)
    [configmap] = device.output.glob("*/*/*/templates/configmap.yaml")
    [other] = [p for p in configmap.parent.iterdir() if p != configmap]
    original = configmap.read_bytes(), other.read_bytes()
    configmap.write_text(configmap.read_text().replace("Hello", "Hacked"))
    other.unlink()

    repaired = once(device)
    assert steps(repaired) == [("repair", "ok")] and repaired["converged"]
    assert (configmap.read_bytes(), other.read_bytes()) == original
    relative = configmap.relative_to(configmap.parents[2]).as_posix()
    drift = (f"rendered files changed: edited {relative}; deleted "
             f"{other.relative_to(configmap.parents[2]).as_posix()}")
    assert "drifted, repairing" in repaired["stderr"] and drift in repaired["stderr"]
    assert history(world, deployment)[-2:] == ["installing", "installed"]
    last = reports(world, deployment)[-1]
    assert last["status"]["state"] == "installed"
    assert last["x-margo-gitops-extensions"]["repaired"] == {"hello-world": drift}
    assert all("repaired" not in r.get("x-margo-gitops-extensions", {})
               for r in reports(world, deployment)[:-1])
    assert world.server.statuses(deployment)["repaired"] == {"hello-world": drift}  # read API
    assert steps(once(device)) == []


def test_with_warn_a_changed_rendered_file_is_reported_drifted_and_left(world: World) -> None:
    device = new_device(world.server, "drift-warn")
    config = yaml.safe_load(device.config.read_text())
    config["driver"]["driftDetection"] = "warn"
    device.config.write_text(yaml.safe_dump(config))
    assert steps(once(device)) == [("install", "ok")]
    [configmap] = device.output.glob("*/*/*/templates/configmap.yaml")
    configmap.write_text(configmap.read_text().replace("Hello", "Hacked"))
    edited = configmap.read_bytes()

    warned = once(device, expect=1)
    assert warned["steps"] == [] and not warned["converged"]
    assert any("DRIFTED" in failure for failure in warned["failures"]), warned["failures"]
    assert configmap.read_bytes() == edited
    status = world.server.statuses(deployment_id(world, device))
    assert status["state"] == "failed"
    [component] = status["components"]
    assert component["error"]["code"] == "DRIFTED"
    assert component["error"]["message"].startswith("rendered files changed: edited ")
