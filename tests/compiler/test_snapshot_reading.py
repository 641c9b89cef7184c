"""Reading a keyed capability snapshot again: the memo of its exact bytes, models built on
first use, and validation split over two processes. Each shortcut must give exactly what
reading from scratch gives, and must never apply to other bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from kits.fleetkit import Fleet, app, device, intent
from test_cluster_placement import cluster_device, node

import compiler.snapshot as snapshot_module
import compiler.snapshotdevice as snapshotdevice
from compiler.jsonspans import member_spans
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
    assert first.memo is not None and first.memo.key == memo_key(data)
    assert first.memo.digests == {d: dev.digest for d, dev in first.devices.items()}
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


def test_a_wholly_trusted_json_file_is_read_without_decoding_it(tmp_path: Path) -> None:
    """Same bytes, every document plain and trusted: each device's document is decoded from
    its recorded span when first used, and everything equals a read from scratch."""
    caps = tmp_path / "caps.json"
    docs = _documents()
    data = _write(caps, docs, indent=2)
    first = load_snapshot(caps)
    memo = first.memo
    assert memo is not None and set(memo.spans) == set(docs)
    text = data.decode()
    assert {k: json.loads(text[a:b]) for k, (a, b) in memo.spans.items()} == docs
    assert memo.plain == set(docs)
    again = load_snapshot(caps, trusted=_trusted(first))
    assert all(dev._capabilities is None and dev._document is None  # not decoded yet
               for dev in again.devices.values())
    assert _summary(again) == _summary(first)
    # The spans really are used: swapped ones (for these bytes) show through...
    swapped = dict(memo.spans, d1=memo.spans["d2"], d2=memo.spans["d1"])
    forged = SnapshotMemo(memo.key, memo.digests, swapped, memo.plain)
    read = load_snapshot(caps, trusted=TrustedDigests(_trusted(first), forged))
    assert read.devices["d1"].capabilities.device_id == "d2"
    # ...and still for each document the state trusts when it does not trust them all:
    # only the others are decoded (and validated), each from its own span.
    untrusted = TrustedDigests({**_trusted(first), "d3": "sha256:other"}, forged)
    partly = load_snapshot(caps, trusted=untrusted)
    assert partly.devices["d1"].capabilities.device_id == "d2"
    assert partly.devices["d3"].capabilities.device_id == "d3"
    assert partly.devices["d3"].digest == data_digest(docs["d3"]) and not partly.problems


def test_files_with_other_members_are_decoded(tmp_path: Path) -> None:
    """A member that is not a plain device document under its own id (a cluster manifest),
    or one that had problems, makes the file decoded as ever, with the same result."""
    caps = tmp_path / "caps.json"
    docs = _documents()
    docs["cluster-1"] = cluster_manifest_from_capabilities(cluster_device("cluster-1",
                                                                          node("w1")))
    docs["broken"] = {"properties": {"id": "broken"}}
    _write(caps, docs)
    first = load_snapshot(caps)
    assert first.memo is not None and first.memo.plain == set(docs) - {"cluster-1"}
    assert "broken" not in first.memo.digests and "broken" in first.broken
    again = load_snapshot(caps, trusted=_trusted(first))
    assert _summary(again) == _summary(first)
    assert all(dev._span is None for dev in again.devices.values())


def test_a_yaml_keyed_file_has_no_spans(tmp_path: Path) -> None:
    caps = tmp_path / "caps.yaml"
    caps.write_text(yaml.safe_dump(_documents()))
    first = load_snapshot(caps)
    assert first.memo is not None and first.memo.spans == {} and first.memo.plain == set()
    assert _summary(load_snapshot(caps, trusted=_trusted(first))) == _summary(first)


@settings(max_examples=200, deadline=None)
@given(members=st.dictionaries(st.text(max_size=6), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8), max_size=5),
       indent=st.sampled_from([None, 0, 2, "\t"]), ascii=st.booleans())
def test_member_spans_decode_to_each_member(members: dict[str, Any], indent: Any,
                                            ascii: bool) -> None:
    text = json.dumps(members, indent=indent, ensure_ascii=ascii)
    spans = member_spans(" \n" + text + "\n")
    assert spans is not None
    assert {k: json.loads((" \n" + text)[a:b]) for k, (a, b) in spans.items()} == members


@pytest.mark.parametrize("text", ['[1, 2]', '{"a": 1} x', '{"a": 1, "a": 2}', '{"a" 1}',
                                  '{"a": 1,}', '{a: 1}', '', '{"a": 1} {}'])
def test_member_spans_only_of_one_json_object(text: str) -> None:
    assert member_spans(text) is None
    with pytest.raises(ValueError):  # malformed inside: the caller takes it as no spans
        member_spans('{"a": [1,]}')


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
    assert snapshotdevice._document_labels(doc) == model.capabilities.labels


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
