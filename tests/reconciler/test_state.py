"""The device's durable state and its status journal, delivered to a real `margo serve`.

Real parts only: SQLite files in tmp dirs, the fleet server in a subprocess on loopback (its
own SQLite history is read to see what arrived, in which order), a tiny scripted HTTP server
for 503/Retry-After behaviour, and a child process killed with SIGKILL while it writes.
"""

from __future__ import annotations

import email.utils
import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import ROOT, add_client, free_port, running_server
from kits.stubserver import serving, url

from margo.digests import digest_of
from margo.kinds import Kind, Shape
from margo.validation import validate_value
from reconciler.delivery import Outcome, Reporter, backoff_delay
from reconciler.desired import DesiredDeployment, DesiredState, parse_deployment
from reconciler.http_answers import parse_retry_after
from reconciler.state import (
    SCHEMA_VERSION,
    ComponentReport,
    DamagedDocumentsError,
    DeviceState,
    StateError,
)
from reconciler.statuses import status_body, status_path
from tools.polling import poll_until

DEPLOYMENT = b"""id: 11111111-2222-4333-8444-555555555555
metadata: {name: demo, namespace: demo, deviceId: dev-1}
spec:
  applicationId: demo-app
  deploymentProfile:
    type: compose
    components:
      - name: web
        properties: {repository: oci://127.0.0.1:5000/web, revision: 1.0.0}
      - name: db
        properties: {repository: oci://127.0.0.1:5000/db, revision: 2.0.0}
"""
OTHER = DEPLOYMENT.replace(b"11111111-2222", b"99999999-2222").replace(b"name: demo", b"name: o")


def desired(version: str, *documents: bytes, manifest_version: int | None = None,
            etag: str | None = None) -> DesiredState:
    return DesiredState("margo-rest", version, manifest_version, etag,
                        tuple(parse_deployment(d) for d in documents))


def builder(deployment: DesiredDeployment, *, generation: str = "rc.3", adopted: int | None = 1,
            device_id: str | None = None) -> Callable[[list[ComponentReport]], dict[str, Any]]:
    """The runner's body factory: the recorded components straight into `status_body`."""
    def build(components: list[ComponentReport]) -> dict[str, Any]:
        return status_body(generation, deployment_id=deployment.deployment_id,
                           device_id=device_id, adopted_version=adopted, components=components,
                           deployment_name=deployment.name)
    return build


# --- DeviceState on its own -------------------------------------------------------------------


def test_a_new_state_is_empty_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "device.sqlite"
    with DeviceState(path) as state:
        adopted = state.adopted()
        assert (adopted.version, adopted.manifest_version, adopted.etag) == (None, None, None)
        assert dict(adopted.documents) == {}
        assert state.desired_documents() == [] and state.journal_size() == 0
        assert state.get("capabilities.digest/x") is None
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def test_everything_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "device.sqlite"
    demo = parse_deployment(DEPLOYMENT)
    with DeviceState(path) as state:
        state.adopt(desired("7", OTHER, DEPLOYMENT, manifest_version=7, etag='"sha256:ab"'))
        state.set_component_order(demo.deployment_id, ["web", "db"])
        state.record(demo.deployment_id, {"web": ("failed", ("PULL_FAILED", "no such tag")),
                                          "db": ("installed", None)},
                     builder(demo), path="/p")
        state.set("capabilities.digest/dev-1", "sha256:00")
    with DeviceState(path) as state:
        adopted = state.adopted()
        assert (adopted.version, adopted.manifest_version, adopted.etag) == ("7", 7, '"sha256:ab"')
        assert dict(adopted.documents) == {digest_of(DEPLOYMENT): DEPLOYMENT,
                                           digest_of(OTHER): OTHER}
        assert state.adopted_source() == "margo-rest"
        assert state.desired_documents() == [DEPLOYMENT, OTHER]  # deployment id order
        assert state.component_orders() == {demo.deployment_id: ["web", "db"]}
        records = state.component_states(demo.deployment_id)
        assert records["web"].error == {"code": "PULL_FAILED", "message": "no such tag"}
        assert (records["db"].state, records["db"].error) == ("installed", None)
        assert state.known_deployments() == [demo.deployment_id]
        [entry] = state.pending()
        assert json.loads(entry.body)["status"]["state"] == "failed"
        assert state.get("capabilities.digest/dev-1") == "sha256:00"


def test_adopt_replaces_the_whole_document_set(tmp_path: Path) -> None:
    with DeviceState(tmp_path / "s.sqlite") as state:
        state.adopt(desired("a", DEPLOYMENT, OTHER))
        state.adopt(desired("b", OTHER))
        assert state.desired_documents() == [OTHER]
        assert state.adopted().version == "b"


def test_record_appends_only_real_changes(tmp_path: Path) -> None:
    demo = parse_deployment(DEPLOYMENT)
    calls: list[list[ComponentReport]] = []

    def build(components: list[ComponentReport]) -> dict[str, Any]:
        calls.append(components)
        return builder(demo)(components)

    with DeviceState(tmp_path / "s.sqlite") as state:
        record = state.record
        both = {"web": ("installing", None), "db": ("pending", None)}
        assert record(demo.deployment_id, both, build, path="/p")
        assert not record(demo.deployment_id, both, build, path="/p")  # identical: nothing
        assert not record(demo.deployment_id, {"web": ("installing", None)}, build, path="/p")
        assert len(calls) == 1 and state.journal_size() == 1
        # a partial update merges with what is stored; the body sees every component
        assert record(demo.deployment_id, {"web": ("installed", None)}, build, path="/p")
        assert {name for name, _, _ in calls[-1]} == {"web", "db"}
        # the same state with another error is a change
        assert record(demo.deployment_id, {"db": ("failed", ("E1", "first"))}, build, path="/p")
        assert record(demo.deployment_id, {"db": ("failed", ("E2", "second"))}, build, path="/p")
        # `keep` drops a component the deployment no longer has
        assert record(demo.deployment_id, {}, build, path="/p", keep={"web"})
        assert set(state.component_states(demo.deployment_id)) == {"web"}
        bodies = [json.loads(e.body) for e in state.pending()]
        assert [b["status"]["state"] for b in bodies] == ["installing", "pending", "failed",
                                                          "failed", "installed"]
        assert bodies[3]["status"]["error"] == {"code": "E2", "source": "demo",
                                                "message": "second"}
        assert [e.seq for e in state.pending()] == sorted(e.seq for e in state.pending())


def test_a_failing_body_factory_changes_nothing(tmp_path: Path) -> None:
    def broken(components: list[ComponentReport]) -> dict[str, Any]:
        raise RuntimeError("cannot build")

    with DeviceState(tmp_path / "s.sqlite") as state:
        with pytest.raises(RuntimeError):
            state.record("d", {"web": ("installing", None)}, broken, path="/p")
        assert state.component_states("d") == {} and state.journal_size() == 0


def test_the_factory_gets_install_order_and_may_name_the_path(tmp_path: Path) -> None:
    seen: list[list[ComponentReport]] = []

    def build(components: list[ComponentReport]) -> tuple[str, dict[str, Any]]:
        seen.append(components)
        return "/api/v1/deployments/d/status", {"n": len(components)}

    with DeviceState(tmp_path / "s.sqlite") as state:
        state.set_component_order("d", ["web", "db"])
        assert state.record("d", {"zz-extra": ("pending", None), "db": ("failed", {
            "code": "E", "message": "m"}), "web": ("installed", None)}, build)
        assert seen[-1] == [("web", "installed", None),
                            ("db", "failed", {"code": "E", "message": "m"}),
                            ("zz-extra", "pending", None)]
        assert state.pending()[0].path == "/api/v1/deployments/d/status"
        # a dict error and the same (code, message) pair are the same state
        assert not state.record("d", {"db": ("failed", ("E", "m"))}, build)
        with pytest.raises(ValueError, match="needs a path"):
            state.record("d", {"web": ("removing", None)}, lambda c: {"no": "path"})
        with pytest.raises(TypeError, match="component error"):
            state.record("d", {"web": ("failed", "just text")}, build)
        assert state.journal_size() == 1  # the refused calls changed nothing
        assert state.component_states("d")["web"].state == "installed"


def test_journal_bookkeeping_and_forget(tmp_path: Path) -> None:
    with DeviceState(tmp_path / "s.sqlite", clock=lambda: 500.0) as state:
        for n in range(3):
            state.record("d", {"c": (["pending", "installing", "installed"][n], None)},
                         lambda r: {"n": len(r)}, path=f"/p{n}")
        first, second, third = state.pending()
        state.deferred(first.seq, 900.0, 2)
        assert (state.pending(1)[0].not_before, state.pending(1)[0].attempts) == (900.0, 2)
        state.dead_letter(second.seq, "HTTP 422: unknown deployment")
        state.delivered(first.seq)
        assert [e.seq for e in state.pending()] == [third.seq]
        [dead] = state.dead_letters()
        assert (dead.seq, dead.path, dead.reason, dead.attempts) == (
            second.seq, "/p1", "HTTP 422: unknown deployment", 1)
        state.set_component_order("d", ["c"])
        state.forget("d")
        assert state.component_states("d") == {} and state.component_orders() == {}
        assert state.journal_size() == 1  # forgetting never drops undelivered reports


def test_a_corrupt_file_is_a_clear_error_never_a_fresh_start(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database at all" * 200)
    with pytest.raises(StateError, match=r"garbage\.sqlite.*unreadable"):
        DeviceState(garbage)
    assert garbage.read_bytes().startswith(b"this is not")  # untouched

    damaged = tmp_path / "damaged.sqlite"
    with DeviceState(damaged) as state:
        big = DEPLOYMENT + b"# " + b"x" * 40_000 + b"\n"
        state.adopt(desired("1", big))
    # WAL is checkpointed into the main file on close; damage the pages after the header.
    data = bytearray(damaged.read_bytes())
    assert len(data) > 4096 * 4
    data[4096 * 2:4096 * 4] = b"\xff" * (4096 * 2)
    damaged.write_bytes(bytes(data))
    with pytest.raises(StateError, match=r"damaged\.sqlite"):
        DeviceState(damaged)


def test_an_empty_or_orphaned_file_is_damage_never_a_fresh_start(tmp_path: Path) -> None:
    """SQLite itself takes a 0-byte file for a new database: the client must not. Only a
    missing file is created, and it is created whole, so nothing of ours is ever empty."""
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(StateError, match=r"empty\.sqlite: the device state is empty \(0 bytes\)"
                       r".*restore it from a backup.*move it .* aside"):
        DeviceState(empty)
    assert empty.stat().st_size == 0  # untouched: the operator decides

    schemaless = tmp_path / "schemaless.sqlite"
    sqlite3.connect(schemaless).execute("PRAGMA page_size").close()
    conn = sqlite3.connect(schemaless)
    conn.execute("VACUUM")  # a valid, empty database file (header only)
    conn.close()
    assert schemaless.stat().st_size > 0
    with pytest.raises(StateError, match="holds no schema"):
        DeviceState(schemaless)

    orphan = tmp_path / "orphan.sqlite"
    with DeviceState(orphan) as state:
        state.adopt(desired("1", DEPLOYMENT))
        keep = sqlite3.connect(orphan)  # a second reader keeps the WAL from checkpointing away
        keep.execute("SELECT 1 FROM documents").fetchall()
        wal = (orphan.parent / "orphan.sqlite-wal").read_bytes()
    keep.close()
    orphan.unlink()
    (orphan.parent / "orphan.sqlite-wal").write_bytes(wal or b"x")
    with pytest.raises(StateError, match="missing but its write-ahead log"):
        DeviceState(orphan)

    fresh = tmp_path / "new" / "device.sqlite"
    with DeviceState(fresh) as state:
        assert state.adopted() == state.adopted()  # opens and reads
    assert sorted(p.name for p in fresh.parent.iterdir() if not p.name.startswith(
        "device.sqlite-")) == ["device.sqlite"]  # no half-made sibling left behind


def test_a_damaged_stored_document_is_never_handed_out(tmp_path: Path) -> None:
    """Every read of a stored document checks its digest. The bytes are changed in the file
    itself (as a bad disk or someone with the file would), not in the code."""
    path = tmp_path / "device.sqlite"
    demo, other = parse_deployment(DEPLOYMENT), parse_deployment(OTHER)
    with DeviceState(path) as state:
        state.adopt(desired("7", DEPLOYMENT, OTHER, manifest_version=7, etag='"e"'))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE documents SET data = replace(data, '2.0.0', '6.6.6') "
                 "WHERE deployment_id = ?", (demo.deployment_id,))
    conn.commit()
    conn.close()
    with DeviceState(path) as state:
        adopted = state.adopted()
        assert (adopted.version, adopted.manifest_version, adopted.etag) == ("7", 7, '"e"')
        assert adopted.damaged == (demo.deployment_id,)
        assert dict(adopted.documents) == {other.digest: OTHER}  # only intact copies
        with pytest.raises(DamagedDocumentsError) as raised:
            state.desired_documents()
        assert raised.value.damaged == (demo.deployment_id,)
        assert demo.deployment_id in str(raised.value) and "fetched again" in str(raised.value)
        state.adopt(desired("7", DEPLOYMENT, OTHER, manifest_version=7, etag='"e"'))  # refetched
        assert state.adopted().damaged == ()
        assert state.desired_documents() == [DEPLOYMENT, OTHER]


def test_an_accepted_history_rewrite_is_remembered_with_the_state(tmp_path: Path) -> None:
    commit = "ab" * 20
    with DeviceState(tmp_path / "s.sqlite") as state:
        state.adopt(DesiredState("git", commit, None, None, (), history_rewrite_accepted=commit))
        state.adopt(DesiredState("git", "cd" * 20, None, None, ()))  # later states keep it
    with DeviceState(tmp_path / "s.sqlite") as state:
        assert state.adopted().history_rewrite_accepted == commit


def test_foreign_and_newer_files_are_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="not a margo-gitops device state"):
        DeviceState(foreign)

    newer = tmp_path / "newer.sqlite"
    DeviceState(newer).close()
    conn = sqlite3.connect(newer)
    conn.execute("PRAGMA user_version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="newer"):
        DeviceState(newer)


_WRITER = """
import sys
from pathlib import Path
from margo.digests import digest_of
from reconciler.desired import DesiredDeployment, DesiredState
from reconciler.state import DeviceState

def deployment(name, i):
    data = f"{name} v{i}".encode()
    return DesiredDeployment(name, name, "ns", None, "app", "compose", (), digest_of(data), data)

with DeviceState(Path(sys.argv[1])) as state:
    i = 0
    while True:
        s = "installing" if i % 2 == 0 else "installed"
        state.record("d1", {"web": (s, None), "db": (s, None)},
                     lambda components: {"i": i, "states": {n: s for n, s, _ in components}},
                     path="/status")
        state.adopt(DesiredState("git", f"v{i}", None, None,
                                 (deployment("a", i), deployment("b", i))))
        print(i, flush=True)
        i += 1
"""


def test_sigkill_while_recording_leaves_a_consistent_database(tmp_path: Path) -> None:
    path = tmp_path / "device.sqlite"
    process = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    acknowledged = -1
    try:
        while acknowledged < 40:
            line = process.stdout.readline()
            assert line, "the writer stopped early"
            acknowledged = int(line)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        for line in process.stdout.read().split():  # printed before the kill, not yet read
            acknowledged = int(line)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL

    with DeviceState(path) as state:
        bodies = [json.loads(e.body) for e in state.pending(10_000)]
        numbers = [b["i"] for b in bodies]
        assert numbers == list(range(len(numbers)))  # no gap, no duplicate
        last = numbers[-1]
        assert acknowledged <= last <= acknowledged + 1  # nothing acknowledged was lost
        stored = {n: r.state for n, r in state.component_states("d1").items()}
        assert stored == bodies[-1]["states"]  # the state and its report were one write
        version = state.adopted().version
        assert version is not None
        k = int(version[1:])
        assert last - 1 <= k <= last
        assert sorted(state.desired_documents()) == [f"a v{k}".encode(), f"b v{k}".encode()]


# --- delivery to the real fleet server ------------------------------------------------------


class Fleet:
    """`margo serve` with the example fleet and one client; can be stopped and restarted on
    the same data (a new port each time)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.copytree(ROOT / "examples" / "fleet", root / "fleet")
        self.data = root / "data"
        self.client_id = "site-a"
        self.token = add_client(self.data, self.client_id)
        self._stack: ExitStack | None = None
        self.base = ""

    def start(self) -> None:
        stack = ExitStack()
        self.base = stack.enter_context(running_server(self.data, "--source",
                                                       str(self.root / "fleet")))
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def client(self, token: str | None = None, base: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=base or self.base, timeout=10,
                            headers={"Authorization": f"Bearer {token or self.token}"})

    def device(self, device_id: str) -> tuple[DesiredDeployment, int]:
        """Report a Compose box's capabilities; wait for its deployment; return it parsed,
        with the manifestVersion that lists it."""
        doc = json.loads((ROOT / "examples" / "capabilities" / "compose-box-amd64.json")
                         .read_text())
        doc["properties"]["id"] = device_id
        with self.client() as http:
            assert http.put(f"/api/v1/capabilities/{device_id}", json=doc).status_code == 201
            def assigned() -> tuple[DesiredDeployment, int] | None:
                manifest = http.get("/api/v1/deployments").json()
                for ref in manifest["deployments"]:
                    deployment = parse_deployment(http.get(ref["url"]).content)
                    if deployment.device_id == device_id:
                        return deployment, int(manifest["manifestVersion"])
                return None

            return poll_until(f"a deployment for {device_id}", assigned, timeout=20)

    def history(self, deployment_id: str) -> list[dict[str, Any]]:
        """The status reports the server stored for a deployment, in arrival order."""
        conn = sqlite3.connect(f"file:{self.data / 'wfm.sqlite'}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT document FROM status_reports WHERE deployment_id = ? "
                                "ORDER BY id", (deployment_id,)).fetchall()
        finally:
            conn.close()
        return [json.loads(r[0]) for r in rows]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    handle = Fleet(tmp_path_factory.mktemp("fleet"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


def test_transitions_are_delivered_in_order(fleet: Fleet, tmp_path: Path) -> None:
    deployment, version = fleet.device("box-journal")
    name = deployment.components[0].name
    path = status_path("rc.3", deployment_id=deployment.deployment_id, device_id=None,
                       client_id=None)
    build = builder(deployment, adopted=version)
    transitions = [("pending", None), ("installing", None),
                   ("failed", ("PULL_FAILED", "registry unreachable")), ("installing", None),
                   ("installed", None)]
    with DeviceState(tmp_path / "device.sqlite") as state:
        for transition in transitions:
            assert state.record(deployment.deployment_id, {name: transition}, build, path=path)
        assert not state.record(deployment.deployment_id, {name: ("installed", None)}, build,
                                path=path)
        sent = [json.loads(e.body) for e in state.pending()]
        with fleet.client() as http:
            result = Reporter(http, state).deliver()
        assert (result.delivered, result.dead_lettered, result.remaining, result.stopped) == (
            5, 0, 0, "empty")
        assert result.last is not None and result.last.status == 200
    history = fleet.history(deployment.deployment_id)
    assert history == sent
    assert [h["status"]["state"] for h in history] == [t[0] for t in transitions]
    assert history[2]["status"]["error"] == {"code": "PULL_FAILED", "source": deployment.name,
                                             "message": "registry unreachable"}
    assert history[2]["components"][0]["error"]["source"] == name


def test_nothing_is_lost_while_the_server_is_down(fleet: Fleet, tmp_path: Path) -> None:
    deployment, version = fleet.device("box-outage")
    name = deployment.components[0].name
    path = status_path("rc.3", deployment_id=deployment.deployment_id, device_id=None,
                       client_id=None)
    build = builder(deployment, adopted=version)
    now = 10_000.0
    state_path = tmp_path / "device.sqlite"
    with DeviceState(state_path) as state:
        state.record(deployment.deployment_id, {name: ("pending", None)}, build, path=path)
        state.record(deployment.deployment_id, {name: ("installing", None)}, build, path=path)
        old_base = fleet.base
        fleet.stop()
        try:
            with fleet.client(base=old_base) as http:
                down = Reporter(http, state, clock=lambda: now).deliver()
                assert (down.stopped, down.delivered, down.remaining) == ("retry", 0, 2)
                assert down.last is not None and down.last.kind == "retry"
                [first, _] = state.pending()
                assert first.attempts == 1 and first.not_before > now
                state.record(deployment.deployment_id, {name: ("installed", None)}, build,
                             path=path)
                waiting = Reporter(http, state, clock=lambda: now).deliver()
                assert waiting.stopped == "waiting" and waiting.next_attempt == first.not_before
                assert state.pending()[0].attempts == 1  # not attempted again
        finally:
            fleet.start()
    with DeviceState(state_path) as state:  # the device restarted too
        assert state.journal_size() == 3
        with fleet.client() as http:
            result = Reporter(http, state, clock=lambda: now + 600).deliver()
        assert (result.delivered, result.stopped) == (3, "empty")
    assert [h["status"]["state"] for h in fleet.history(deployment.deployment_id)] == [
        "pending", "installing", "installed"]


def test_a_poison_entry_is_dead_lettered_and_the_queue_continues(fleet: Fleet,
                                                                 tmp_path: Path) -> None:
    deployment, version = fleet.device("box-poison")
    name = deployment.components[0].name
    ghost = "00000000-0000-4000-8000-000000000000"
    with DeviceState(tmp_path / "device.sqlite") as state:
        state.record(ghost, {name: ("installed", None)},
                     lambda records: status_body(
                         "rc.3", deployment_id=ghost, device_id=None, adopted_version=version,
                         components=[(name, "installed", None)], deployment_name="ghost"),
                     path=status_path("rc.3", deployment_id=ghost, device_id=None,
                                      client_id=None))
        state.record(deployment.deployment_id, {name: ("installed", None)},
                     builder(deployment, adopted=version),
                     path=status_path("rc.3", deployment_id=deployment.deployment_id,
                                      device_id=None, client_id=None))
        with fleet.client() as http:
            result = Reporter(http, state).deliver()
        assert (result.delivered, result.dead_lettered, result.stopped) == (1, 1, "empty")
        [dead] = state.dead_letters()
        assert dead.deployment_id == ghost
        assert dead.reason.startswith("HTTP 422: ") and "never assigned" in dead.reason
    assert len(fleet.history(deployment.deployment_id)) == 1


def test_bad_credentials_stop_delivery_without_dead_letters(fleet: Fleet,
                                                            tmp_path: Path) -> None:
    deployment, version = fleet.device("box-creds")
    with DeviceState(tmp_path / "device.sqlite") as state:
        state.record(deployment.deployment_id,
                     {deployment.components[0].name: ("installed", None)},
                     builder(deployment, adopted=version),
                     path=status_path("rc.3", deployment_id=deployment.deployment_id,
                                      device_id=None, client_id=None))
        with fleet.client(token="wrong-token") as http:
            result = Reporter(http, state).deliver()
        assert (result.stopped, result.remaining, result.dead_lettered) == ("unauthorized", 1, 0)
        assert result.last is not None and result.last.status == 401
        assert state.dead_letters() == [] and state.pending()[0].attempts == 0


@pytest.mark.parametrize(("generation", "expected_status"),
                         [("rc.3", 200), ("rc.2", 200), ("oct-2024", 201)])
def test_every_generation_is_accepted_by_the_server(fleet: Fleet, tmp_path: Path,
                                                    generation: str,
                                                    expected_status: int) -> None:
    device_id = f"box-{generation.replace('.', '')}"
    deployment, version = fleet.device(device_id)
    name = deployment.components[0].name
    path = status_path(generation, deployment_id=deployment.deployment_id, device_id=device_id,
                       client_id=fleet.client_id)
    build = builder(deployment, generation=generation, adopted=version, device_id=device_id)
    with DeviceState(tmp_path / "device.sqlite") as state:
        for transition in [("installing", None), ("failed", ("TIMEOUT", "not ready in 5m0s"))]:
            state.record(deployment.deployment_id, {name: transition}, build, path=path)
        bodies = [json.loads(e.body) for e in state.pending()]
        for body in bodies:
            model = validate_value(body, expect=Kind.DEPLOYMENT_STATUS)
            assert model.shape == Shape(generation)
        with fleet.client() as http:
            result = Reporter(http, state).deliver()
        assert (result.delivered, result.stopped) == (2, "empty")
        assert result.last is not None and result.last.status == expected_status
    history = fleet.history(deployment.deployment_id)
    assert history == bodies
    if generation == "oct-2024":
        assert history[-1]["status"]["state"] == "Failed"


# --- Retry-After and backoff, observed on a tiny scripted server ----------------------------


class Scripted:
    """A real HTTP server on loopback answering from a script of (status, headers, body);
    once the script is used up it answers 200. Records every request path."""

    def __init__(self, script: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.script = list(script)
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.requests.append(self.path)
                status, headers, body = (outer.script.pop(0) if outer.script
                                         else (200, {}, b""))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._serving = serving(Handler)

    @property
    def base(self) -> str:
        return url(self.server)

    def __enter__(self) -> Scripted:
        self.server = self._serving.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._serving.__exit__(*exc_info)


def problem(status: int, **fields: Any) -> bytes:
    return json.dumps({"type": "about:blank", "title": "t", "status": status, **fields}).encode()


PROBLEM = {"Content-Type": "application/problem+json"}


def journal(state: DeviceState, count: int) -> None:
    for n in range(count):
        state.record(f"d{n}", {"c": ("installed", None)}, lambda r: {"ok": True}, path=f"/s{n}")


def test_a_503_retry_after_is_honoured(tmp_path: Path) -> None:
    clock = [1000.0]
    script = [(503, {**PROBLEM, "Retry-After": "7"},
               problem(503, retryable=True, backoffStrategy="exponential"))]
    with Scripted(script) as server, httpx.Client(base_url=server.base) as http, \
            DeviceState(tmp_path / "s.sqlite") as state:
        journal(state, 2)
        reporter = Reporter(http, state, clock=lambda: clock[0])
        first = reporter.deliver()
        assert (first.stopped, first.next_attempt, first.delivered) == ("retry", 1007.0, 0)
        assert state.pending()[0].attempts == 1 and server.requests == ["/s0"]
        assert reporter.deliver().stopped == "waiting"
        assert server.requests == ["/s0"]  # deferred: not sent before its time
        clock[0] = 1007.0
        done = reporter.deliver()
        assert (done.delivered, done.stopped) == (2, "empty")
        assert server.requests == ["/s0", "/s0", "/s1"]  # strictly in order


def test_retry_after_as_an_http_date_and_a_problem_that_forbids_retrying(tmp_path: Path) -> None:
    when = email.utils.formatdate(1030, usegmt=True)
    script = [(429, {"Retry-After": when}, b""),
              (503, PROBLEM, problem(503, retryable=False, detail="gone for good"))]
    with Scripted(script) as server, httpx.Client(base_url=server.base) as http, \
            DeviceState(tmp_path / "s.sqlite") as state:
        journal(state, 2)
        reporter = Reporter(http, state, clock=lambda: 1000.0)
        assert reporter.deliver().next_attempt == 1030.0
        after = Reporter(http, state, clock=lambda: 1030.0).deliver()
        assert (after.dead_lettered, after.delivered, after.stopped) == (1, 1, "empty")
        assert state.dead_letters()[0].reason == "HTTP 503: gone for good"


def test_backoff_without_retry_after_grows_and_is_capped(tmp_path: Path) -> None:
    rng = random.Random(7)
    script = [(500, {}, b"oops"), (500, {}, b"oops"), (502, {}, b"")]
    with Scripted(script) as server, httpx.Client(base_url=server.base) as http, \
            DeviceState(tmp_path / "s.sqlite") as state:
        journal(state, 1)
        now = 0.0
        delays = []
        for _ in range(3):
            result = Reporter(http, state, clock=lambda at=now: at, rng=rng).deliver()
            assert result.stopped == "retry" and result.next_attempt is not None
            delays.append(result.next_attempt - now)
            now = result.next_attempt
        assert 0.5 <= delays[0] <= 1 and 1 <= delays[1] <= 2 and 2 <= delays[2] <= 4
        assert state.pending()[0].attempts == 3
    exponential = Outcome("retry", 503, backoff="exponential")
    assert all(150 <= backoff_delay(exponential, 40, rng) <= 300 for _ in range(20))
    assert backoff_delay(Outcome("retry", 503, backoff="none"), 5, rng) == 0
    assert 2.5 <= backoff_delay(Outcome("retry", 503, backoff="fixed"), 9, rng) <= 5


def test_resume_makes_backed_off_reports_due_but_keeps_a_delay_the_server_asked_for(
        tmp_path: Path) -> None:
    """When another request reached the server (a poll), queued reports need not wait out
    a backoff that grew during the outage; a Retry-After is the server's request and holds.
    """
    clock = [1000.0]
    rng = random.Random(3)
    script = [(500, {}, b"down")] * 6
    with Scripted(script) as server, httpx.Client(base_url=server.base) as http, \
            DeviceState(tmp_path / "s.sqlite") as state:
        journal(state, 2)
        reporter = Reporter(http, state, clock=lambda: clock[0], rng=rng)
        retry_at = clock[0]
        for _ in range(6):  # the outage: six failed attempts, each once the last one is due
            clock[0] = retry_at
            result = reporter.deliver()
            assert result.stopped == "retry" and result.next_attempt is not None
            retry_at = result.next_attempt
        assert retry_at - clock[0] >= 16  # the backoff has grown to 16-32 s
        assert reporter.deliver().stopped == "waiting"
        assert reporter.resume() == 1  # the server answered a poll
        [head, _] = state.pending()
        assert (head.attempts, head.not_before) == (0, 0)
        done = reporter.deliver()
        assert (done.delivered, done.stopped) == (2, "empty")
        assert reporter.resume() == 0  # nothing deferred: nothing written

    script = [(429, {"Retry-After": "120"}, b"")]
    with Scripted(script) as server, httpx.Client(base_url=server.base) as http, \
            DeviceState(tmp_path / "t.sqlite") as state:
        journal(state, 1)
        reporter = Reporter(http, state, clock=lambda: clock[0])
        assert reporter.deliver().next_attempt == clock[0] + 120
        reporter.resume()
        assert state.pending()[0].not_before == clock[0] + 120  # the server's own delay
        clock[0] += 120
        reporter.resume()
        assert reporter.deliver().stopped == "empty"


def test_unreachable_server_budget_and_retry_after_parsing(tmp_path: Path) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{free_port()}", timeout=2) as http, \
            DeviceState(tmp_path / "s.sqlite") as state:
        journal(state, 1)
        assert Reporter(http, state).deliver(budget_seconds=0).stopped == "budget"
        assert state.pending()[0].attempts == 0  # the budget was spent before sending
        result = Reporter(http, state).deliver()
        assert result.stopped == "retry" and result.last is not None
        assert result.last.status is None and "ConnectError" in result.last.detail
    assert parse_retry_after("120", 0) == 120
    assert parse_retry_after("soon", 0) is None and parse_retry_after(None, 0) is None
    assert parse_retry_after(email.utils.formatdate(50, usegmt=True), 100) == 0
    assert parse_retry_after("99999999999", 0) == 24 * 3600
