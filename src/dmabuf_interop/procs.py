"""Child processes: wait for one with a deadline, kill what outlives it, report how it ended.

:func:`wait_child` is ``waitpid`` with a deadline: past it the child is sent
``SIGKILL`` and reaped, so no zombie or orphan is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from ._time import deadline_after
from .errors import WaitTimeoutError

__all__ = ["ChildExit", "wait_child", "reap_child"]


@dataclass(frozen=True)
class ChildExit:
    """How a child process ended.

    Attributes:
        pid: the child's pid.
        exitcode: its exit status, or ``None`` when a signal killed it.
        signal: the signal number that killed it, or ``None``.
    """

    pid: int
    exitcode: int | None
    signal: int | None

    @property
    def ok(self) -> bool:
        """True only for a normal exit with status 0."""
        return self.exitcode == 0

    def describe(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"child {self.pid} was killed by {name}"
        return f"child {self.pid} exited with status {self.exitcode}"


def wait_child(pid: int, timeout: float | None = None, *, kill_after: bool = True) -> ChildExit:
    """``waitpid`` for ``pid``, with a deadline.

    Past ``timeout`` the child is sent SIGKILL (when ``kill_after``) and reaped,
    so no zombie or orphan is left; the result then reports SIGKILL.

    Raises:
        TimeoutError: the child outlived ``timeout`` and ``kill_after`` is False.
        ChildProcessError: ``pid`` is not our child.
    """
    deadline = deadline_after(timeout)
    delay = 0.001
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            if os.WIFSIGNALED(status):
                return ChildExit(pid, None, os.WTERMSIG(status))
            return ChildExit(pid, os.waitstatus_to_exitcode(status), None)
        if deadline is not None and time.monotonic() >= deadline:
            if not kill_after:
                raise WaitTimeoutError(f"child {pid} still running after {timeout} s")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                return ChildExit(pid, None, os.WTERMSIG(status))
            return ChildExit(pid, os.waitstatus_to_exitcode(status), None)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def reap_child(pid: int, timeout: float | None = None, report: TextIO | None = sys.stderr) -> bool:
    """Reap ``pid``; True only for exit status 0.

    Otherwise writes what happened (the signal or the status) to ``report``
    (``None`` to stay silent) and returns False.
    """
    result = wait_child(pid, timeout)
    if not result.ok and report is not None:
        print(result.describe(), file=report, flush=True)
    return result.ok
