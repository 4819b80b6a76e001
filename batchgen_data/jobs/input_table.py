"""``InputTable``: one input file's rows as read, and what both of its readers share.

``readers`` (pyarrow's fast readers) and ``tolerant_reader`` (line by line) return it; the bad-byte
pattern and the renaming of repeated CSV column names live here so both read a file the same way.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import pyarrow as pa

logger = logging.getLogger(__name__)

# Invalid input bytes, as Python's "surrogateescape" decoding leaves them (one code point per byte).
BAD_BYTES = re.compile("[\udc80-\udcff]+")


@dataclass(slots=True)
class InputTable:
    """One input file's rows.

    ``json_columns``: the columns stored as JSON text because their values have no single Arrow
    type (a ``messages`` string in one row and a list in the next).
    """

    table: pa.Table
    json_columns: set[str] = field(default_factory=set)


def unique_names(names: list[str], file_name: str) -> list[str]:
    """Column names made unique the way pandas does (``a``, ``a.1``, ``a.2``): a CSV header
    may repeat a name, and a table keyed by name would silently keep only one of them."""
    taken, unique = set(names), []
    for name in names:
        new, k = name, 0
        while new in unique or (k and new in taken):  # never take a name another cell has
            k += 1
            new = f"{name}.{k}"
        unique.append(new)
    renamed = [f"{a} -> {b}" for a, b in zip(names, unique) if a != b]
    if renamed:
        logger.warning("%s: repeated column names renamed: %s", file_name, ", ".join(renamed))
    return unique


def leaf_types(arrow_type: pa.DataType):
    """The non-nested types inside ``arrow_type`` (itself, if it is not nested)."""
    if pa.types.is_struct(arrow_type):
        for i in range(arrow_type.num_fields):
            yield from leaf_types(arrow_type.field(i).type)
    elif pa.types.is_map(arrow_type):
        yield from leaf_types(arrow_type.key_type)
        yield from leaf_types(arrow_type.item_type)
    elif pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        yield from leaf_types(arrow_type.value_type)
    else:
        yield arrow_type


def has_floating(schema: pa.Schema) -> bool:
    """Whether any column holds floating-point values, at any depth."""
    return any(pa.types.is_floating(t) for f in schema for t in leaf_types(f.type))
