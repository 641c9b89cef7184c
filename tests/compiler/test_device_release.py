"""A compile releases each device's model once its result is accounted
(`compiler.snapshot.Device.release`, `compiler.writing.account_commits`): a released
device builds exactly the same model again when asked, and a device whose model cannot be
built again from text keeps it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from kits.fleetkit import Fleet, app, device, intent
from test_cluster_placement import cluster_device, node
from test_noop_shortcuts import compile_keyed
from test_snapshot_reading import _documents, _summary, _trusted, _write

from compiler.snapshot import Snapshot, load_snapshot
from margo.cluster import cluster_manifest_from_capabilities


def _released(snapshot: Snapshot) -> Snapshot:
    """`snapshot` with every device's model used, then released."""
    for dev in snapshot.devices.values():
        assert dev.matching is not None and dev.labels is not None
        dev.release()
    return snapshot


def _docs_with_others() -> dict[str, Any]:
    """Plain documents (one with text outside ASCII), a cluster's manifest and a broken one."""
    docs = _documents()
    docs["d-utf8"] = device("d-utf8", labels={"site": "Zürich ☃"})
    docs["cluster-1"] = cluster_manifest_from_capabilities(cluster_device("cluster-1",
                                                                          node("w1")))
    docs["broken"] = {"properties": {"id": "broken"}}
    return docs


def test_released_devices_build_the_same_models_again(tmp_path: Path) -> None:
    """Read from scratch (validated), read again with the memo (decoded once), and wholly
    trusted (built from spans): released or not, the snapshot is the same."""
    for indent in (None, 2):
        caps = tmp_path / f"caps-{indent}.json"
        docs = _docs_with_others()
        _write(caps, docs, indent=indent)
        first = load_snapshot(caps)
        expected = _summary(first)
        assert _summary(_released(first)) == expected
        trusted = _trusted(load_snapshot(caps))
        assert _summary(_released(load_snapshot(caps, trusted=trusted))) == expected
        del docs["cluster-1"], docs["broken"]  # wholly trusted: `LazyDevices`
        _write(caps, docs, indent=indent)
        plain = load_snapshot(caps)
        lazy = load_snapshot(caps, trusted=_trusted(plain))
        assert type(lazy.devices).__name__ == "LazyDevices"
        assert _summary(_released(lazy)) == _summary(plain)


def test_a_released_model_is_dropped_only_where_text_can_build_it_again(
        tmp_path: Path) -> None:
    """Plain documents of a JSON file are built anew after `release`; a cluster's (made
    from its manifest) and those of a YAML file keep their model."""
    caps = tmp_path / "caps.json"
    _write(caps, _docs_with_others())
    snapshot = load_snapshot(caps)
    before = {d: dev.capabilities for d, dev in snapshot.devices.items()}
    _released(snapshot)
    for device_id, dev in snapshot.devices.items():
        kept = dev.capabilities is before[device_id]
        assert kept == (device_id == "cluster-1"), device_id
    yaml_caps = tmp_path / "caps.yaml"
    yaml_caps.write_text(yaml.safe_dump(json.loads(caps.read_text())))
    snapshot = load_snapshot(yaml_caps)
    before = {d: dev.capabilities for d, dev in snapshot.devices.items()}
    _released(snapshot)
    assert all(dev.capabilities is before[d] for d, dev in snapshot.devices.items())


def _fleet(root: Path) -> Fleet:
    fleet = Fleet(root)
    fleet.apps["com-example-app"] = app()
    fleet.intents["plant"] = intent("plant", targets={"selectors": [{"labelSelector": {
        "matchExpressions": [{"key": "site", "operator": "In", "values": ["plant"]}]}}]},
        parameters={"greeting": "{{ device.labels['site'] }} {{ device.properties.id }}"})
    fleet.intents["all"] = intent("all", parameters={"greeting": "hi"})
    for n in range(6):
        fleet.devices[f"d{n}"] = device(f"d{n}", labels={"site": "plant" if n % 2 else "lab"})
    return fleet


def test_a_compile_that_releases_models_writes_what_one_keeping_them_writes(
        tmp_path: Path) -> None:
    """The same fleet from a keyed JSON file (each model released once its result is
    accounted) and from a directory (models kept): the same reports, trees and commit
    messages, first compile and recompile; the keyed file's models were dropped."""
    keyed, kept = _fleet(tmp_path / "keyed"), _fleet(tmp_path / "kept")
    for now, greeting in ((1_000_000.0, "hi"), (2_000_000.0, "hello")):
        for fleet in (keyed, kept):
            fleet.intents["all"]["spec"]["parameters"]["greeting"] = greeting
        report, devices = compile_keyed(keyed, now=now)
        assert all(dev._capabilities is None for dev in devices.values())  # type: ignore[attr-defined]
        other = kept.compile(now=now)
        assert [(r.device_id, r.status, r.changes) for r in report.results] == [
            (r.device_id, r.status, r.changes) for r in other.results]
        for device_id in keyed.devices:
            assert keyed.tree(device_id) == kept.tree(device_id)
            assert ([c.message for c in keyed.store.history(device_id)]
                    == [c.message for c in kept.store.history(device_id)])
