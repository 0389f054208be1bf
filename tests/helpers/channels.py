"""Channel pairs for tests: both ends in this process, over a real AF_UNIX socket."""

from __future__ import annotations

import threading
import time
from typing import Any

from dmabuf_interop.channel import connect, listen


def connect_in_thread(addr: str, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """``connect(addr, **kw)`` in a thread; its dict gets ``ok`` and ``channel``, or ``error`` and
    ``message``, and ``elapsed`` (seconds)."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["channel"] = connect(addr, **kw)
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out.update(error=type(exc).__name__, message=str(exc))
        out["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def local_pair(addr: str, **listen_kw: Any) -> tuple[Any, Any, Any]:
    """(listener, producer channel, consumer channel): ``listen(addr, **listen_kw)``, a consumer connected
    from a thread, and the channel ``accept`` gave for it."""
    lst = listen(addr, **listen_kw)
    t, out = connect_in_thread(addr, timeout=5)
    prod = lst.accept(timeout=5)
    t.join(5)
    if not out.get("ok"):
        raise AssertionError(f"the consumer did not connect: {out}")
    return lst, prod, out["channel"]
