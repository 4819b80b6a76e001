"""Byte sizes as people write them: ``8GB``, ``512MiB``, ``1.5 GiB``, ``1073741824``."""

from __future__ import annotations

import re
from decimal import Decimal

from batchgen_data.errors import ConfigError

# Decimal (SI) and binary (IEC) units; a bare K/M/G/T is refused as ambiguous.
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_byte_size(text: str) -> int:
    """A whole number of bytes from ``text``: a number with an optional unit (B, kB, MB, GB, TB
    are powers of 1000; KiB, MiB, GiB, TiB powers of 1024; case-insensitive).

    Example:
        >>> parse_byte_size("512MiB"), parse_byte_size("8GB"), parse_byte_size("1024")
        (536870912, 8000000000, 1024)
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ConfigError(f"{text!r} is not a byte size: expected a number and a unit, like 8GB or 512MiB")
    number, unit = match.groups()
    scale = UNITS.get(unit.lower() or "b")
    if scale is None:
        raise ConfigError(f"{text!r}: unknown unit {unit!r}; use one of B, kB, MB, GB, TB (x1000) or KiB, MiB, GiB, "
                          "TiB (x1024)")
    size = Decimal(number) * scale  # exact: 1.1GB is 1,100,000,000 bytes
    if size < 1 or size != int(size):
        raise ConfigError(f"{text!r} is {size:g} bytes: a byte size must be a whole number >= 1")
    return int(size)
