"""Deadlines: every wait in the library takes a timeout in seconds and turns it into one."""

from __future__ import annotations

import math
import numbers
import threading
import time

from .errors import InvalidArgumentError

__all__ = ["check_timeout", "deadline_after", "remaining"]

#: The longest wait the platform's locks and sockets take (``threading.TIMEOUT_MAX``, about 292 years);
#: a longer timeout, ``math.inf`` included, waits forever, as ``None`` does.
LONGEST = threading.TIMEOUT_MAX
_monotonic = time.monotonic


def check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    """A caller's timeout in seconds, checked: ``None`` (wait forever) for ``None`` and for any
    timeout of :data:`LONGEST` or more (``math.inf``), else the number itself. ``name``: the
    argument's name in the error (``"handshake_timeout"``).

    Raises:
        InvalidArgumentError: not a number, negative, or NaN.
    """
    if timeout is None:
        return None
    # Speed trick: a float or int skips the ABC check (numbers.Real costs ~1 us, and this runs several
    # times per channel message). type(), not isinstance: a bool goes on to be refused. (NumPy scalars are Real.)
    t = type(timeout)
    if not (t is float or t is int) and (t is bool or not isinstance(timeout, numbers.Real)):
        raise InvalidArgumentError(f"{name} must be a number of seconds or None, got {type(timeout).__name__}")
    try:
        timeout = float(timeout)
    except OverflowError:  # an int past any float (10**400): forever, or refused as negative below
        timeout = math.inf if timeout > 0 else -math.inf
    if not timeout >= 0:  # also refuses NaN, which would never expire
        raise InvalidArgumentError(f"{name} must be >= 0 seconds, got {timeout}")
    return None if timeout >= LONGEST else timeout


def deadline_after(timeout: float | None) -> float | None:
    """``time.monotonic() + timeout``; ``None`` (wait forever) for ``None`` and for a timeout of
    :data:`LONGEST` or more.

    Raises:
        InvalidArgumentError: not a number, negative, or NaN.
    """
    t = type(timeout)
    if (t is float or t is int) and 0 <= timeout < LONGEST:  # speed trick: the usual timeout, in this one call
        return _monotonic() + timeout
    timeout = check_timeout(timeout)
    return None if timeout is None else _monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (never negative); ``None`` for no deadline."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())
