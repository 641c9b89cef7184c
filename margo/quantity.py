"""Byte quantities: parse what applications require and what devices report, render for people.

Application descriptions write quantities the Kubernetes way (`1024Mi`, `10Gi`), but device
capability reports are sloppy: the spec's own examples send `"59 Gi"` with a space, and real
clients send `"16GB"`, `"1.5e9"` or a bare number of bytes. Placement must compare the two
exactly, so `parse_quantity` accepts every reasonable spelling and returns an exact `Decimal`
number of bytes (never a float: `0.1Gi` must not drift), while anything it cannot read with
certainty — a negative size, NaN, an unknown unit like `Gb` (bits?) — is rejected loudly
instead of being guessed at.

`format_quantity` renders bytes back for messages such as "needs 4Gi memory, has 3.5Gi":
the largest binary unit that shows the value exactly with at most one decimal place, and
only when no unit is exact, the value rounded to one decimal in the largest unit that fits.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation

__all__ = ["UNIT_MULTIPLIERS", "format_quantity", "parse_quantity"]

# Plenty of precision so that products and quotients of realistic quantities are exact.
_CTX = Context(prec=200)

_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = (("k", 1), ("K", 1), ("M", 2), ("G", 3), ("T", 4), ("P", 5), ("E", 6))


def _build_units() -> dict[str, Decimal]:
    """Every accepted unit spelling, each optionally followed by `B`, mapped to its multiplier."""
    units: dict[str, Decimal] = {"": Decimal(1), "B": Decimal(1), "m": Decimal("0.001")}
    for power, suffix in enumerate(_BINARY_SUFFIXES, start=1):
        units[suffix] = units[suffix + "B"] = Decimal(1024**power)
    for suffix, power in _DECIMAL_SUFFIXES:
        units[suffix] = units[suffix + "B"] = Decimal(1000**power)
    return units


#: Accepted unit spellings and their multipliers in bytes.
UNIT_MULTIPLIERS: dict[str, Decimal] = _build_units()

_QUANTITY = re.compile(
    r"\s*(?P<sign>[+-]?)"
    r"(?P<number>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:[eE](?P<exponent>[+-]?[0-9]+))?"
    r"\s*(?P<unit>[A-Za-z]*)\s*"
)
_MAX_EXPONENT_DIGITS = 3
_EXPECTED = "a non-negative quantity such as 512Mi, 4Gi, '59 Gi', 16GB or 1.5e3"
_UNIT_HELP = "Ki Mi Gi Ti Pi Ei, k K M G T P E or m, optionally followed by B"

_BINARY_UNITS: tuple[tuple[str, Decimal], ...] = tuple(
    (suffix, Decimal(1024**power))
    for power, suffix in reversed(list(enumerate(_BINARY_SUFFIXES, start=1)))
)
_ONE_DECIMAL = Decimal("0.1")
_SHORT = Decimal(10000)  # exact renderings longer than this read worse than a rounded one


def _reject(found: object, reason: str) -> ValueError:
    return ValueError(f"expected {_EXPECTED}, found {found!r}: {reason}")


def _from_number(value: int | float) -> Decimal:
    """Plain numbers are bytes; floats go through their shortest repr so 0.1 stays 0.1."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _reject(value, "not a finite number")
    amount = Decimal(value) if isinstance(value, int) else Decimal(repr(value))
    if amount < 0:
        raise _reject(value, "negative sizes are meaningless")
    return amount


def _from_text(text: str) -> Decimal:
    """Split `<number>[e<exp>] [unit]` and multiply exactly."""
    parsed = _QUANTITY.fullmatch(text)
    if parsed is None:
        reason = "empty" if not text.strip() else "not a number followed by an optional unit"
        raise _reject(text, reason)
    if parsed["sign"] == "-":
        raise _reject(text, "negative sizes are meaningless")
    exponent = parsed["exponent"] or "0"
    if len(exponent.lstrip("+-")) > _MAX_EXPONENT_DIGITS:
        raise _reject(text, "exponent out of range")
    unit = parsed["unit"]
    multiplier = UNIT_MULTIPLIERS.get(unit)
    if multiplier is None:
        raise _reject(text, f"unknown unit {unit!r} (use {_UNIT_HELP})")
    number = Decimal(f"{parsed['number']}e{exponent}")
    return _CTX.multiply(number, multiplier)


def _canonical(amount: Decimal) -> Decimal:
    """Whole byte counts as plain integers (`1536`, not `1.536E+3`), fractions left alone."""
    integral = amount.to_integral_value()
    return Decimal(int(integral)) if integral == amount else amount


def parse_quantity(text: str | int | float) -> Decimal:
    """Parse a byte quantity (`"4Gi"`, `"59 Gi"`, `"1.5e3"`, `16GB`, `1024`) into exact bytes.

    Binary suffixes Ki..Ei are powers of 1024, decimal k/K..E powers of 1000, `m` is the
    Kubernetes milli (1/1000); any suffix may carry a trailing `B`. Raises `ValueError`
    saying what was expected and what was found for anything else.
    """
    if isinstance(text, bool):
        raise _reject(text, "a boolean is not a quantity")
    if isinstance(text, int | float):
        return _canonical(_from_number(text))
    if not isinstance(text, str):
        raise _reject(text, f"a {type(text).__name__} is not a quantity")
    try:
        return _canonical(_from_text(text))
    except InvalidOperation as exc:  # pragma: no cover - guarded by the exponent limit
        raise _reject(text, "out of range") from exc


def _is_clean(amount: Decimal) -> bool:
    """True when the amount shows exactly with at most one decimal place."""
    tenths = _CTX.multiply(amount, Decimal(10))
    return tenths == tenths.to_integral_value()


def _render(amount: Decimal) -> str:
    """`4`, `3.5`: one decimal at most, no trailing `.0`."""
    tenths = amount.quantize(_ONE_DECIMAL, rounding=ROUND_HALF_EVEN, context=_CTX)
    whole = tenths.to_integral_value()
    return str(int(whole)) if whole == tenths else format(tenths, "f")


def format_quantity(amount: Decimal | int) -> str:
    """Render bytes for people: `4Gi`, `3.5Gi`, `512Mi`, `1280Ki`, `100`.

    Picks the largest binary unit in which the value is exact with at most one decimal and
    stays short (under 10000 units, so 16GB does not become `15625000Ki`). If there is none,
    values of 1Ki and more are rounded to one decimal in the largest unit that fits (so
    `parse_quantity(format_quantity(x))` is within 5% of `x`), and smaller values are shown
    as exact bytes.
    """
    if isinstance(amount, bool) or not isinstance(amount, int | Decimal):
        raise TypeError(f"expected a Decimal or int number of bytes, found {amount!r}")
    value = Decimal(amount)
    if not value.is_finite() or value < 0:
        raise ValueError(f"expected a non-negative finite number of bytes, found {amount!r}")
    fitting = [
        (suffix, _CTX.divide(value, multiplier))
        for suffix, multiplier in _BINARY_UNITS
        if value >= multiplier
    ]
    if not fitting:
        return format(_canonical(value.normalize(_CTX)), "f")
    for suffix, scaled in [*fitting, ("", value)]:
        if scaled < _SHORT and _is_clean(scaled):
            return _render(scaled) + suffix
    suffix, scaled = fitting[0]
    return _render(scaled) + suffix
