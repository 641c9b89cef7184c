"""Reading a keyed capability snapshot again: the memo of its exact bytes, models built on
first use, and validation split over two processes. Each shortcut must give exactly what
reading from scratch gives, and must never apply to other bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fleetkit import Fleet, app, device, intent
from test_cluster_placement import cluster_device, node

import compiler.snapshot as snapshot_module
from compiler.snapshot import (
    Device,
    Snapshot,
    SnapshotError,
    SnapshotMemo,
    TrustedDigests,
    load_snapshot,
    memo_key,
)
from compiler.state import CompilerState
from margo.cluster import (
    cluster_manifest_from_capabilities,
    device_capabilities_from_cluster,
    is_cluster_manifest,
)
from margo.digests import data_digest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "capabilities"


def _documents(count: int = 6) -> dict[str, Any]:
    docs: dict[str, Any] = {f"d{i}": device(f"d{i}", labels={"site": f"s{i % 2}"})
                            for i in range(count)}
    docs["legacy-box-oct2024"] = json.loads((EXAMPLES / "legacy-box-oct2024.json").read_text())
    return docs


def _write(path: Path, docs: dict[str, Any], *, indent: int | None = None) -> bytes:
    data = json.dumps(docs, indent=indent).encode()
    path.write_bytes(data)
    return data


def _summary(snapshot: Snapshot) -> tuple[object, ...]:
    """Everything a compile takes from a snapshot, models included."""
    devices = {d: (dev.digest, dev.file, dev.capabilities, dict(dev.labels), dev.matching)
               for d, dev in snapshot.devices.items()}
    return (list(snapshot.devices), devices, [p.format() for p in snapshot.problems],
            sorted(snapshot.broken))


def _trusted(snapshot: Snapshot) -> TrustedDigests:
    """What the state hands back after compiling `snapshot` without errors."""
    return TrustedDigests({d: dev.digest for d, dev in snapshot.devices.items()}, snapshot.memo)


def test_the_memo_of_the_same_bytes_supplies_the_digests(tmp_path: Path) -> None:
    caps = tmp_path / "caps.json"
    data = _write(caps, _documents())
    first = load_snapshot(caps)
    assert first.memo == SnapshotMemo(memo_key(data),
                                      {d: dev.digest for d, dev in first.devices.items()})
    assert _summary(load_snapshot(caps, trusted=_trusted(first))) == _summary(first)
    # The digests really come from the memo: a forged one shows through for these bytes...
    forged = SnapshotMemo(memo_key(data), {**first.memo.digests, "d1": "sha256:forged"})
    assert load_snapshot(caps, trusted=TrustedDigests({}, forged)).devices["d1"].digest == (
        "sha256:forged")
    # ...and never for any other bytes, even of the same content.
    _write(caps, _documents(), indent=1)
    again = load_snapshot(caps, trusted=TrustedDigests({}, forged))
    assert again.devices["d1"].digest == data_digest(_documents()["d1"])
    assert again.memo is not None and again.memo.key != forged.key


def test_a_memo_of_other_bytes_never_vouches_for_a_changed_document(tmp_path: Path) -> None:
    caps = tmp_path / "caps.json"
    docs = _documents()
    _write(caps, docs)
    trusted = _trusted(load_snapshot(caps))
    docs["d2"]["properties"]["memory"] = "plenty"
    _write(caps, docs)
    snapshot = load_snapshot(caps, trusted=trusted)
    assert "d2" not in snapshot.devices and "d2" in snapshot.broken
    assert any("memory" in p.json_path for p in snapshot.problems)


def test_file_level_checks_still_run_for_new_bytes(tmp_path: Path) -> None:
    caps = tmp_path / "caps.json"
    _write(caps, _documents())
    trusted = _trusted(load_snapshot(caps))
    caps.write_text('{"d1": {"properties": {}}, "d1": {"properties": {}}}')
    with pytest.raises(SnapshotError, match="duplicate key"):
        load_snapshot(caps, trusted=trusted)


def test_the_state_keeps_the_memo_of_the_last_keyed_file(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.apps["com-example-app"] = app()
    fleet.intents["everywhere"] = intent("everywhere")
    fleet.devices = {d: doc for d, doc in _documents(3).items() if d.startswith("d")}
    fleet.compile(now=1_000)  # a directory snapshot: no memo
    state = CompilerState(fleet.repos / "compiler-state.sqlite")
    try:
        assert state.snapshot_memo() is None
        keyed = tmp_path / "caps.json"
        data = _write(keyed, fleet.devices)
        snapshot = load_snapshot(keyed, trusted=state.trusted_digests())
        assert snapshot.memo is not None and snapshot.memo.key == memo_key(data)
        state.save(intents=[], forget_intents=[], devices=[], placements=[], forget_devices=[],
                   snapshot=snapshot.memo)
        trusted = state.trusted_digests()
        assert trusted.memo == snapshot.memo
        assert dict(trusted) == {d: dev.digest for d, dev in snapshot.devices.items()}
        state.save(intents=[], forget_intents=[], devices=[], placements=[], forget_devices=[],
                   snapshot=None)
        assert state.snapshot_memo() is None
    finally:
        state.close()


def test_trusted_documents_build_their_models_on_first_use(tmp_path: Path) -> None:
    caps = tmp_path / "caps.json"
    docs = _documents()
    docs["cluster"] = cluster_manifest_from_capabilities(cluster_device("cluster", node("w1")))
    _write(caps, docs)
    eager = load_snapshot(caps)
    lazy = load_snapshot(caps, trusted=_trusted(eager))
    for device_id, model in eager.devices.items():
        deferred = lazy.devices[device_id]
        assert deferred._capabilities is None, device_id
        assert deferred.labels == model.labels  # read from the document, before the model
        assert deferred == model
        assert deferred.capabilities is deferred.capabilities  # built once, then kept
    assert repr(lazy.devices["d1"]) == f"Device('d1', digest={eager.devices['d1'].digest!r}, " \
                                       f"file={str(caps)!r})"
    with pytest.raises(ValueError, match="capabilities or its validated document"):
        Device("x", None, "sha256:0")


@pytest.mark.parametrize("path", sorted(EXAMPLES.iterdir()), ids=lambda p: p.name)
def test_labels_from_the_document_are_the_models_labels(path: Path) -> None:
    """What a lazy `Device` answers before normalising is what normalising gives."""
    doc = json.loads(path.read_text())
    if is_cluster_manifest(doc):
        doc = device_capabilities_from_cluster(doc)
    [model] = [d for d in load_snapshot(EXAMPLES).devices.values() if d.file == str(path)]
    assert snapshot_module._document_labels(doc) == model.capabilities.labels


def test_validation_in_two_processes_gives_what_one_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _documents(12)
    docs["d3"]["properties"]["memory"] = "plenty"  # invalid
    docs["d5"]["properties"]["id"] = "someone-else"  # filed under another id
    docs["d9"] = cluster_manifest_from_capabilities(cluster_device("d9"))  # the parent's
    docs["d10"] = {"properties": "not a mapping"}
    trusted = {"d0": data_digest(docs["d0"]), "d7": data_digest(docs["d7"]),
               "legacy-box-oct2024": data_digest(docs["legacy-box-oct2024"])}
    docs["d7"]["properties"]["cpus"] = "many"  # trusted before, invalid now (child's half)
    caps = tmp_path / "caps.json"
    _write(caps, docs)
    monkeypatch.setattr(snapshot_module, "PARALLEL_VALIDATION", 10**9)
    one = load_snapshot(caps, trusted=trusted)
    monkeypatch.setattr(snapshot_module, "PARALLEL_VALIDATION", 2)
    two = load_snapshot(caps, trusted=trusted)
    assert _summary(two) == _summary(one)
    assert {"d3", "d5", "d7", "d10"} <= two.broken and "d9" in two.devices
    assert two.memo == one.memo
    # With a memo of these bytes the digests are known: one process suffices.
    again = load_snapshot(caps, trusted=TrustedDigests(trusted, two.memo))
    assert _summary(again) == _summary(one)
