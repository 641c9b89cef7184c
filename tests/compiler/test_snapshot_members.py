"""A keyed JSON capability file is read member by member (`compiler.snapshot._read_members`):
each device's document decoded and checked on its own, its model dropped once validated.
What that gives must be exactly what reading the whole file gives: devices, digests,
models, labels, problems located at the same file/line/column, the memo, and the same
refusal of a file the whole read refuses. The whole read is the path a file takes when it
cannot be read by members (YAML, say); here it is forced by making `_read_members` decline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kits.fleetkit import device
from test_cluster_placement import cluster_device

import compiler.snapshot as snapshot_module
from compiler.jsonspans import Lines
from compiler.snapshot import Snapshot, SnapshotError, TrustedDigests, load_snapshot
from margo.cluster import cluster_manifest_from_capabilities

#: What breaks a document, each in its own way (a problem of its own, or of its id).
BREAKS = {
    "other id": lambda doc: doc["properties"].update(id="someone-else"),
    "bad quantity": lambda doc: doc["properties"].update(memory="plenty"),
    "bad cpus": lambda doc: doc["properties"].update(cpus="many"),
    "long id": lambda doc: doc["properties"].update(id="x" * 300),
    "not a mapping": lambda doc: doc.update(properties="no"),
}


def _fleet(count: int, broken: dict[int, str]) -> dict[str, Any]:
    docs: dict[str, Any] = {}
    for index in range(count):
        key = f"d{index:04d}"
        docs[key] = device(key, labels={"site": f"s{index % 3}"})
        if index in broken:
            BREAKS[broken[index]](docs[key])
    docs["d0002"] = cluster_manifest_from_capabilities(cluster_device("d0002"))
    return docs


def _whole(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Snapshot:
    with monkeypatch.context() as patched:
        patched.setattr(snapshot_module, "_read_members", lambda *_a, **_k: None)
        return load_snapshot(path, **kwargs)


def _everything(snapshot: Snapshot) -> tuple[object, ...]:
    devices = {key: (dev.digest, dev.file, dev.capabilities, dict(dev.labels), dev.matching)
               for key, dev in snapshot.devices.items()}
    return (list(snapshot.devices), devices, [p.format() for p in snapshot.problems],
            sorted(snapshot.broken), snapshot.memo)


@pytest.mark.parametrize("indent", [None, 2, "\t"])
@pytest.mark.parametrize("processes", [1, 2])
def test_read_by_members_gives_what_a_whole_read_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indent: int | str | None,
        processes: int) -> None:
    monkeypatch.setattr(snapshot_module, "PARALLEL_VALIDATION", 10 if processes == 2 else 10**9)
    docs = _fleet(40, {3: "other id", 7: "bad quantity", 21: "bad cpus", 30: "long id",
                       38: "not a mapping"})
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(docs, indent=indent))
    members = load_snapshot(caps)
    whole = _whole(caps, monkeypatch)
    assert _everything(members) == _everything(whole)
    assert len(members.problems) >= 5 and "d0002" in members.devices
    assert all(":" in p.format().split(" ")[0] for p in members.problems)  # file:line:col
    # Once validated, a plain device holds no model (built again where it compiles).
    fresh = load_snapshot(caps)
    assert all(dev._capabilities is None and dev._document is None
               for key, dev in fresh.devices.items() if key != "d0002")
    # The state trusting part of it: those are not decoded, the rest are, alike.
    trusted = TrustedDigests({k: d.digest for k, d in whole.devices.items() if k < "d0020"},
                             whole.memo)
    assert _everything(load_snapshot(caps, trusted=trusted)) == _everything(
        _whole(caps, monkeypatch, trusted=trusted))


DEEP = "[" * 97 + "]" * 97  # with the file, the member and `properties`: 100 levels


@pytest.mark.parametrize(("old", "new", "refused"), [
    ('"id": "d0001"', '"id": "d0001", "id": "d0001"', True),  # a duplicate key in a member
    ('"id": "d0001"', '"id": "d0001", "x": NaN', True),
    ('"id": "d0001"', '"id": "d0001", "x": [' + DEEP + "]", True),  # 101 levels
    ('"id": "d0001"', '"id": "d0001", "x": ' + DEEP, False),  # 100 levels: read
    ("{", "{]", True),
    ("}\n}", "}\n} x", True),  # something after the object
])
def test_a_member_the_whole_read_refuses_refuses_the_file_alike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str,
        refused: bool) -> None:
    text = json.dumps(_fleet(3, {}), indent=1)
    assert old in text
    caps = tmp_path / "caps.json"
    caps.write_text(text.replace(old, new, 1) if old != "}\n}" else text + " x")

    def outcome(read: Any) -> object:
        try:
            return _everything(read())
        except SnapshotError as exc:
            return str(exc)

    members = outcome(lambda: load_snapshot(caps))
    assert members == outcome(lambda: _whole(caps, monkeypatch))
    assert isinstance(members, str) == refused


def test_a_duplicate_device_key_is_refused_where_it_is(tmp_path: Path) -> None:
    one = json.dumps(device("a"))
    caps = tmp_path / "caps.json"
    caps.write_text('{"a": ' + one + ',\n "a": ' + one + "}")
    with pytest.raises(SnapshotError, match=r"caps.json:2:\d+: \$\.a: duplicate key 'a'"):
        load_snapshot(caps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="ab\n", max_size=200), st.lists(st.integers(0, 199), max_size=30))
def test_lines_count_as_from_the_start(text: str, offsets: list[int]) -> None:
    """`Lines` counts from the nearest offset counted before: any order of questions gives
    what counting from the start of the text gives."""
    lines = Lines(text)
    for offset in (o for o in offsets if o <= len(text)):
        before = text[:offset]
        assert lines.at(offset) == (before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1)


def test_many_broken_documents_are_located_in_one_pass(tmp_path: Path) -> None:
    """Each broken document's position is counted from the last one counted: a file of
    3,000 broken documents on one line is read as a whole read reads it (which builds the
    whole file's source map once)."""
    docs = {f"d{i:04d}": device(f"d{i:04d}") for i in range(3000)}
    for doc in docs.values():
        doc["properties"]["memory"] = "plenty"
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(docs))
    read = load_snapshot(caps)
    assert len(read.broken) == 3000 and not read.devices
    last = read.problems[-1].format()
    offset = caps.read_text().index('"plenty"', caps.read_text().index('"d2999"'))
    assert f"caps.json:1:{offset + 1}:" in last
