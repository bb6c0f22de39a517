"""Counts and byte sizes: parsing what users type ("7.5B", "350M") and printing human units."""

from __future__ import annotations

import decimal
import re

from .errors import EstimateInputError

# Decimal suffixes for parameter counts: people write "7B" meaning 7e9, never 7 * 2**30.
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
GIB = 1 << 30


def parse_count(text: str, what: str = "count") -> int:
    """Parse "7.5e9", "7.5B", "350M", "1.3b", "125k" or "2851000000" into an exact positive integer.

    Decimal arithmetic keeps "7.5B" exactly 7_500_000_000 (a float would round some inputs).
    Raises EstimateInputError naming `what` for negative, zero, fractional-below-one or non-numeric input.
    """
    if not isinstance(text, str):
        text = str(text)
    match = _COUNT_RE.match(text)
    if match is None:
        stripped = text.strip()
        if stripped.startswith("-"):
            raise EstimateInputError(f"{what} must be positive, got {text!r}")
        raise EstimateInputError(
            f"{what}: cannot read {text!r} as a count (examples: 7.5e9, 7.5B, 350M, 1.3b, 125k)"
        )
    number, suffix = match.groups()
    try:
        value = decimal.Decimal(number) * _COUNT_SUFFIXES[suffix.lower()]
    except decimal.InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
        raise EstimateInputError(f"{what}: cannot read {text!r} as a number") from exc
    result = int(value.to_integral_value(rounding=decimal.ROUND_HALF_UP))
    if result < 1:
        raise EstimateInputError(f"{what} must be at least 1, got {text!r}")
    return result


def format_bytes(nbytes: int | float) -> str:
    """Human binary units with two decimals: 0 B, 512 B, 1.50 KiB, 71.69 GiB."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in _BINARY_UNITS[1:]:
        value /= 1024.0
        if abs(value) < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_count(count: int) -> str:
    """Parameter counts in decimal units, as model names use them: 2.85B, 350.00M, 125.00k."""
    for scale, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)


def format_gib(nbytes: int | float) -> str:
    """Fixed GiB with two decimals, the unit DeepSpeed's estimator prints (it labels it "GB")."""
    return f"{nbytes / GIB:.2f} GiB"
