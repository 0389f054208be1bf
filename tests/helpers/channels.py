"""Channel pairs for tests: both ends in this process, over a real AF_UNIX socket."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable

from dmabuf_interop import fdpass
from dmabuf_interop.channel import connect, listen
from dmabuf_interop.channel._ring import Rings
from dmabuf_interop.channel.protocol import PROTOCOL_VERSION, host_boot_id
from dmabuf_interop.channel.wire import recv_frame, send_frame


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


def hand_written_listener(addr: str, script: Callable[[socket.socket, Rings | None], None], ring: Any = 1,
                          make: bool = True) -> threading.Thread:
    """A listener written by hand (for hostile-peer tests): hello offering ``ring`` (1 or ``None``), the
    peer's hello and, when both offered the ring, its ring message read (its fds closed); then
    ``script(conn, rings)`` with a real region of its own (``make``) to forge in, or ``None``."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(addr)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        srv.close()
        send_frame(conn, {"kind": "hello", "protocol": PROTOCOL_VERSION, "library": "x", "boot_id": host_boot_id(),
                          "gpus": [], "pid": os.getpid(), "ring": ring})
        hello, _ = recv_frame(conn, 10)
        rings = None
        if hello["ring"] == 1 and ring == 1:
            offer, fds = fdpass.recv_message(conn, 10, max_fds=2)
            rings = Rings(4, 4) if make else None
            if rings is not None:
                rings.attach(offer, fds)
            fdpass.close_fds(fds)
        try:
            script(conn, rings)
            try:
                recv_frame(conn, 10)  # the victim hangs up
            except Exception:  # noqa: BLE001
                pass
        finally:
            conn.close()
            if rings is not None:
                rings.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
