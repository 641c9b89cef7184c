"""`margo plan --diff`: the unified diff of each device file a compile would commit, the
way `helm diff` and `flux diff` show a change before it is applied: values, chart and
image revisions, whatever the rendered YAML says.

A dry-run compile hands over the commits it would make (`compile_fleet(on_dry_commit=)`);
this module compares each with the device's branch as it is.
"""

from __future__ import annotations

import difflib

from compiler.gitstore import DeviceCommit, DeviceStore, StoredTree

__all__ = ["commit_diff"]


def commit_diff(store: DeviceStore, commit: DeviceCommit) -> list[str]:
    """The diff lines (`--- a/devices/<id>/<file>`, `+++ b/...`, hunks) of one commit."""
    before = store.tree(commit.device_id)
    old_ids = {} if before is None else before.ids
    new_names = _new_names(commit, old_ids)
    lines: list[str] = []
    for name in sorted(set(old_ids) | new_names):
        old = _old_bytes(before, name)
        new = _new_bytes(store, commit, before, name) if name in new_names else None
        if old == new:
            continue
        label = f"devices/{commit.device_id}/{name}"
        lines += difflib.unified_diff(
            _text(old), _text(new), fromfile=f"a/{label}" if old is not None else "/dev/null",
            tofile=f"b/{label}" if new is not None else "/dev/null", lineterm="")
    return lines


def _new_names(commit: DeviceCommit, old_ids: dict[str, str]) -> set[str]:
    """The names in the committed tree."""
    named = set(commit.files) | set(commit.kept)
    if commit.on_parent:
        return (set(old_ids) - set(commit.removed)) | named
    return named


def _old_bytes(before: StoredTree | None, name: str) -> bytes | None:
    if before is None or name not in before.ids:
        return None
    return before.read(name)


def _new_bytes(store: DeviceStore, commit: DeviceCommit, before: StoredTree | None,
               name: str) -> bytes:
    if name in commit.files:
        return bytes(commit.files[name])
    if name in commit.kept:
        return StoredTree(store, "", {name: commit.kept[name]}).read(name)
    assert before is not None  # on_parent: an untouched file of the parent
    return before.read(name)


def _text(data: bytes | None) -> list[str]:
    return [] if data is None else data.decode("utf-8", errors="replace").splitlines()
