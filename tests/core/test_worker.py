"""The library's daemon worker thread (``dmabuf_interop._worker``): calls in order, their results and errors
through futures, nothing of a call held once it has run, and a prompt end."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from dmabuf_interop._worker import DaemonWorker


class _Payload:
    """Stands for what a call's closure reaches (a state dict of tensors)."""


def test_calls_run_in_order_and_hand_back_results_and_errors() -> None:
    w = DaemonWorker("test-worker")
    seen: list[int] = []
    futs = [w.submit(seen.append, i) for i in range(5)]
    bad = w.submit(lambda: 1 / 0)
    assert [f.result(5) for f in futs] == [None] * 5 and seen == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    w.shutdown(5)
    assert not any(t.name == "test-worker" for t in threading.enumerate())


def test_nothing_of_a_call_is_held_once_it_has_run() -> None:
    """A daemon thread that let go of a caller's objects during the interpreter's exit could abort the
    process inside torch's deallocation: once a call has run, the worker holds nothing of it."""
    w = DaemonWorker("test-worker-hold")
    payload = _Payload()
    ref = weakref.ref(payload)

    def call(p: _Payload = payload) -> str:
        return "done"

    fut = w.submit(call)
    assert fut.result(5) == "done"
    del call, payload, fut
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:  # the worker drops its locals after set_result
        gc.collect()
        time.sleep(0.01)
    assert ref() is None
    w.shutdown(5)
