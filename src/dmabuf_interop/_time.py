"""Deadlines: every wait in the library takes a timeout in seconds and turns it into one."""

from __future__ import annotations

import time

from .errors import InvalidArgumentError

__all__ = ["deadline_after", "remaining"]


def deadline_after(timeout: float | None) -> float | None:
    """``time.monotonic() + timeout``; ``None`` (wait forever) stays ``None``.

    Raises:
        InvalidArgumentError: not a number, negative, or NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidArgumentError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not timeout >= 0:  # also refuses NaN, which would never expire
        raise InvalidArgumentError(f"timeout must be >= 0 seconds, got {timeout}")
    return time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative); ``None`` for no deadline."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())
