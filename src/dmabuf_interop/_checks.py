"""Argument checks shared by every module: byte counts, offsets, fd numbers, rounding.

One helper each, one wording each, so that every public call rejects the same
bad input the same way. Integer-like values (NumPy integers, anything with
``__index__``) are accepted through :func:`operator.index`; ``bool``, floats
and strings are not.
"""

from __future__ import annotations

import mmap
import operator
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["as_int", "byte_count", "byte_offset", "fd_number", "round_up", "page_size"]


def as_int(value: Any, name: str) -> int:
    """``operator.index(value)``; ``bool`` and non-integers raise :class:`InvalidArgumentError`."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def byte_count(value: Any, name: str = "size") -> int:
    """A positive number of bytes.

    Raises:
        InvalidArgumentError: not an integer, or <= 0.
    """
    n = as_int(value, name)
    if n <= 0:
        raise InvalidArgumentError(f"{name} must be > 0 bytes, got {n}")
    return n


def byte_offset(value: Any, name: str = "offset") -> int:
    """A non-negative byte offset.

    Raises:
        InvalidArgumentError: not an integer, or < 0.
    """
    n = as_int(value, name)
    if n < 0:
        raise InvalidArgumentError(f"{name} must be >= 0 bytes, got {n}")
    return n


def fd_number(value: Any) -> int:
    """A non-negative file descriptor number (not checked for being open).

    Raises:
        InvalidArgumentError: not an integer, or negative.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"fd must be an int, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"fd {value} is not a valid file descriptor (negative)")
    return value


def round_up(x: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``x``."""
    return (x + alignment - 1) // alignment * alignment


def page_size() -> int:
    """The host page size in bytes (``sysconf(_SC_PAGESIZE)``), the alignment dma-buf export needs."""
    return mmap.PAGESIZE
