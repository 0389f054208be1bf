"""The one size parser of the command line (``cli._units.parse_size``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmabuf_interop.cli._units import MAX_SIZE, parse_size


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("0x1000", 4096), ("0X1000", 4096), ("4K", 4096), ("4k", 4096), ("4KiB", 4096), ("4kb", 4096),
    ("1M", 1 << 20), ("1MiB", 1 << 20), ("2G", 2 << 30), ("4T", 4 << 40), ("0", 0), ("010", 10),
])
def test_documented_forms(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", [
    "", " 4096", "4096 ", "0o10", "0b100", "4_096", "+4096", "-4", "1.5", "1e3", "4B", "4iB", "4KK", "0x",
    "4 K", "K", "0x1_000", "٤", "5T", str(MAX_SIZE + 1), hex(MAX_SIZE + 1),
])
def test_undocumented_forms_and_too_large_are_refused(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@given(st.integers(0, MAX_SIZE))
def test_decimal_and_hex_round_trip(n):
    assert parse_size(str(n)) == n == parse_size(hex(n))
