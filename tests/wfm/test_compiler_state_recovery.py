"""The server compiles on through a damaged compiler state (issue 15: "a corrupt
compiler-state.sqlite blocks every compile until deleted"): garbage written into it while
the server is stopped, or while it runs between compiles, is set aside and the state
rebuilt, and devices get what the source says. Damage found only in the middle of a
compile (a page the opening check did not read) makes `CompileService` set the file aside
and compile again in full."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from kits.damagekit import damage_table
from kits.fleetkit import Fleet, app, device, intent
from kits.serverkit import add_client, running_server

from compiler.snapshot import snapshot_from_documents
from tools.polling import poll_until
from wfm.fleet.compiles import CompileService, SourceConfig


def _aside(repos: Path) -> list[Path]:
    return sorted(repos.glob("compiler-state.sqlite.corrupt-*"))


def test_damage_found_in_the_middle_of_a_compile_is_set_aside_and_compiled_again(
        tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web")
    for index in range(5):
        fleet.devices[f"edge-{index}"] = device(f"edge-{index}")
    fleet.write()
    repos = tmp_path / "repos"
    service = CompileService(
        repos, SourceConfig(fleet.source),
        lambda trusted: snapshot_from_documents(dict(fleet.devices), trusted=trusted),
        lambda report: None, debounce=0)
    try:
        service.trigger()
        assert service.wait_idle() and service.compiles == 1 and service.last_error is None
        # This process checked the file whole at its first open; later opens do not.
        damage_table(repos / "compiler-state.sqlite", "devices")
        fleet.intents["other"] = intent("other")
        fleet.write()
        service.trigger()
        assert service.wait_idle()
        assert service.compiles == 2 and service.last_error is None
        assert service.last_report is not None and service.last_report.commits == 5
        assert len(_aside(repos)) == 1
    finally:
        service.stop()


def _deployments(http: httpx.Client) -> list[str]:
    manifest = http.get("/api/v1/deployments").json()
    return sorted(d["deploymentId"] for d in manifest["deployments"])


def test_a_server_compiles_through_garbage_in_its_compiler_state(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / "fleet")
    fleet.apps["com-example-app"] = app()
    fleet.intents["web"] = intent("web", profile={"type": "compose"})
    fleet.devices["box"] = device("box", types=("compose",))
    fleet.write()
    data = tmp_path / "data"
    token = add_client(data, "plant")
    state = data / "repos" / "compiler-state.sqlite"
    headers = {"Authorization": f"Bearer {token}"}
    with running_server(data, "--source", str(fleet.source)) as base, \
            httpx.Client(base_url=base, timeout=10, headers=headers) as http:
        assert http.put("/api/v1/capabilities/box", json=fleet.devices["box"]).status_code \
            == 201
        poll_until("the first deployment", lambda: len(_deployments(http)) == 1, timeout=30,
                   interval=0.2)

    state.write_bytes(os.urandom(30_000))  # while the server is stopped
    fleet.intents["second"] = intent("second", profile={"type": "compose"})
    fleet.write()
    with running_server(data, "--source", str(fleet.source), "--watch-source") as base, \
            httpx.Client(base_url=base, timeout=10, headers=headers) as http:
        poll_until("the second deployment", lambda: len(_deployments(http)) == 2,
                   timeout=30, interval=0.2)
        assert len(_aside(data / "repos")) == 1

        state.write_bytes(os.urandom(30_000))  # while it runs, between two compiles
        fleet.intents["third"] = intent("third", profile={"type": "compose"})
        fleet.write()
        poll_until("the third deployment", lambda: len(_deployments(http)) == 3,
                   timeout=30, interval=0.2)
        assert len(_aside(data / "repos")) == 2
