"""Which device branches a listing of the refs holds, as a set of branch components.

A recompile that skips most devices tells which recorded devices lost their branch from one
listing of the refs (`compiler.planning`): a plain id's branch is there iff the id is in
the set of what follows `DEVICE_REF_PREFIX` in the listing's names, looked up with the
id's own (cached) hash. Working that set out cuts and hashes a new string per branch: 1.1 s
of a no-op at 1,000,000 devices, after every compile that created branches, since the
listing is then a new one. So it is worked out once per listing (`branch_components`), and
a move of this process's own that only added branches (`carry_components`, from
`compiler.gitstore.DeviceStore.move_branches`) carries it to the new listing from the ids
it gave a branch: strings the compile holds already, hashed already.
"""

from __future__ import annotations

from collections.abc import Mapping

from compiler.gitformat import DEVICE_REF_PREFIX, all_plain_device_ids

__all__ = ["branch_components", "carry_components"]

#: The listing last asked about (or carried to) and its device branches' components.
_LAST: tuple[frozenset[str], frozenset[str]] | None = None


def branch_components(refs: frozenset[str]) -> frozenset[str]:
    """What follows `DEVICE_REF_PREFIX` in each name of `refs` that has it. Worked out
    once per listing: the store hands out the same listing while the refs are unchanged
    (`compiler.packedrefs.ref_names`)."""
    global _LAST
    if _LAST is None or _LAST[0] is not refs:
        start = len(DEVICE_REF_PREFIX)
        _LAST = refs, frozenset(name[start:] for name in refs
                                if name.startswith(DEVICE_REF_PREFIX))
    return _LAST[1]


def carry_components(before: frozenset[str], after: frozenset[str],
                     created: Mapping[str, str]) -> None:
    """Remember `after`'s components from `before`'s when `after` is exactly `before`
    plus the branches `created` names (device id -> its ref), as after a move of this
    process's own that created those branches. Anything else (someone else's change to
    the refs in between, `before` not worked out) leaves `after` to be worked out when
    asked: the carried set must be the one `branch_components` would give."""
    global _LAST
    if after is before or not created:
        return
    if before:
        if _LAST is None or _LAST[0] is not before:
            return
        known = _LAST[1]
    else:
        known = frozenset()
    if (len(after) != len(before) + len(created) or not after.issuperset(created.values())
            or not after.issuperset(before)):
        return
    if all_plain_device_ids(created):  # each id is its branch's component
        added: frozenset[str] | list[str] = frozenset(created)
    else:
        start = len(DEVICE_REF_PREFIX)
        added = [name[start:] for name in created.values()]
    _LAST = after, known.union(added)
