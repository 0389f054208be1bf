"""Benchmark children: the one way the tools start a child process and read its reports.

A child is a fresh interpreter (CUDA does not survive ``fork()``):
``python -m dmabuf_interop.cli.bench.MODULE ROLE CTL [FD ...]``, where ``CTL``
and the ``FD`` s are inherited AF_UNIX stream sockets. ``CTL`` joins it to the
parent: the parent sends the configuration as the first frame, the child sends
its reports back, each one JSON frame of :func:`~dmabuf_interop.fdpass.send_message`
(nothing is unpickled). The other sockets join children to each other. A
child's stdout goes to the parent's stderr, so nothing a library prints there
(NIXL, UCX) lands in the report or the table; its stdin is ``/dev/null``.

Parent side: :func:`start`, :meth:`Child.result`, :func:`finish`. Child side:
:func:`serve`, which reads the configuration, runs the role and reports
``{"status": "ok", "result": ...}``, ``{"status": "not installed", "reason": ...}``
(an ImportError), ``{"status": "unsupported", "reason": ...}`` (a ``NotSupportedError``)
or ``{"status": "error", "reason": ...}``; a role may :func:`report` more before
that (``{"ready": true, ...}`` once it listens, progress). The latency pairs of
:mod:`.runner` speak the richer protocol of :mod:`.protocol` over the same sockets.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ...errors import DmaBufError, NotSupportedError, PeerClosedError, WaitTimeoutError
from ...fdpass import recv_message, send_message
from ...procs import leave_interrupts_to_parent, wait_child

__all__ = ["Child", "REPORT_MAX_BYTES", "start", "finish", "reap", "serve", "report"]

#: Largest report frame, bytes (a weight-sync result holds every step's time).
REPORT_MAX_BYTES = 16 << 20
#: What :meth:`Child.result` says of a child that ended without its report.
WITHOUT_REPORTING = "exited without reporting (see its stderr)"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the package's source root first on PYTHONPATH (a source-tree run), plus ``extra``."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[3])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in parts:
        env["PYTHONPATH"] = os.pathsep.join([src, *parts])
    env.update(extra or {})
    return env


@dataclass(eq=False, slots=True)
class Child:
    """One running child: its process and the parent's end of its ``CTL`` socket (owned; :func:`reap` closes it)."""

    role: str
    proc: subprocess.Popen[bytes]
    ctl: socket.socket

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the child on ``CTL``.

        Raises:
            PeerClosedError: the child has gone.
        """
        send_message(self.ctl, msg, max_bytes=REPORT_MAX_BYTES)

    def report(self, timeout: float) -> dict[str, Any]:
        """The child's next report (not validated: the caller checks its fields).

        Raises:
            PeerClosedError: the child closed ``CTL`` (it ended) before a report.
            WaitTimeoutError: no report within ``timeout`` seconds.
            ProtocolError: a frame that is no JSON object, or larger than :data:`REPORT_MAX_BYTES`.
        """
        return recv_message(self.ctl, timeout, max_fds=0, max_bytes=REPORT_MAX_BYTES)[0]

    def result(self, timeout: float) -> dict[str, Any]:
        """The child's next report, or ``{"status": "error", "reason": ...}`` when it ends or stays
        silent past ``timeout`` (never raises for a child's fault)."""
        try:
            return self.report(timeout)
        except PeerClosedError:
            return {"status": "error", "reason": f"{self.role} {WITHOUT_REPORTING}"}
        except WaitTimeoutError:
            return {"status": "error", "reason": f"{self.role}: no report within {timeout:g} s (--timeout)"}
        except DmaBufError as exc:
            return {"status": "error", "reason": f"{self.role}: {exc}"}


def _stdout() -> Any:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def start(module: str, role: str, config: dict[str, Any] | None = None, *, fds: Sequence[socket.socket] = (),
          env: dict[str, str] | None = None) -> Child:
    """Start ``python -m dmabuf_interop.cli.bench.MODULE ROLE CTL FD...`` and send it ``config`` (when given).

    ``fds``: sockets the child inherits, in argument order; the caller keeps its own and closes them
    once every child that needs them has started. ``env``: variables set on top of this environment.

    Raises:
        OSError: the interpreter could not be started.
        PeerClosedError: the child ended before it could take ``config``.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        passed = [theirs.fileno(), *(s.fileno() for s in fds)]
        cmd = [sys.executable, "-m", f"dmabuf_interop.cli.bench.{module}", role, *map(str, passed)]
        proc = subprocess.Popen(cmd, pass_fds=passed, env=child_env(env), stdin=subprocess.DEVNULL, stdout=_stdout())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()  # the child holds it: EOF reaches us when the child ends
    child = Child(role, proc, ours)
    if config is not None:
        try:
            child.send(config)
        except BaseException:
            reap(child, 0)
            raise
    return child


def reap(child: Child, timeout: float) -> None:
    """Close ``CTL`` and wait for the child, SIGKILL past ``timeout``; sets ``child.proc.returncode``."""
    child.ctl.close()
    if child.proc.returncode is None:
        ended = wait_child(child.proc.pid, timeout)
        child.proc.returncode = ended.exitcode if ended.exitcode is not None else -(ended.signal or 9)


def finish(children: Sequence[Child], timeout: float, results: list[dict[str, Any]]) -> None:
    """Reap ``children``, ``results[i]`` being child ``i``'s last report (``{}`` when none came).

    On Ctrl-C (a ``KeyboardInterrupt`` being handled) every child is killed at once. Otherwise, when
    one child failed, the others (left waiting on it) are killed; a child that ended without
    reporting is left to end, and its result names the signal that killed it.
    """
    killed: set[int] = set()
    interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
    ending = {c.proc.pid for c, res in zip(children, results) if WITHOUT_REPORTING in res.get("reason", "")}
    if interrupted or any(res.get("status") != "ok" for res in results):
        for c in children:
            if (interrupted or c.proc.pid not in ending) and c.proc.poll() is None:
                c.proc.kill()
                killed.add(c.proc.pid)
    for c in children:
        reap(c, min(timeout, 60.0))
    for c, res in zip(children, results):
        code = c.proc.returncode
        if WITHOUT_REPORTING in res.get("reason", "") and code is not None and code < 0 and c.proc.pid not in killed:
            sig = -code
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            res["reason"] += f"; it was killed by {name}" + (" (out of memory?)" if sig == signal.SIGKILL else "")


# --- the child's side ------------------------------------------------------------------------

def report(ctl: socket.socket, msg: dict[str, Any]) -> None:
    """Send one report to the parent.

    Raises:
        PeerClosedError: the parent has gone.
    """
    send_message(ctl, msg, max_bytes=REPORT_MAX_BYTES)


def serve(roles: dict[str, Callable[[dict[str, Any], socket.socket, list[socket.socket]], Any]],
          argv: list[str] | None = None) -> int:
    """A child's ``__main__``: ``ROLE CTL [FD ...]``; read the configuration from ``CTL``, run
    ``roles[ROLE](config, ctl, sockets)`` and report its return value as the result.

    Ctrl-C is left to the parent (SIGINT ignored), which ends and reaps its children. Returns the
    exit status: 0 after an ``ok`` report, 1 after an error report, 2 for a bad command line or no
    configuration (one line on stderr).
    """
    argv = sys.argv[1:] if argv is None else argv
    leave_interrupts_to_parent()
    if len(argv) < 2 or argv[0] not in roles or not all(a.isdigit() for a in argv[1:]):
        print(f"usage: ROLE CTL [FD ...], ROLE one of {', '.join(roles)}", file=sys.stderr)
        return 2
    role = argv[0]
    socks = [socket.socket(fileno=int(a)) for a in argv[1:]]
    ctl = socks[0]
    try:
        try:
            config = recv_message(ctl, 120, max_fds=0, max_bytes=REPORT_MAX_BYTES)[0]
        except DmaBufError as exc:
            print(f"bench {role}: no configuration: {exc}", file=sys.stderr)
            return 2
        try:
            result = roles[role](config, ctl, socks[1:])
        except ImportError as exc:
            msg: dict[str, Any] = {"status": "not installed", "reason": str(exc)}
        except NotSupportedError as exc:  # a capability this machine lacks: reported, not a failure
            msg = {"status": "unsupported", "reason": f"{role}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
            msg = {"status": "error", "reason": f"{role}: {type(exc).__name__}: {exc}"}
        else:
            msg = {"status": "ok", "result": result}
        try:
            report(ctl, msg)
        except DmaBufError:
            pass  # the parent is gone
        return 0 if msg["status"] == "ok" else 1
    finally:
        for s in socks:
            s.close()
