"""Byte quantities: every spelling devices and apps use parses exactly; nonsense is refused."""

from __future__ import annotations

from decimal import Decimal, localcontext

import pytest
from hypothesis import given
from hypothesis import strategies as st

from margo.quantity import UNIT_MULTIPLIERS, format_quantity, parse_quantity

KI, MI, GI, TI, PI, EI = (1024**p for p in range(1, 7))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("1024", 1024, id="plain-digits"),
        pytest.param(1024, 1024, id="int"),
        pytest.param(1.5, Decimal("1.5"), id="float"),
        pytest.param(0, 0, id="zero"),
        pytest.param("1.5e3", 1500, id="exponent"),
        pytest.param("2E3", 2000, id="capital-E-with-digits-is-exponent"),
        pytest.param("1e3Ki", 1000 * KI, id="exponent-and-unit"),
        pytest.param("512Mi", 512 * MI, id="Mi"),
        pytest.param("4Gi", 4 * GI, id="Gi"),
        pytest.param("1Ki", KI, id="Ki"),
        pytest.param("2Ti", 2 * TI, id="Ti"),
        pytest.param("3Pi", 3 * PI, id="Pi"),
        pytest.param("1Ei", EI, id="Ei"),
        pytest.param("1.5Gi", 3 * GI // 2, id="fraction-binary"),
        pytest.param(".5Ki", 512, id="leading-dot"),
        pytest.param("59 Gi", 59 * GI, id="space-before-unit"),
        pytest.param("  59\tGi  ", 59 * GI, id="surrounding-whitespace"),
        pytest.param("1862Gi", 1862 * GI, id="storage"),
        pytest.param("4GiB", 4 * GI, id="GiB"),
        pytest.param("16GB", 16 * 10**9, id="GB"),
        pytest.param("1KB", 1000, id="KB"),
        pytest.param("1kB", 1000, id="kB"),
        pytest.param("1k", 1000, id="k"),
        pytest.param("1K", 1000, id="K"),
        pytest.param("1M", 10**6, id="M"),
        pytest.param("1T", 10**12, id="T"),
        pytest.param("1P", 10**15, id="P"),
        pytest.param("1E", 10**18, id="E-is-exa"),
        pytest.param("10B", 10, id="bytes-B"),
        pytest.param("100m", Decimal("0.1"), id="milli"),
        pytest.param("+5", 5, id="explicit-plus"),
    ],
)
def test_parse_accepts(text: str | int | float, expected: int | Decimal) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param("   ", "empty", id="blank"),
        pytest.param("-1", "negative", id="negative-text"),
        pytest.param("-1Gi", "negative", id="negative-with-unit"),
        pytest.param(-2, "negative", id="negative-int"),
        pytest.param(-0.5, "negative", id="negative-float"),
        pytest.param("nan", "not a number", id="nan-text"),
        pytest.param("inf", "not a number", id="inf-text"),
        pytest.param(float("nan"), "finite", id="nan-float"),
        pytest.param(float("inf"), "finite", id="inf-float"),
        pytest.param(True, "boolean", id="bool-true"),
        pytest.param(False, "boolean", id="bool-false"),
        pytest.param(None, "NoneType", id="none"),
        pytest.param(["4Gi"], "list", id="list"),
        pytest.param("1Gb", "unknown unit 'Gb'", id="bits-unit"),
        pytest.param("1gi", "unknown unit 'gi'", id="lowercase-binary"),
        pytest.param("1mB", "unknown unit 'mB'", id="milli-bytes"),
        pytest.param("1Xi", "unknown unit", id="unknown-unit"),
        pytest.param("1e", "unknown unit 'e'", id="dangling-exponent"),
        pytest.param("abc", "not a number", id="garbage"),
        pytest.param("1 G i", "not a number", id="split-unit"),
        pytest.param("1,5Gi", "not a number", id="comma-decimal"),
        pytest.param("0x10", "not a number", id="hex"),
        pytest.param("1e99999", "exponent", id="huge-exponent"),
    ],
)
def test_parse_rejects(text: object, reason: str) -> None:
    with pytest.raises(ValueError, match="expected a non-negative quantity") as info:
        parse_quantity(text)  # type: ignore[arg-type]
    assert reason in str(info.value)
    assert f"found {text!r}" in str(info.value)


@pytest.mark.parametrize(
    ("amount", "expected"),
    [
        pytest.param(0, "0", id="zero"),
        pytest.param(100, "100", id="bytes"),
        pytest.param(1000, "1000", id="below-Ki"),
        pytest.param(KI, "1Ki", id="Ki"),
        pytest.param(1536, "1.5Ki", id="one-decimal"),
        pytest.param(7 * GI // 2, "3.5Gi", id="3.5Gi"),
        pytest.param(4 * GI, "4Gi", id="4Gi"),
        pytest.param(512 * MI, "512Mi", id="512Mi"),
        pytest.param(1280 * KI, "1280Ki", id="exact-in-smaller-unit"),
        pytest.param(5000, "5000", id="exact-bytes-when-short"),
        pytest.param(50_000, "48.8Ki", id="rounded-when-exact-is-long"),
        pytest.param(59 * GI, "59Gi", id="59Gi"),
        pytest.param(1024 * EI, "1024Ei", id="beyond-Ei"),
        pytest.param(3 * GI // 2 + 1, "1.5Gi", id="rounded-when-nothing-exact"),
        pytest.param(16 * 10**9, "14.9Gi", id="decimal-GB-rounded"),
        pytest.param(Decimal("100.25"), "100.25", id="fractional-bytes-exact"),
        pytest.param(Decimal("0.001"), "0.001", id="milli"),
    ],
)
def test_format(amount: int | Decimal, expected: str) -> None:
    assert format_quantity(amount) == expected


@pytest.mark.parametrize(
    ("amount", "error"),
    [
        pytest.param(-1, ValueError, id="negative"),
        pytest.param(Decimal("NaN"), ValueError, id="nan"),
        pytest.param(Decimal("Infinity"), ValueError, id="infinity"),
        pytest.param(True, TypeError, id="bool"),
        pytest.param(1.5, TypeError, id="float"),
        pytest.param("4Gi", TypeError, id="string"),
    ],
)
def test_format_rejects(amount: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        format_quantity(amount)  # type: ignore[arg-type]


UNITS = sorted(UNIT_MULTIPLIERS)


@given(n=st.integers(min_value=0, max_value=10**15), unit=st.sampled_from(UNITS))
def test_integer_with_unit_is_exact(n: int, unit: str) -> None:
    with localcontext() as ctx:
        ctx.prec = 100  # the default 28 digits would round the expected value itself
        expected = n * UNIT_MULTIPLIERS[unit]
    assert parse_quantity(f"{n}{unit}") == expected


@given(
    n=st.integers(min_value=0, max_value=10**12),
    unit=st.sampled_from([u for u in UNITS if u]),
    before=st.sampled_from(["", " ", "\t", "  "]),
    between=st.sampled_from([" ", "  ", "\t", " \t "]),
    after=st.sampled_from(["", " ", "\n"]),
)
def test_whitespace_is_tolerated(n: int, unit: str, before: str, between: str, after: str) -> None:
    assert parse_quantity(f"{before}{n}{between}{unit}{after}") == parse_quantity(f"{n}{unit}")


@given(amount=st.integers(min_value=0, max_value=2**70))
def test_format_parse_round_trip_within_rounding(amount: int) -> None:
    back = parse_quantity(format_quantity(amount))
    assert abs(back - amount) <= Decimal(amount) * Decimal("0.05")


@given(
    amount=st.decimals(min_value=0, max_value=10**18, places=3, allow_nan=False,
                       allow_infinity=False)
)
def test_decimal_round_trip_within_rounding(amount: Decimal) -> None:
    back = parse_quantity(format_quantity(amount))
    assert abs(back - amount) <= amount * Decimal("0.05")


@given(tenths=st.integers(min_value=10, max_value=10_230), power=st.integers(1, 6))
def test_clean_values_round_trip_exactly(tenths: int, power: int) -> None:
    amount = tenths * 1024**power
    if amount % 10:
        return  # not a whole number of bytes at one decimal; covered by the rounding test
    exact = amount // 10
    assert parse_quantity(format_quantity(exact)) == exact


@given(
    whole=st.integers(min_value=0, max_value=10**9),
    frac=st.integers(min_value=0, max_value=9),
    unit=st.sampled_from(["Ki", "Mi", "Gi", "Ti"]),
)
def test_one_decimal_fractions_are_exact(whole: int, frac: int, unit: str) -> None:
    with localcontext() as ctx:
        ctx.prec = 100
        expected = (Decimal(whole) + Decimal(frac) / 10) * UNIT_MULTIPLIERS[unit]
    assert parse_quantity(f"{whole}.{frac}{unit}") == expected
