"""Byte sizes in and out of human form ("70GiB" <-> 75161927680).

Users give memory limits as strings; GB is decimal (1e9) and GiB binary (2**30),
because vendors quote HBM in GiB-ish "GB" while disks and links use decimal, and
mixing them up is a 7% error in a memory constraint.
"""

import re

from .errors import CostModelError

UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value) -> int:
    """int, float or a string like "70GiB", "80 GB", "1.5TiB", "12345" -> bytes (int)."""
    if isinstance(value, bool):  # bool is an int; True bytes is surely a mistake
        raise CostModelError(f"expected a byte size, got {value!r}; e.g. '70GiB' or 75161927680")
    if isinstance(value, (int, float)):
        if not value >= 0 or value == float("inf"):
            raise CostModelError(f"byte size must be a finite non-negative number, got {value!r}; "
                                 f"e.g. '70GiB' or 75161927680")
        return int(value)
    match = _PATTERN.match(value) if isinstance(value, str) else None
    unit = match and (match.group(2).lower() or "b")
    if not match or unit not in UNITS:
        raise CostModelError(f"cannot read {value!r} as a byte size; write e.g. '70GiB', "
                             f"'80GB', '512 MiB' or 12345 (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    number = match.group(1)
    if number.isdigit():  # exact for whole numbers: floats lose bytes above 2**53
        return int(number) * UNITS[unit]
    return round(float(number) * UNITS[unit])  # round: 1.1 * 1e9 is 1100000000.0000002


def format_bytes(n) -> str:
    """Human form in binary units: 1610612736 -> '1.50 GiB'."""
    n = float(n)
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} B" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
