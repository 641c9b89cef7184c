"""A device branch lost from the server's repository is lost state, never "nothing to
deploy": `margo serve` answers 503 for that device (REST manifest and Git alike) while the
other devices are served as before, and a compile rebuilds the branch from the source
without the manifestVersion moving through an empty state."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kits.serverkit import ROOT, add_client, running_server

from compiler.gitstore import REPOSITORY_NAME, device_ref
from tools.polling import poll_until

CAPS = ROOT / "examples" / "capabilities"


def box(device_id: str, site: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CAPS / "compose-box-amd64.json").read_text())
    doc["properties"]["id"] = device_id
    doc["labels"]["example.com/site"] = site
    return doc


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    shutil.copytree(ROOT / "examples" / "fleet", tmp_path / "fleet")
    data = tmp_path / "data"
    tokens = {name: add_client(data, name) for name in ("lost", "kept", "other")}
    with running_server(data, "--source", str(tmp_path / "fleet")) as base:
        yield {"base": base, "tokens": tokens, "data": data, "source": tmp_path / "fleet",
               "repo": data / "repos" / REPOSITORY_NAME}


def http(fleet: dict[str, Any], name: str) -> httpx.Client:
    return httpx.Client(base_url=fleet["base"], timeout=10,
                        headers={"Authorization": f"Bearer {fleet['tokens'][name]}"})


def manifest_with_deployments(client: httpx.Client) -> dict[str, Any]:
    found: list[dict[str, Any]] = [{}]

    def ready() -> bool:
        response = client.get("/api/v1/deployments")
        found[0] = response.json() if response.status_code == 200 else {}
        return bool(found[0].get("deployments"))

    poll_until("deployments", ready, timeout=30, interval=0.2)
    return found[0]


def drop_ref(repo: Path, ref: str) -> None:
    """Lose a ref the way a damaged repository does: its line gone from `packed-refs`, its
    loose file (if any) gone too."""
    packed = repo / "packed-refs"
    lines = packed.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip("\n").endswith(" " + ref)]
    # (a peeled line "^<id>" follows only annotated tags, which the store never writes)
    packed.write_text("".join(kept))
    (repo / ref).unlink(missing_ok=True)


def info_refs(fleet: dict[str, Any], name: str, device_id: str) -> httpx.Response:
    return httpx.get(f"{fleet['base']}/git/devices/{device_id}.git/info/refs",
                     params={"service": "git-upload-pack"},
                     auth=(name, fleet["tokens"][name]), timeout=10)


def test_a_lost_branch_is_503_until_a_compile_rebuilds_it(fleet: dict[str, Any]) -> None:
    with http(fleet, "lost") as lost, http(fleet, "kept") as kept, \
            http(fleet, "other") as other:
        assert lost.put("/api/v1/capabilities/box-lost", json=box("box-lost", "a")
                        ).status_code == 201
        assert kept.put("/api/v1/capabilities/box-kept", json=box("box-kept", "b")
                        ).status_code == 201
        before = manifest_with_deployments(lost)
        kept_before = manifest_with_deployments(kept)
        assert info_refs(fleet, "lost", "box-lost").status_code == 200

        # The source cannot be read for now, so no compile repairs anything behind our back.
        hidden = fleet["source"].with_name("fleet-away")
        fleet["source"].rename(hidden)
        drop_ref(fleet["repo"], device_ref("box-lost"))

        # Git reads the ref on every request: refused at once, never an empty repository.
        refs = info_refs(fleet, "lost", "box-lost")
        assert refs.status_code == 503, refs.text
        assert refs.headers["retry-after"]
        assert "missing" in refs.json()["detail"]

        # A new device moves the fleet's generation: every manifest is computed again.
        assert other.put("/api/v1/capabilities/box-other", json=box("box-other", "c")
                         ).status_code == 201
        poll_until("the generation to move", lambda: lost.get(
            "/api/v1/deployments").status_code != 200, timeout=10, interval=0.1)
        response = lost.get("/api/v1/deployments")
        assert response.status_code == 503, response.text
        assert response.headers["content-type"] == "application/problem+json"
        assert int(response.headers["retry-after"]) > 0
        assert "box-lost" in response.json()["detail"]
        assert "repair" in response.json()["detail"]
        assert kept.get("/api/v1/deployments").json() == kept_before
        assert info_refs(fleet, "kept", "box-kept").status_code == 200

        # The source is back; a compile (here: another device's change) rebuilds the branch.
        hidden.rename(fleet["source"])
        assert other.put("/api/v1/capabilities/box-other", json=box("box-other", "d")
                         ).status_code == 200
        after = manifest_with_deployments(lost)
        assert after == before  # same deployments, same manifestVersion: nothing moved
        assert info_refs(fleet, "lost", "box-lost").status_code == 200


def test_an_emptied_packed_refs_is_503_for_every_device(fleet: dict[str, Any]) -> None:
    with http(fleet, "lost") as lost, http(fleet, "kept") as kept:
        lost.put("/api/v1/capabilities/box-lost", json=box("box-lost", "a"))
        before = manifest_with_deployments(lost)
        fleet["source"].rename(fleet["source"].with_name("fleet-away"))
        (fleet["repo"] / "packed-refs").write_text("")
        for loose in (fleet["repo"] / "refs" / "heads").rglob("*"):
            if loose.is_file():
                loose.unlink()
        assert info_refs(fleet, "lost", "box-lost").status_code == 503
        doc = copy.deepcopy(box("box-kept", "b"))
        assert kept.put("/api/v1/capabilities/box-kept", json=doc).status_code == 201
        poll_until("the generation to move", lambda: lost.get(
            "/api/v1/deployments").status_code == 503, timeout=10, interval=0.1)
        # Never an empty manifest with a higher version while the state is lost.
        assert lost.get("/api/v1/deployments").status_code == 503
        fleet["source"].with_name("fleet-away").rename(fleet["source"])
        kept.put("/api/v1/capabilities/box-kept", json=box("box-kept", "c"))
        assert manifest_with_deployments(lost) == before


def test_views_for_people_and_rollouts_never_stop_the_rebuilding_compile(
        tmp_path: Path) -> None:
    """What devices are served raises `StateLost` (a 503); what people's views and the
    rollout controller (which runs before every compile) read is empty instead, so the
    compile that rebuilds the branch is never kept from running."""
    from kits.fleetkit import Fleet, app, device, intent

    from compiler.gitstore import DeviceStore
    from wfm.fleet.desired import DesiredState, StateLost

    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["everywhere"] = intent("everywhere")
    fleet.devices["d1"] = device("d1")
    fleet.devices["d2"] = device("d2")
    fleet.compile()
    desired = DesiredState(DeviceStore(fleet.repos))
    assert desired.device_deployments("d1")
    drop_ref(fleet.repos / REPOSITORY_NAME, device_ref("d1"))
    desired.bump()
    with pytest.raises(StateLost) as lost:
        desired.client_state("c1", ("d1",))
    assert lost.value.status == 503 and lost.value.retry_after
    assert desired.client_state("c2", ("d2",)).deployments
    assert desired.device_deployments("d1") == []
    fleet.compile()
    desired.bump()
    assert desired.client_state("c1", ("d1",)).deployments


def test_a_branch_naming_a_missing_commit_is_lost_state_too(tmp_path: Path) -> None:
    from kits.fleetkit import Fleet, app, device, intent

    from compiler.gitstore import DeviceStore
    from wfm.fleet.desired import DesiredState, StateLost

    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["everywhere"] = intent("everywhere")
    fleet.devices["d1"] = device("d1")
    fleet.compile()
    repo = fleet.repos / REPOSITORY_NAME
    ref = device_ref("d1")
    drop_ref(repo, ref)
    (repo / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / ref).write_text("1" * 40 + "\n")  # a ref whose commit is not stored
    with pytest.raises(StateLost) as lost:
        DesiredState(DeviceStore(fleet.repos)).client_state("c1", ("d1",))
    assert "cannot be read" in lost.value.detail


def test_a_branch_that_appears_while_it_is_looked_for_is_served_not_lost(
        tmp_path: Path) -> None:
    """A device's first compile: the server reads no branch, the compile moves the branches
    and commits its state, then the server reads the state (which now names a branch). That
    is not lost state: the branch is read again and served. (The compile is made to land in
    that window by the `recorded` callable, which the server asks after missing the branch;
    the newest conformance suite's first manifest once met a 503 there.)"""
    from kits.fleetkit import Fleet, app, device, intent

    from compiler.gitstore import DeviceStore
    from compiler.recorded import recorded_branch
    from wfm.fleet.desired import DesiredState

    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["everywhere"] = intent("everywhere")
    fleet.devices["d1"] = device("d1")

    def compiled_meanwhile(device_id: str) -> str | None:
        fleet.compile()
        return recorded_branch(fleet.repos, device_id)

    (fleet.repos).mkdir(parents=True, exist_ok=True)
    desired = DesiredState(DeviceStore(fleet.repos), recorded=compiled_meanwhile)
    state = desired.client_state("c1", ("d1",))
    assert [d.intent for d in state.deployments] == ["everywhere"]
    assert desired.missing_branch("d1") is None
