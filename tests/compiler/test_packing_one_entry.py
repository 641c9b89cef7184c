"""The one-entry shortcut of the core packing gives exactly what the bounded search gives."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.packing import _exact_on_one, _exact_search, fits, pack_cores

ARCHITECTURES = st.sampled_from(["amd64", "arm64", None])
CORES = st.decimals(min_value=0, max_value=64, places=1, allow_nan=False,
                    allow_infinity=False)
ACCEPTED = st.one_of(st.none(), st.frozensets(st.sampled_from(["amd64", "arm64"]),
                                              max_size=2))


@settings(max_examples=500, deadline=None)
@given(CORES, ARCHITECTURES, st.lists(st.tuples(CORES, ACCEPTED), max_size=12))
def test_one_entry_is_packed_as_the_search_packs_it(
        cores: Decimal, architecture: str | None,
        demands: list[tuple[Decimal, frozenset[str] | None]]) -> None:
    entry = (cores, architecture)
    assert _exact_on_one(entry, demands) == _exact_search([entry], demands)
    chosen = _exact_search([entry], demands)
    assert fits([entry], demands) is (chosen is not None)
    if chosen is not None:
        assert pack_cores([entry], demands) == [
            [(0, needed)] if needed > 0 else [] for needed, _ in demands]


def test_a_device_running_more_than_it_reports_is_counted_first_fit() -> None:
    """Over capacity there is no exact packing: first fit counts the excess too."""
    demands = [(Decimal(3), None), (Decimal(2), None)]
    assert _exact_on_one((Decimal(4), "amd64"), demands) is None
    assert pack_cores([(Decimal(4), "amd64")], demands) == [
        [(0, Decimal(3))], [(0, Decimal(1)), (0, Decimal(1))]]
