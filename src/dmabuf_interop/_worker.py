"""One daemon thread that runs calls in order and hands back :class:`concurrent.futures.Future` objects.

A :class:`concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so a call of it
still blocked there (a ``recv_many`` waiting out its timeout, a control-plane call) would hold the exit up
by as long; a daemon thread does not. The library's waits are all bounded, and whoever submits a call
waits for its future with a timeout of their own.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["DaemonWorker"]


class DaemonWorker:
    """Runs submitted calls one at a time, in order, in one daemon thread started on the first call."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue ``fn(*args)``; its future holds the result or the exception it raised."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        fut: Future[Any] = Future()
        self._calls.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            fut, fn, args = call
            call = None
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    fut.set_exception(exc)
            # Nothing of a call is held while waiting for the next. A daemon thread that let go of the caller's
            # objects during the interpreter's exit (a state dict of torch tensors, through a closure) would take
            # the GIL there and be ended inside torch's C++ code: the process aborts ("terminate called without
            # an active exception").
            fut = fn = args = None

    def shutdown(self, timeout: float | None = None) -> None:
        """End the thread once the calls queued before have run; wait for that up to ``timeout`` seconds."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._calls.put(None)
            thread.join(timeout)
