"""Byte sizes on the command line: ``4096``, ``0x1000``, ``4K``, ``4KiB``, ``1M``, ``2G`` (binary units)."""

from __future__ import annotations

import re

__all__ = ["parse_size", "MAX_SIZE"]

#: Largest size accepted (4 TiB): beyond any GPU or host memory, below every C integer limit.
MAX_SIZE = 1 << 42

# Only these forms: int(text, 0) would also take 0o10, 0b100, 4_096 and +4096, which no one means as a size.
_SIZE = re.compile(r"(?:0[xX](?P<hex>[0-9a-fA-F]+)|(?P<dec>[0-9]+)(?P<unit>[KMGkmg](?:iB)?)?)")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes named by ``text``: decimal (``4096``), hex (``0x1000``), or a number with a binary
    unit ``K``/``M``/``G`` (``4K`` = ``4KiB`` = 4096). Surrounding whitespace is ignored.

    Raises:
        ValueError: any other form (``0o10``, ``0b100``, ``4_096``, ``+4096``, ``-1``, ``4T``),
            zero, or more than 4 TiB; the message quotes the text and the accepted forms.
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid size {text!r}: expected bytes as 4096, 0x1000, 4K, 4KiB, 1M or 2G")
    if m["hex"] is not None:
        value = int(m["hex"], 16)
    else:
        value = int(m["dec"]) * _UNITS[(m["unit"] or "")[:1].lower()]
    if value <= 0:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    if value > MAX_SIZE:
        raise ValueError(f"invalid size {text!r}: at most {MAX_SIZE} bytes (4 TiB)")
    return value
