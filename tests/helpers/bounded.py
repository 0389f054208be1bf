"""Run a scenario in a forked child with a hard time bound, so that a hang is a test failure, not a stuck suite.

:func:`bounded` runs a whole scenario in its own process group (whatever it forks is killed with it) and
returns its JSON-able dict; :func:`child` forks a helper process inside a scenario and :func:`result`
reads what it returned. Children never return into pytest. Only for CPU scenarios: CUDA does not survive
fork().
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from typing import Any, Callable


def error(exc: BaseException) -> dict[str, str]:
    """An exception as a scenario reports it: ``{"error": class name, "message": str}``."""
    return {"error": type(exc).__name__, "message": str(exc)}


class Hung(AssertionError):
    """The scenario did not finish within its bound (it was killed)."""


def child(fn: Callable[[], Any], *, group: bool = False) -> tuple[int, int]:
    """Fork a process that runs ``fn()`` (in a process group of its own with ``group``); returns
    ``(pid, read end)``: it writes ``{"ok": result}`` or ``{"error", "message", "tb"}`` as JSON to the
    pipe and exits. :func:`result` reads it."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        if group:
            os.setpgid(0, 0)
        try:
            out: Any = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - a child never returns into pytest
            out = {**error(exc), "tb": traceback.format_exc()}
        try:
            view = memoryview(json.dumps(out, default=repr).encode())
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def result(fd: int, timeout: float) -> Any:
    """What a :func:`child` wrote, or ``{"error": "Hung"}`` after ``timeout`` seconds; closes ``fd``."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": "Hung", "message": f"no result within {timeout} s"}
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks)) if chunks else {"error": "NoResult", "message": "exited without a result"}


def bounded(fn: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
    """``fn()`` in a forked child; its dict, or :class:`Hung` after ``timeout`` seconds, or an
    ``AssertionError`` carrying the child's traceback when it raised."""
    pid, fd = child(fn, group=True)
    try:
        out = result(fd, timeout)
    finally:
        for target in (-pid, pid):  # the child's group: whatever it forked goes with it
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.waitpid(pid, 0)
    if out.get("error") == "Hung":
        raise Hung(f"the scenario did not finish within {timeout} s (killed)")
    if "error" in out:
        raise AssertionError("the scenario raised:\n" + out.get("tb", out["message"]))
    return out["ok"]


def reap(pid: int, timeout: float = 2.0) -> int | None:
    """The wait status of ``pid`` within ``timeout`` seconds, else ``None`` (it is then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return None
