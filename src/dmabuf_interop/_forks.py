"""Which process owns a resource: this process's pid, kept current across ``fork()``.

A channel, a pool or a NIXL agent records the pid that made it; a forked child inherits the object
(its fds, its memory) but not its threads, and may not use it (:class:`~.errors.ForkedResourceError`).
:data:`pid` is read on every send and receive, so it is a module global updated by an
``os.register_at_fork`` hook rather than a ``getpid()`` system call per message. (A child forked
outside Python's ``os.fork``, by C code, runs no hook: it must not use the parent's objects.)
"""

from __future__ import annotations

import os

from .errors import ForkedResourceError

__all__ = ["pid", "check_owner"]

#: This process's pid (updated in a forked child before any other code of the child runs).
pid: int = os.getpid()


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_owner(owner_pid: int, what: str) -> None:
    """Raise :class:`~.errors.ForkedResourceError` unless this process is ``owner_pid``."""
    if owner_pid != pid:
        raise ForkedResourceError(what, owner_pid)
