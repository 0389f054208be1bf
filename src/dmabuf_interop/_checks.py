"""Argument checks shared by every module: byte counts, offsets, fd numbers, uid/gid sets, rounding.

One helper each, one wording each, so that every public call rejects the same
bad input the same way. Integer-like values (NumPy integers, anything with
``__index__``) are accepted through :func:`operator.index`; ``bool``, floats
and strings are not.
"""

from __future__ import annotations

import mmap
import operator
from typing import Any, Iterable

from .errors import InvalidArgumentError

__all__ = ["as_int", "byte_count", "byte_offset", "fd_number", "id_set", "round_up", "page_size"]


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


def id_set(value: Iterable[int] | None, name: str) -> frozenset[int] | None:
    """``allow_uids`` / ``allow_gids``: ``None``, or an iterable of non-negative integer ids, as a frozenset.

    A single id or a string (``allow_uids=1000``, ``allow_uids="1000"``) is refused: a string's
    characters would never match the kernel's numeric ``SO_PEERCRED`` ids, so every peer would be refused.

    Raises:
        InvalidArgumentError: not an iterable of integers, or an id < 0.
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be an iterable of integer ids or None, got "
                                   f"{type(value).__name__} {value!r}")
    ids = frozenset(as_int(v, f"each of {name}") for v in value)
    if any(i < 0 for i in ids):
        raise InvalidArgumentError(f"{name} must be ids >= 0, got {sorted(ids)}")
    return ids


def round_up(x: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``x``."""
    return (x + alignment - 1) // alignment * alignment


def page_size() -> int:
    """The host page size in bytes (``sysconf(_SC_PAGESIZE)``), the alignment dma-buf export needs."""
    return mmap.PAGESIZE
