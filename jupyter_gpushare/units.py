"""Memory sizes as people write them: ``24GiB``, ``512M``, ``1.5G``, ``1073741824``.

Every unit is a power of 1024, whatever its spelling (``G``, ``GB`` and ``GiB`` all mean 2**30),
because GPU memory is sized in binary units and a ``24G`` pool that is 1.3 GiB smaller than the
user meant is a surprise, not a feature.
"""

from __future__ import annotations

import re

__all__ = ["BARE_NUMBER_FLOOR", "SIZE_LIMIT", "format_size", "parse_memory_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}

# ASCII only, as the shim's parser (native/src/base/config.c): no other scripts' digits or spaces.
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$", re.ASCII)
#: Sizes travel as u64 (quotas, pools): anything larger is refused, as the shim refuses it.
SIZE_LIMIT = 1 << 64
#: Fraction digits the shim keeps (more precision than any size needs); the rest are ignored.
FRACTION_DIGITS = 12
#: A bare number (no unit) below this, other than 0, is a forgotten unit rather than a size: no
#: pool, quota or memory limit is under 1 MiB, and ``--pool 24`` meant 24GiB, not 24 bytes. The
#: shim refuses GPUSHARE_MEMORY_LIMIT the same way (native/src/base/config.c, GS_BARE_NUMBER_FLOOR).
BARE_NUMBER_FLOOR = 1 << 20
_NEGATIVE_RE = re.compile(r"^\s*-\s*[0-9.]", re.ASCII)


def parse_size(value: str | int) -> int:
    """Return ``value`` in bytes.

    Accepts a non-negative int, or a string of a number (decimals allowed) and an optional unit:
    ``B``, ``K``/``KB``/``KiB``, ``M``/``MB``/``MiB``, ``G``/``GB``/``GiB``, ``T``/``TB``/``TiB``
    (case-insensitive, all 1024-based). Fractions of a byte are rounded down; digits after the
    12th decimal are ignored and sizes of 2**64 or more refused, exactly as the shim's parser
    (native/src/base/config.c; tests/scheduler/test_contracts.py compares the two).

    Raises ValueError with a message that shows the offending value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected bytes or a size such as '24GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: a size cannot be negative")
        if value >= SIZE_LIMIT:
            raise ValueError(f"invalid size {value!r}: over the u64 limit")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"invalid size {value!r}: expected bytes or a size such as '24GiB' "
            f"(got {type(value).__name__})"
        )
    match = _SIZE_RE.match(value)
    if match is None and _NEGATIVE_RE.match(value):
        raise ValueError(f"invalid size {value!r}: a size cannot be negative")
    if match is None:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit "
            "(B, K, M, G, T, KiB, MiB, GiB, TiB), e.g. '24GiB', '512M' or '1073741824'"
        )
    number, unit = match.groups()
    multiplier = _UNITS.get(unit.lower())
    if multiplier is None:
        raise ValueError(
            f"invalid size {value!r}: unknown unit {unit!r} "
            "(use B, K, M, G, T, KiB, MiB, GiB or TiB; all are 1024-based)"
        )
    whole, _, frac = number.partition(".")
    frac = frac[:FRACTION_DIGITS]
    # Exact arithmetic: 1.5G is 1610612736 bytes, not a float approximation of it.
    size = int(whole or "0") * multiplier + int(frac or "0") * multiplier // 10 ** len(frac)
    if size >= SIZE_LIMIT:
        raise ValueError(f"invalid size {value!r}: over the u64 limit")
    return size


def parse_memory_size(value: str | int) -> int:
    """Return ``value`` in bytes, as :func:`parse_size`, for an amount of GPU memory (a pool, a
    quota, a memory limit): a bare number (an int, or a string without a unit) above 0 and below
    BARE_NUMBER_FLOOR is refused as a forgotten unit, saying which size was surely meant.
    ``24B`` is still 24 bytes for whoever means it, and 0 keeps its meaning (none, or the default).
    """
    size = parse_size(value)
    number = str(value).strip()
    if size < BARE_NUMBER_FLOOR and _is_bare_number(value) and float(number) != 0:
        bytes_hint = f" (write {number}B if you do mean bytes)" if number.isdigit() else ""
        raise ValueError(
            f"invalid size {value!r}: a number without a unit is bytes, too few for GPU memory; "
            f"did you mean {number}GiB?{bytes_hint}"
        )
    return size


def _is_bare_number(value: str | int) -> bool:
    if isinstance(value, int):
        return True
    match = _SIZE_RE.match(value)
    return match is not None and not match.group(2)


def format_size(size: int | float) -> str:
    """Format bytes for humans: ``512 B``, ``1.50 KiB``, ``24.00 GiB``."""
    value = float(size)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
