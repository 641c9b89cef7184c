"""One device whose id no branch can be named for must not stop the compile of the others.

Ids like these were accepted by the fleet server before ids were bounded where they enter
(issue 15): 1,005 characters, or 340 ``~`` (each written ``%7E`` in the branch name, which
libgit2 then cannot look up). They may still be in a database; every compile reads them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from kits.fleetkit import Fleet, app, device, intent

from compiler.compilation import compile_fleet
from compiler.gitstore import DeviceStore
from compiler.snapshot import (
    Device,
    Snapshot,
    TrustedDigests,
    load_snapshot,
    snapshot_from_documents,
)
from compiler.source import load_source
from compiler.state import CompilerState
from margo.digests import data_digest
from margo.models import DeviceCapabilities
from margo.validation import validate_value

LONG = "a" * 1005
TILDES = "~" * 340
#: 84 '~' are only 84 characters, but 252 in the branch name: one past the bound.
ENCODED_TOO_LONG = "~" * 84


def _fleet(tmp_path: Path) -> Fleet:
    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["everywhere"] = intent("everywhere", namespace="demo")
    fleet.write()
    (tmp_path / "repos").mkdir()
    return fleet


def _compile(fleet: Fleet, snapshot: Snapshot) -> tuple[object, DeviceStore]:
    store = DeviceStore(fleet.repos)
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        return compile_fleet(load_source(fleet.source), snapshot, store, state), store
    finally:
        state.close()


def test_stored_ids_without_a_branch_are_located_problems_and_the_rest_compiles(
        tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    documents = {d: device(d) for d in ("edge-1", LONG, TILDES, ENCODED_TOO_LONG, "edge-2")}
    snapshot = snapshot_from_documents(documents)
    assert sorted(snapshot.devices) == ["edge-1", "edge-2"]
    assert snapshot.broken == {LONG, TILDES, ENCODED_TOO_LONG}
    assert [p.path for p in snapshot.problems] == [("properties", "id")] * 3
    assert all(len(p.message) < 300 for p in snapshot.problems)  # the id is shortened
    report, store = _compile(fleet, snapshot)
    assert report.commits == 2  # type: ignore[attr-defined]
    assert store.device_ids() == ["edge-1", "edge-2"]
    assert "everywhere.yaml" in (store.read_files("edge-1") or {})
    # The store answers "no branch" for such ids instead of raising (the server's read API
    # and dashboard ask it about every stored device).
    for bad in (LONG, TILDES, ENCODED_TOO_LONG):
        assert store.tree(bad) is None and store.tree_ids(bad) is None
        assert store.history(bad) == [] and store.branch_target(bad) is None


def test_a_snapshot_built_by_hand_with_such_an_id_reports_that_device_only(
        tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    devices = {}
    for device_id in ("edge-1", TILDES):
        doc = device(device_id)
        caps: DeviceCapabilities = validate_value(doc)
        devices[device_id] = Device(device_id, caps, data_digest(doc))
    report, store = _compile(fleet, Snapshot(devices=devices))
    errors = report.errors  # type: ignore[attr-defined]
    assert [device_id for device_id, _ in errors] == [TILDES]
    assert errors[0][1].path == ("properties", "id")
    assert "gets no desired state" in errors[0][1].message
    results = {r.device_id: r.status for r in report.results}  # type: ignore[attr-defined]
    assert results == {"edge-1": "committed", TILDES: "error"}
    assert store.device_ids() == ["edge-1"]


def test_a_keyed_snapshot_the_state_trusts_is_still_checked_for_ids(tmp_path: Path) -> None:
    """The fast paths for a keyed file the last compile read (memo, trusted digests) skip
    validation, not the id check: an id trusted by an older compiler is refused too."""
    fleet = _fleet(tmp_path)
    keyed = tmp_path / "snapshot.json"
    documents = {d: device(d) for d in ("edge-1", "x" * 300)}
    keyed.write_text(json.dumps(documents))
    first = load_snapshot(keyed)
    assert sorted(first.devices) == ["edge-1"] and first.memo is not None
    # What an older compiler (no bound on ids) recorded: every key read, digested, trusted.
    digests = {d: data_digest(doc) for d, doc in documents.items()}
    older = dataclasses.replace(first.memo, digests=digests)
    for memo in (older, dataclasses.replace(older, spans={})):  # with and without spans
        again = load_snapshot(keyed, trusted=TrustedDigests(digests, memo=memo))
        assert sorted(again.devices) == ["edge-1"] and again.broken == {"x" * 300}
    report, _ = _compile(fleet, again)
    assert report.commits == 1  # type: ignore[attr-defined]


def test_whatever_one_device_trips_over_is_its_own_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Something unforeseen in one device's compile (here its branch cannot be read, as
    happened with the ids above) is that device's error; the others are committed."""
    fleet = _fleet(tmp_path)
    snapshot = snapshot_from_documents({d: device(d) for d in ("edge-1", "edge-2", "edge-3")})
    _compile(fleet, snapshot)  # every device has a branch now
    fleet.intents["everywhere"] = intent("everywhere", namespace="changed")
    fleet.write()
    real_tree = DeviceStore.tree

    def tree(self: DeviceStore, device_id: str) -> object:
        if device_id == "edge-2":
            raise ValueError("the provided buffer is too short to hold the normalization")
        return real_tree(self, device_id)

    monkeypatch.setattr(DeviceStore, "tree", tree)
    monkeypatch.setattr(DeviceStore, "branch_target", lambda self, device_id: None)
    report, store = _compile(fleet, snapshot)
    results = {r.device_id: r.status for r in report.results}  # type: ignore[attr-defined]
    assert results == {"edge-1": "committed", "edge-2": "error", "edge-3": "committed"}
    [(device_id, problem)] = report.errors  # type: ignore[attr-defined]
    assert device_id == "edge-2" and "could not be compiled" in problem.message
    monkeypatch.undo()
    namespaces = {d: yaml.safe_load((store.read_files(d) or {})["everywhere.yaml"])
                  ["metadata"]["namespace"] for d in ("edge-1", "edge-2", "edge-3")}
    assert namespaces == {"edge-1": "changed", "edge-2": "demo", "edge-3": "changed"}
    again, _ = _compile(fleet, snapshot)  # and it is compiled once it can be
    assert {r.device_id: r.status for r in again.results} == {  # type: ignore[attr-defined]
        "edge-2": "committed"}
