"""Child processes: wait for one with a deadline, kill what outlives it, report how it ended.

:func:`wait_child` is ``waitpid`` with a deadline: past it the child is sent
``SIGKILL`` and reaped, so no zombie or orphan is left behind.

A process whose ``SIGCHLD`` disposition is ``SIG_IGN`` (inherited through
``exec`` from some shells and supervisors) cannot wait for its children: the
kernel reaps them itself and ``waitpid`` fails with ``ECHILD``
(waitpid(2), "NOTES"). :func:`make_children_waitable` restores ``SIG_DFL``;
call it before forking.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from ._time import deadline_after
from .errors import SyscallError, WaitTimeoutError

__all__ = ["ChildExit", "wait_child", "reap_child", "make_children_waitable", "host_mapping",
           "leave_interrupts_to_parent"]


def make_children_waitable() -> None:
    """Set ``SIGCHLD`` back to ``SIG_DFL`` when it is ``SIG_IGN``, so that ``waitpid`` sees the
    exit status of children forked afterwards. Only the main thread may change a disposition;
    elsewhere this does nothing."""
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _waitpid(pid: int, options: int) -> tuple[int, int]:
    try:
        return os.waitpid(pid, options)
    except ChildProcessError as exc:
        ignored = signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN
        why = (": SIGCHLD is ignored (SIG_IGN) in this process, so the kernel reaped the child and its exit "
               "status is lost; call procs.make_children_waitable() before forking") if ignored else \
            ": not a child of this process"
        raise SyscallError(f"waitpid({pid}){why}", exc) from exc


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
        WaitTimeoutError: the child outlived ``timeout`` and ``kill_after`` is False.
        SyscallError: ``waitpid`` -> ``ECHILD``: ``pid`` is not our child, or ``SIGCHLD`` is
            ignored and the kernel reaped it (the message says which).
    """
    deadline = deadline_after(timeout)
    delay = 0.001
    while True:
        got, status = _waitpid(pid, os.WNOHANG)
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
            _, status = _waitpid(pid, 0)
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


def leave_interrupts_to_parent() -> None:
    """Ignore ``SIGINT`` in a worker process: a Ctrl-C at the terminal reaches the whole process
    group, and the parent, which ends and reaps its workers, reports it once (no traceback per
    worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def host_mapping(addr: int) -> tuple[str, str] | None:
    """``(permissions, path)`` of this process's mapping that holds ``addr``, from
    ``/proc/self/maps`` (proc(5)): ``permissions`` as ``"rw-s"``, ``path`` ``""`` for an
    anonymous mapping. ``None`` when ``addr`` is unmapped or ``/proc`` is not mounted."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, _, hi = fields[0].partition("-")
                if int(lo, 16) <= addr < int(hi, 16):
                    return fields[1], fields[5].strip() if len(fields) > 5 else ""
    except OSError:
        return None
    return None
