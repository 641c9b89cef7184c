"""The device client attacked where it keeps things: its stored desired state, its state
file, the history of its Git branch, and its report queue across an outage.

End to end with real parts: `margo serve` on loopback, a real OCI registry with the example
charts, the render driver (the real Helm engine writing manifests), `margo device once` in
its own process. Damage is done to the real files (the device's SQLite state, the server's
Git repository); the one stand-in is the link cut at an exact moment in the outage test
(a real TCP proxy, cut from inside the fetch, as tests/reconciler/test_device_e2e.py does),
since a real network cannot be made to fail between two given requests on demand.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kits.chartkit import publish_example_charts
from kits.devicekit import (
    Device,
    cycle_losing_the_link,
    head,
    new_device,
    once,
    steps,
    wait_for_new_commit,
)
from kits.fleetserver import FleetServer, fleet_server, write_fleet
from kits.netkit import cuttable_proxy
from kits.serverkit import free_port

from margo.digests import digest_of
from reconciler.assembly import open_reconciler
from reconciler.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(registry: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetServer]:
    workdir = tmp_path_factory.mktemp("device-damage")
    publish_example_charts(registry)
    fleet = write_fleet(workdir / "fleet", registry=registry, intents={})
    with fleet_server(workdir, fleet=fleet) as running:
        yield running


def greeting(device: Device) -> str:
    [configmap] = device.output.glob("*/*/*/templates/configmap.yaml")
    found = [line.split(":", 1)[1].strip().strip('"') for line in
             configmap.read_text().splitlines() if line.strip().startswith("GREETING:")]
    assert len(found) == 1, configmap.read_text()
    return found[0]


def set_greeting(server: FleetServer, device: Device, text: str) -> None:
    before = head(server, device)
    server.set_parameter(device.device_id, "greeting", text)
    wait_for_new_commit(server, device, before)


def tamper_with_stored_documents(device: Device, old: bytes, new: bytes) -> None:
    """Change the adopted documents' bytes in the device's state file, digests untouched:
    what a bad sector, or someone with write access to the data directory, leaves behind."""
    conn = sqlite3.connect(device.state_file)
    try:
        rows = conn.execute("SELECT deployment_id, data FROM documents").fetchall()
        assert rows and all(old in bytes(data) for _, data in rows)
        for deployment_id, data in rows:
            conn.execute("UPDATE documents SET data = ? WHERE deployment_id = ?",
                         (bytes(data).replace(old, new), deployment_id))
        conn.commit()
    finally:
        conn.close()


def stored_documents_intact(device: Device) -> bool:
    conn = sqlite3.connect(device.state_file)
    try:
        rows = conn.execute("SELECT digest, data FROM documents").fetchall()
    finally:
        conn.close()
    return bool(rows) and all(digest_of(bytes(data)) == digest for digest, data in rows)


# --- a damaged local copy ------------------------------------------------------------------


@pytest.mark.parametrize("source", ["margo-rest", "git"])
def test_a_damaged_stored_document_is_fetched_again_never_applied(server: FleetServer,
                                                                  source: str) -> None:
    """Before: an unchanged poll (304, or the same Git tip) reconfigured the release with
    the tampered bytes and reported converged."""
    device = new_device(server, f"tampered-{source}", source=source)
    assert steps(once(device)) == [("install", "ok")]
    assert greeting(device) == "Hello"

    tamper_with_stored_documents(device, b"Hello", b"Pwned")
    report = once(device)
    assert report["fetched"] == "adopted"  # the same version, fetched again
    assert report["steps"] == [] and report["converged"]  # nothing to change: it was intact
    assert greeting(device) == "Hello"
    assert stored_documents_intact(device)
    assert "no longer match their digests" in report["stderr"]


def test_a_damaged_stored_document_is_not_applied_while_the_server_is_away(
        server: FleetServer) -> None:
    device = new_device(server, "tampered-offline")
    once(device)
    tamper_with_stored_documents(device, b"Hello", b"Pwned")
    config = yaml.safe_load(device.config.read_text())
    config["server"]["url"] = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    device.config.write_text(yaml.safe_dump(config))
    report = once(device, expect=1)
    assert report["steps"] == [] and not report["converged"]
    assert any("adopted desired state damaged" in f and "no longer match their digests" in f
               for f in report["failures"]), report["failures"]
    assert greeting(device) == "Hello"  # the workload runs on as it was


# --- rollback protection of the Git source -------------------------------------------------


def move_branch(server: FleetServer, commit: str) -> None:
    """What an attacker with the server's repository does: point the device branch back."""
    git_dir = server.data_dir / "repos" / "fleet-state.git"
    refs = subprocess.run(["git", f"--git-dir={git_dir}", "for-each-ref", "--format=%(refname)",
                           "refs/heads/devices/rewound"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert len(refs) == 1, refs
    subprocess.run(["git", f"--git-dir={git_dir}", "update-ref", refs[0], commit], check=True)


def test_a_rewound_git_branch_is_refused_until_the_operator_accepts_it(
        server: FleetServer) -> None:
    """Before: a branch moved back three commits was adopted at the next poll. The REST
    source refuses the same (an older manifestVersion); now the Git source does too."""
    device = new_device(server, "rewound", source="git")
    once(device)
    first = head(server, device)
    for text in ("One", "Two", "Three"):
        set_greeting(server, device, text)
    latest = head(server, device)
    assert steps(once(device)) == [("reconfigure", "ok")] and greeting(device) == "Three"

    move_branch(server, first)
    for _ in range(2):  # refused on every poll, not just once
        refused = once(device, expect=1)
        assert refused["fetched"] == "rejected" and refused["steps"] == []
        [failure] = refused["failures"]
        assert f"tip {first} does not descend from the adopted commit {latest}" in failure
        assert f"acceptHistoryRewrite: {first}" in failure
        assert "SECURITY" in refused["stderr"]
        assert greeting(device) == "Three"  # the last good state is kept

    # The operator did rewind it on purpose, and says so.
    config = yaml.safe_load(device.config.read_text())
    config["source"]["acceptHistoryRewrite"] = first
    device.config.write_text(yaml.safe_dump(config))
    accepted = once(device)
    assert (accepted["fetched"], accepted["version"]) == ("adopted", first)
    assert steps(accepted) == [("reconfigure", "ok")] and greeting(device) == "Hello"
    assert "the override is now spent" in accepted["stderr"]

    # Forward again is ordinary; back again is refused although the setting is still there.
    move_branch(server, latest)
    assert steps(once(device)) == [("reconfigure", "ok")] and greeting(device) == "Three"
    move_branch(server, first)
    again = once(device, expect=1)
    assert again["fetched"] == "rejected" and "was used once already" in again["failures"][0]
    assert greeting(device) == "Three"
    move_branch(server, latest)


# --- reports queued during an outage -------------------------------------------------------


def test_queued_reports_go_as_soon_as_the_server_answers_again(server: FleetServer) -> None:
    """Before: reports waited out a backoff that had grown during the outage (they arrived
    33-54 s after a 62 s outage ended). Now the first poll the server answers makes them due,
    and they arrive in that same cycle."""
    port = int(server.base.rpartition(":")[2])
    with cuttable_proxy(port) as proxy:
        device = new_device(server, "outage", url=proxy.url)
        started = time.time()
        with open_reconciler(load_config(device.config)) as reconciler:
            result = cycle_losing_the_link(reconciler, proxy)
            assert [s[3] for s in result.steps] == ["ok"] and result.pending_reports == 3

            # The outage goes on: every retry fails and the backoff doubles (0.5-1 s, 1-2 s,
            # then 2-4 s before the next attempt).
            for attempts in (1, 2):
                [queued] = reconciler.state.pending(1)
                assert queued.attempts == attempts
                while time.time() < queued.not_before:
                    time.sleep(0.05)
                assert reconciler.cycle().pending_reports == 3
            [queued] = reconciler.state.pending(1)
            assert queued.attempts == 3 and queued.not_before > time.time() + 1

            restored = time.time()
            proxy.restore()
            back = reconciler.cycle()  # its poll is answered (304)
        assert (back.delivered, back.pending_reports) == (3, 0)
        assert back.converged
    # Each report says when the device saw its state (during the first cycle, before the
    # outage), next to when the server received it (after the outage).
    [deployment] = server.device("outage")["deployments"]
    history = deployment["statusHistory"]
    assert history and all(started - 1 <= r["deviceTime"] < restored for r in history), history
    assert all(r["reportedAt"] >= restored - 0.5 for r in history), history


# --- a damaged state file ------------------------------------------------------------------


def test_an_empty_state_file_stops_the_client_and_says_what_to_do(server: FleetServer) -> None:
    """Before: a 0-byte state file (the content lost in a power cut) started fresh silently,
    forgetting the adopted version and every undelivered report."""
    device = new_device(server, "empty-state")
    once(device)
    device.state_file.write_bytes(b"")
    for suffix in ("-wal", "-shm"):
        device.state_file.with_name(device.state_file.name + suffix).unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "margo_cli.main", "device", "once", "--config",
         str(device.config), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""  # unusable setup, as a bad config
    assert "Traceback" not in done.stderr, done.stderr
    assert f"{device.state_file}: the device state is empty (0 bytes)" in done.stderr
    assert "restore it from a backup" in done.stderr and "docs/operations.md" in done.stderr
    assert device.state_file.stat().st_size == 0  # left for the operator
