"""Where a device's placed deployments are counted: their cores on its `cpus` entries, their
GPU claims on its GPU peripherals (`compiler.accounting.Ledger` keeps the amounts).

`cpus` entries are placement units, never summed: each deployment's cores are counted on one
entry of an accepted architecture. The placements are counted again on every compile, in
placement order (priority, then name), not in the order they were admitted, so first fit in
that order can count a deployment on the entry another one needs and then count an entry
fuller than its report, while another entry looks free (issue 28: cores of 1, 2 and 1 on
entries of 2 and 1, all three placed). So cores are *packed*: whenever the deployments can
be put on the entries without any entry holding more than it reports, they are counted that
way (a bounded exact search, largest first); only when they cannot (the device reported
less than it runs) are they counted first fit, and what fits nowhere is charged to the
entries with anything left, then to the largest, so that no excess is lost. GPU claims are
*matched* the same way: a claim takes a GPU it matches whenever a matching of every claim
exists (augmenting paths), not just the first free one.

Pure and deterministic: the same placements in the same order give the same counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

__all__ = ["CoreDemand", "fits", "match_claims", "pack_cores"]

#: Cores of one deployment and the architectures they may be on (None: any entry).
CoreDemand = tuple[Decimal, frozenset[str] | None]
#: An entry: its cores and architecture (None: unknown).
Entry = tuple[Decimal, str | None]
#: Where one deployment's cores are counted: (entry index, cores) parts.
Parts = list[tuple[int, Decimal]]

_ZERO = Decimal(0)
#: Entries tried by the exact search before it gives up and counts first fit instead (a few
#: hundred suffice for the devices one meets; the bound keeps a pathological one cheap).
SEARCH_BUDGET = 20_000


class _TooHard(Exception):
    pass


def _usable(entries: Sequence[Entry], accepted: frozenset[str] | None) -> list[int]:
    return [i for i, (_, arch) in enumerate(entries) if accepted is None or arch in accepted]


def _exact(entries: Sequence[Entry], demands: Sequence[CoreDemand]) -> list[int] | None:
    """One entry per demand with no entry over what it reports, or None if there is none
    (or the search ran over its budget)."""
    if len(entries) == 1:
        return _exact_on_one(entries[0], demands)
    return _exact_search(entries, demands)


def _exact_on_one(entry: Entry, demands: Sequence[CoreDemand]) -> list[int] | None:
    """`_exact_search` for a device with one entry, as most report, in one pass: every
    demand with cores must go on it, so they fit exactly when each may and their sum
    does. Why: the accounting counts a device's cores again after every placement it
    admits, and the search's recursion was most of that (a test holds the two equal)."""
    cores, architecture = entry
    chosen, total, placed = [-1] * len(demands), _ZERO, 0
    for i, (needed, accepted) in enumerate(demands):
        if needed > 0:
            if accepted is not None and architecture not in accepted:
                return None
            chosen[i], total, placed = 0, total + needed, placed + 1
    return chosen if total <= cores and placed <= SEARCH_BUDGET else None


def _exact_search(entries: Sequence[Entry],
                  demands: Sequence[CoreDemand]) -> list[int] | None:
    """The bounded search, largest demand first, each on an entry with room, trying no two
    entries alike (the same cores left and architecture) for one demand."""
    order = sorted((i for i, (cores, _) in enumerate(demands) if cores > 0),
                   key=lambda i: (-demands[i][0], i))
    left = [cores for cores, _ in entries]
    chosen = [-1] * len(demands)
    steps = 0

    def place(k: int) -> bool:
        nonlocal steps
        if k == len(order):
            return True
        i = order[k]
        cores, accepted = demands[i]
        tried: set[tuple[Decimal, str | None]] = set()
        for e in _usable(entries, accepted):
            key = (left[e], entries[e][1])
            if left[e] < cores or key in tried:  # an entry like one tried: same outcome
                continue
            tried.add(key)
            steps += 1
            if steps > SEARCH_BUDGET:
                raise _TooHard
            left[e] -= cores
            chosen[i] = e
            if place(k + 1):
                return True
            left[e] += cores
        return False

    try:
        return chosen if place(0) else None
    except _TooHard:
        return None


def fits(entries: Sequence[Entry], demands: Sequence[CoreDemand]) -> bool:
    """Whether every demand can be counted on one entry without overfilling any."""
    return _exact(entries, demands) is not None


def _first_fit(entries: Sequence[Entry], demands: Sequence[CoreDemand]) -> list[Parts]:
    """In order, each demand on the first entry with room; one with room nowhere takes what
    the entries have left, largest first, and the rest from the largest entry."""
    left = [cores for cores, _ in entries]
    out: list[Parts] = []
    for cores, accepted in demands:
        usable = _usable(entries, accepted)
        room = next((e for e in usable if left[e] >= cores), None)
        if room is not None or not usable or cores <= 0:
            parts = [] if room is None or cores <= 0 else [(room, cores)]
        else:
            parts, rest = [], cores
            for e in sorted(usable, key=lambda e: -left[e]):
                part = min(left[e], rest)
                if part > 0:
                    parts.append((e, part))
                    rest -= part
            if rest > 0:
                parts.append((max(usable, key=lambda e: (entries[e][0], -e)), rest))
        for e, part in parts:
            left[e] = max(_ZERO, left[e] - part)
        out.append(parts)
    return out


def pack_cores(entries: Sequence[Entry], demands: Sequence[CoreDemand]) -> list[Parts]:
    """For each demand, where its cores are counted (see the module's docstring)."""
    chosen = _exact(entries, demands)
    if chosen is None:
        return _first_fit(entries, demands)
    return [[(e, demands[i][0])] if e >= 0 else [] for i, e in enumerate(chosen)]


def match_claims(peripherals: Sequence[Any],
                 claims: Sequence[Callable[[Any], bool]]) -> list[int | None]:
    """For each claim (a test of a peripheral), the peripheral it takes, or None: a largest
    matching, earlier claims first (a claim matched once stays matched)."""
    fits_of = [[p for p, value in enumerate(peripherals) if claim(value)] for claim in claims]
    owner: dict[int, int] = {}

    def augment(c: int, seen: set[int]) -> bool:
        for p in fits_of[c]:
            if p in seen:
                continue
            seen.add(p)
            if p not in owner or augment(owner[p], seen):
                owner[p] = c
                return True
        return False

    for c in range(len(claims)):
        augment(c, set())
    out: list[int | None] = [None] * len(claims)
    for p, c in owner.items():
        out[c] = p
    return out
