"""Byte sizes as people write them: '2GiB', '512MiB', '64GB' or a plain integer."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(value: int | str) -> int:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {value!r} (use e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(value: int) -> str:
    """1073741824 -> '1GiB': the largest binary unit that divides it (parse_bytes reads it back)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)
