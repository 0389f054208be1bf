"""Run a scenario in a forked child with a hard time bound, so that a hang is a test failure, not a stuck suite.

The child runs in its own process group (so its own children are killed with it), returns a JSON-able
dict through a pipe, and never returns into pytest. Only for CPU scenarios: CUDA does not survive fork().
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


class Hung(AssertionError):
    """The scenario did not finish within its bound (it was killed)."""


def bounded(fn: Callable[[], dict[str, Any]], timeout: float) -> dict[str, Any]:
    """``fn()`` in a forked child; its dict, or :class:`Hung` after ``timeout`` seconds, or an
    ``AssertionError`` carrying the child's traceback when it raised."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        os.setpgid(0, 0)
        try:
            out = {"ok": fn()}
        except BaseException:  # noqa: BLE001 - a child never returns into pytest
            out = {"raised": traceback.format_exc()}
        try:
            data = json.dumps(out, default=repr).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        finally:
            os._exit(0)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Hung(f"the scenario did not finish within {timeout} s (killed)")
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                data = os.read(r, 1 << 16)
                if not data:
                    break
                chunks.append(data)
    finally:
        os.close(r)
        for target in (-pid, pid):  # the child's group: whatever it forked goes with it
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.waitpid(pid, 0)
    if not chunks:
        raise AssertionError("the scenario's process ended without a result")
    out = json.loads(b"".join(chunks))
    if "raised" in out:
        raise AssertionError("the scenario raised:\n" + out["raised"])
    return out["ok"]


def child(fn: Callable[[], Any]) -> tuple[int, int]:
    """Fork a helper process that runs ``fn()``; returns ``(pid, read end)``: the helper writes
    ``fn``'s JSON-able result to the pipe and exits; ``result(read end, timeout)`` reads it."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        try:
            out: Any = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001
            out = {"error": type(exc).__name__, "message": str(exc), "tb": traceback.format_exc()}
        try:
            os.write(w, json.dumps(out, default=repr).encode())
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
