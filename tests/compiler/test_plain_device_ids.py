"""The shortcut that checks a fleet's device ids at once (`compiler.gitformat`): an id it
calls plain is one the full rules accept and that is its own branch component, and a fleet
it accepts is one whose every id is plain; anything else takes the full rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compiler.gitformat import (
    _PLAIN_ID_RE,
    DEVICE_REF_PREFIX,
    _encoded_ref,
    all_plain_device_ids,
    branch_problem,
    device_ref,
)
from margo.identifiers import MAX_DEVICE_ID, branch_component, device_id_problem

# Pieces that exercise every rule: dots anywhere, '.lock', '/', '~', '%', line breaks,
# characters outside the grammar, and ids at and past the length bound.
_ATOMS = st.sampled_from(["a", "Z", "9", "_", "-", ".", "..", "lock", ".lock", "/", "~",
                          "%", "\n", " ", "ü", "x.y", "a" * 120])
IDS = st.one_of(st.lists(_ATOMS, max_size=8).map("".join), st.text(max_size=12),
                st.integers(MAX_DEVICE_ID - 3, MAX_DEVICE_ID + 3).map(lambda n: "d" * n))


@given(IDS)
def test_a_plain_id_is_valid_and_its_own_branch_component(device_id: str) -> None:
    plain = _PLAIN_ID_RE.fullmatch(device_id) is not None
    if plain:
        assert device_id_problem(device_id) is None
        assert branch_component(device_id) == device_id
        assert device_ref(device_id) == DEVICE_REF_PREFIX + device_id
    assert all_plain_device_ids([device_id]) == plain
    # The shortcut answers exactly as the full rules do.
    assert branch_problem(device_id) == device_id_problem(device_id)
    if device_id_problem(device_id) is None:
        assert device_ref(device_id) == _encoded_ref(device_id)


@given(st.lists(IDS, max_size=6))
def test_a_fleet_is_plain_exactly_when_each_of_its_ids_is(device_ids: list[str]) -> None:
    each = all(_PLAIN_ID_RE.fullmatch(d) is not None for d in device_ids)
    assert all_plain_device_ids(device_ids) == each


@pytest.mark.parametrize("device_ids", [
    ["a", "b\nc"], ["a\n", "b"], ["a", ""], ["a", ".b"], ["a.", "b"], ["a..b"],
    ["x", "dev.lock"], ["x", "d" * (MAX_DEVICE_ID + 1)], ["gw/child"], ["a~1"], ["a", 1]])
def test_one_id_that_is_not_plain_makes_the_fleet_checked_in_full(
        device_ids: list[object]) -> None:
    assert not all_plain_device_ids(device_ids)  # type: ignore[arg-type]


def test_plain_fleets() -> None:
    assert all_plain_device_ids([])
    assert all_plain_device_ids(["device-00001", "a.b.c", "x.lockx", "a.lock.b",
                                 "d" * MAX_DEVICE_ID])
