"""Memory sizes written by people: "8GiB", "512MiB", "1.5GB", "4096" (bytes)."""
from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text) -> int:
    """Bytes of a size such as "8GiB" (2^30), "512MiB", "1.5GB" (10^9), "100kB" or "4096" (an int
    or float is taken as bytes). Units are case-insensitive.

    Raises:
        ValueError: not a positive number followed by one of B, kB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a memory size: {text!r}; write a number and a unit, such as 8GiB, 512MiB, "
                             f"1.5GB or 4096 (bytes); units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return size


def format_size(nbytes: float) -> str:
    """`nbytes` in MiB with two decimals ("12.50 MiB"), GiB from 1 GiB on."""
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.2f} MiB"
