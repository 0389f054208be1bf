"""Units on the command line: the one parser of byte sizes (``--size``, ``bench --sizes``), the one
label of a size, and the one parser of seconds (``--timeout``).

Accepted forms, and only these: a decimal number (``4096``), a ``0x`` hex
number (``0x1000``), or a decimal number with a binary suffix, ``K``/``M``/``G``/``T``
optionally followed by ``iB`` or ``B``, case-insensitive (``4K``, ``4KiB``,
``1M``, ``2G``: powers of 1024). Refused: signs, ``_`` separators, ``0o``/``0b``
prefixes, fractions, exponents, whitespace inside, anything above :data:`MAX_SIZE`.
:func:`size_label` writes a size back the way tables and progress lines show it (``4 KiB``).
"""

from __future__ import annotations

import argparse
import re

__all__ = ["KiB", "MiB", "GiB", "MAX_SIZE", "SIZE_FORMS", "parse_size", "size_label", "word_size_argument",
           "seconds_argument"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: Largest size accepted, 4 TiB: beyond any GPU or host memory, below every C integer limit.
MAX_SIZE = 1 << 42

#: The forms, as ``--help`` states them.
SIZE_FORMS = "bytes as 4096, 0x1000, or with a binary suffix: 4K, 4KiB, 1M, 2G (at most 4T)"

_SUFFIX = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_FORM = re.compile(r"(?:0x([0-9a-f]+)|([0-9]+)([kmgt]?)(?:i?b)?)", re.IGNORECASE | re.ASCII)


def parse_size(text: str) -> int:
    """Bytes named by ``text`` (forms in the module docstring); 0 is returned as 0,
    callers that need more check it.

    Raises:
        ValueError: a form not documented, or more than :data:`MAX_SIZE` bytes;
            the message quotes ``text``.
    """
    m = _FORM.fullmatch(text)
    if m is None or (m.group(2) is not None and not m.group(3) and m.group(0) != m.group(2)):
        raise ValueError(f"invalid size {text!r}: expected {SIZE_FORMS}")
    value = int(m.group(1), 16) if m.group(1) is not None else int(m.group(2)) * _SUFFIX[m.group(3).lower()]
    if value > MAX_SIZE:
        raise ValueError(f"invalid size {text!r}: at most {MAX_SIZE} bytes (4 TiB)")
    return value


def size_label(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it: ``4 KiB``, ``1 GiB``, ``12 B``."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def word_size_argument(text: str) -> int:
    """An argparse ``type``: :func:`parse_size`, then a positive multiple of 4 bytes (the
    pattern and read kernels work in 32-bit words).

    Raises:
        argparse.ArgumentTypeError: a form :func:`parse_size` refuses, 0, or not a multiple of 4.
    """
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be a positive multiple of 4 bytes")
    return value


def seconds_argument(text: str) -> float:
    """An argparse ``type``: a positive, finite number of seconds (``--timeout``).

    Raises:
        argparse.ArgumentTypeError: not a number, or zero, negative, NaN or infinite.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: expected seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: must be a positive number of seconds")
    return value
