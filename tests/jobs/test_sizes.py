"""Byte sizes with units (the CLI's --weight-memory)."""

from __future__ import annotations

import pytest

from batchgen_data.errors import ConfigError
from batchgen_data.jobs.sizes import parse_byte_size


@pytest.mark.parametrize("text, size", [("1024", 1024), ("8GB", 8 * 10**9), ("512MiB", 512 * 2**20),
                                        ("1.5 gib", 3 * 2**29), ("1.1GB", 1_100_000_000), ("3kB", 3000), ("7b", 7)])
def test_sizes_in_decimal_and_binary_units(text, size):
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text, message", [("8G", "unknown unit 'G'"), ("lots", "not a byte size"),
                                           ("-1GB", "not a byte size"), ("0", "whole number >= 1"),
                                           ("1.3B", "is 1.3 bytes")])
def test_bad_sizes_name_the_value_and_what_is_valid(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_byte_size(text)
    assert repr(text) in str(err.value)
