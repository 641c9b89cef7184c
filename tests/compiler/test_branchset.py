"""The device branches of a ref listing (`compiler.branchset`): what a move of the store's
own carries to the new listing must be exactly what working it out from the listing gives,
for plain ids and ids with characters to encode, on a real repository; and anything that
is not that move (someone else's ref, a listing never worked out) is left to be worked
out."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from compiler import branchset
from compiler.branchset import branch_components, carry_components
from compiler.gitformat import DEVICE_REF_PREFIX
from compiler.gitstore import DeviceCommit, DeviceStore

TS = 1_760_000_000


def worked_out(refs: frozenset[str]) -> frozenset[str]:
    """The components from the listing alone, as if nothing were remembered."""
    return frozenset(name[len(DEVICE_REF_PREFIX):] for name in refs
                     if name.startswith(DEVICE_REF_PREFIX))


def write(store: DeviceStore, device_ids: list[str], text: str) -> None:
    store.write(DeviceCommit(d, {"a.yaml": text.encode()}, f"{text}\n", TS)
                for d in device_ids)


@pytest.mark.parametrize("ids", [["site-1.dev-a", "site-1.dev-b"],
                                 ["gw/child", "a~tilde", "plain"]])
def test_a_move_that_creates_branches_carries_the_exact_set(tmp_path: Path,
                                                            ids: list[str]) -> None:
    store = DeviceStore(tmp_path / "repo")
    write(store, ids[:1], "first")  # the first listing: never worked out before
    assert branch_components(store.branch_names()) == worked_out(store.branch_names())
    write(store, ids, "second")  # one moved, the others created
    refs = store.branch_names()
    assert branchset._LAST is not None and branchset._LAST[0] is refs  # carried, not asked
    assert branch_components(refs) == worked_out(refs)
    write(store, ids, "third")  # moves only: the same listing
    assert store.branch_names() is refs


def test_a_ref_written_by_someone_else_is_not_carried_over(tmp_path: Path) -> None:
    store = DeviceStore(tmp_path / "repo")
    write(store, ["one"], "first")
    before = store.branch_names()
    branch_components(before)
    tip = store.tip("one")
    subprocess.run(["git", f"--git-dir={store.path}", "update-ref",
                    DEVICE_REF_PREFIX + "foreign", str(tip)], check=True)
    subprocess.run(["git", f"--git-dir={store.path}", "pack-refs", "--all", "--prune"],
                   check=True)
    write(store, ["two"], "second")
    refs = store.branch_names()
    assert "foreign" in branch_components(refs)
    assert branch_components(refs) == worked_out(refs) == {"one", "two", "foreign"}


def test_carrying_checks_that_the_new_listing_is_the_old_plus_the_created() -> None:
    prefix = DEVICE_REF_PREFIX
    before = frozenset({prefix + "a", "refs/heads/main"})
    branch_components(before)
    created = {"b": prefix + "b"}
    other = frozenset({prefix + "b", prefix + "c", "refs/heads/main"})  # "a" gone, "c" new
    carry_components(before, other, created)
    assert branchset._LAST is not None and branchset._LAST[0] is before
    after = before | {prefix + "b"}
    carry_components(before, after, created)
    assert (after, frozenset({"a", "b"})) == branchset._LAST
    carry_components(frozenset({prefix + "x"}), after | {prefix + "y"}, {"y": prefix + "y"})
    assert branchset._LAST[0] is after  # from a listing never worked out: nothing carried
