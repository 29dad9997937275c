"""Quantities with units: parse ``"36GiB"``/``"1.6GHz"``/``"500ns"`` once at load time, print readably.

A chip field declares its unit (``"B"``, ``"B/s"``, ``"Hz"``, ``"s"``, ``"W"``, or a plain word such
as ``"cycles"``); :func:`parse_quantity` accepts a bare number or a number with a suffix of that
unit, and :func:`format_quantity` prints a value with three significant digits and a prefix.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation, Overflow

__all__ = ["format_quantity", "parse_quantity", "short_repr", "unit_suffixes"]

# Suffixes each unit accepts, with their scale. Bytes use binary prefixes (KiB...) and decimal ones
# (kB...) both, spelled out, so "8MiB" and "8MB" cannot be confused; bandwidths are decimal.
_SCALES: dict[str, dict[str, Decimal]] = {
    "B": {"B": Decimal(1), "KiB": Decimal(2**10), "MiB": Decimal(2**20), "GiB": Decimal(2**30),
          "TiB": Decimal(2**40), "kB": Decimal("1e3"), "KB": Decimal("1e3"), "MB": Decimal("1e6"),
          "GB": Decimal("1e9"), "TB": Decimal("1e12")},
    "B/s": {"B/s": Decimal(1), "kB/s": Decimal("1e3"), "MB/s": Decimal("1e6"),
            "GB/s": Decimal("1e9"), "TB/s": Decimal("1e12"), "KiB/s": Decimal(2**10),
            "MiB/s": Decimal(2**20), "GiB/s": Decimal(2**30)},
    "Hz": {"Hz": Decimal(1), "kHz": Decimal("1e3"), "MHz": Decimal("1e6"), "GHz": Decimal("1e9")},
    "s": {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"), "µs": Decimal("1e-6"),
          "ns": Decimal("1e-9"), "ps": Decimal("1e-12")},
    "W": {"W": Decimal(1), "kW": Decimal("1e3")},
}

_QUANTITY = re.compile(r"^\s*([-+]?[0-9_.]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*$")

_DECIMAL_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))
_SMALL_PREFIXES = ((1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"), (1e-12, "p"))
_BINARY_PREFIXES = ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki"))
_PREFIXABLE = ("B/s", "FLOP/s", "Hz", "W")  # units written with the prefix attached ("GB/s")


def unit_suffixes(unit: str) -> tuple[str, ...]:
    """The suffixes a value of `unit` may carry (besides none), e.g. ``("Hz", "kHz", ...)``."""
    if unit in _SCALES:
        return tuple(_SCALES[unit])
    return (unit,) if unit else ()


def parse_quantity(text: str, unit: str, *, what: str = "value") -> float:
    """Parse a number with an optional suffix of `unit` into base units (bytes, Hz, seconds...).

    Args:
        text: e.g. ``"1.6GHz"``, ``"1.6e9"``, ``"36 GiB"``, ``"500ns"``, ``"65_536"``.
        unit: the field's unit, e.g. ``"Hz"``; only its own suffixes are accepted.
        what: the subject of the error message, e.g. ``"core.clock_hz"``.

    Returns:
        The value in base units (``"36GiB"`` -> 38654705664.0), correctly rounded.

    Raises:
        ValueError: with a sentence naming the accepted suffixes, if `text` is not such a number,
            or saying that it is too large to be a finite float (``"1e1000000"``).

    >>> parse_quantity("1.6GHz", "Hz"), parse_quantity("36GiB", "B"), parse_quantity("500ns", "s")
    (1600000000.0, 38654705664.0, 5e-07)
    """
    match = _QUANTITY.match(text)
    suffixes = unit_suffixes(unit)
    expected = "a number" + (f" with an optional suffix ({', '.join(suffixes)})" if suffixes else "")
    shown = text if len(text) <= 40 else f"{text[:32]}...{text[-4:]}"  # one readable line
    problem = f"{what} expects {expected}, found {shown!r}"
    if match is None:
        raise ValueError(problem)
    number, suffix = match.groups()
    if suffix and suffix not in suffixes:
        raise ValueError(problem)
    scale = _SCALES.get(unit, {}).get(suffix, Decimal(1)) if suffix else Decimal(1)
    try:
        value = float(Decimal(number.replace("_", "")) * scale)
    except InvalidOperation:  # not a number: "1.2.3"
        raise ValueError(problem) from None
    except Overflow:  # an exponent past the decimal context's: "1e1000000"
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{what} is too large: {shown!r} is beyond any finite number")
    return value


def short_repr(value: object) -> str:
    """``repr(value)`` for a message, except that an integer too long to read is given by its size
    (Python refuses to print one of more than 4,300 digits at all).

    >>> short_repr(1.5), short_repr(2**64), short_repr(10**5000)
    ('1.5', '18446744073709551616', 'an integer of 5,001 digits')
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 72:
        # floor(bits x log10 2) is the digit count or one less; one comparison settles which.
        digits = int(value.bit_length() * math.log10(2))
        digits += abs(value) >= 10**digits
        return f"an integer of {digits:,} digits"
    return repr(value)


def _sig3(x: float) -> str:
    """Three significant digits, keeping trailing zeros: 1.6 -> '1.60', 40.104 -> '40.1', 216 -> '216'."""
    ax = abs(x)
    if ax >= 99.95:
        return f"{x:.0f}"
    if ax >= 9.995:
        return f"{x:.1f}"
    return f"{x:.2f}"


def format_quantity(value: float | int, unit: str) -> str:
    """A readable string for `value` in `unit`: ``"1.60 GHz"``, ``"8.00 MiB"``, ``"40.1 GB/s"``.

    Bytes get binary prefixes, rates and frequencies decimal ones, seconds milli/micro/nano;
    other units (``"cycles"``, ``"MAC/cycle"``, ``""``) print the number with thousands separators.

    >>> format_quantity(1.6e9, "Hz"), format_quantity(8 * 2**20, "B"), format_quantity(15.4e12 / 384, "B/s")
    ('1.60 GHz', '8.00 MiB', '40.1 GB/s')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if unit == "B":
        for scale, prefix in _BINARY_PREFIXES:
            if abs(value) >= scale:
                return f"{_sig3(value / scale)} {prefix}B"
        return f"{value:,} B" if isinstance(value, int) else f"{value:g} B"
    if unit == "s":
        if value == 0:
            return "0 s"
        for scale, prefix in _SMALL_PREFIXES:
            if abs(value) >= scale * 0.9995:
                return f"{_sig3(value / scale)} {prefix}s"
        return f"{value:.3g} s"
    if unit in ("Hz", "W") or unit.endswith("/s"):
        for scale, prefix in _DECIMAL_PREFIXES:
            if abs(value) >= scale * 0.9995:
                joined = f"{prefix}{unit}" if unit in _PREFIXABLE else f"{prefix} {unit}"
                return f"{_sig3(value / scale)} {joined}"
        return f"{_sig3(value)} {unit}"
    text = f"{value:,}" if isinstance(value, int) else f"{value:.4g}"
    return f"{text} {unit}" if unit else text
