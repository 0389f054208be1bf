"""A channel server that stays up (CPU): the listener under load and under attack.

Real sockets, forks, fds and signals, no mocks. Every scenario that could hang runs in a forked child
with a hard bound (:func:`tests.helpers.bounded.bounded`), so a hang fails the test within seconds.
Each test states the behaviour expected of the library; those marked ``xfail`` show a fault that is
still there (the reason names it).
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from dmabuf_interop.channel import connect, listen
from dmabuf_interop.errors import SyscallError, WaitTimeoutError
from tests.helpers.bounded import bounded, child, error, reap, result
from tests.helpers.channels import connect_in_thread

TOKEN = "0123456789abcdef0123456789abcdef"


# --------------------------------------------------------------------------- one silent client


def _silent_client(addr: str, kind: str) -> socket.socket:
    """A local client that connects and says nothing, or only the first byte of its hello."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(addr)
    if kind == "one-byte":
        s.send(b"\0")
    return s


@pytest.mark.parametrize("kind", ["silent", "one-byte"])
def test_a_silent_local_client_does_not_hold_up_the_next_consumer(tmp_path: Path, kind: str) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        lst = listen(addr)
        stray = _silent_client(addr, kind)
        t, cons = connect_in_thread(addr, timeout=3)
        t0 = time.monotonic()
        try:
            ch = lst.accept(timeout=2)
            accepted = {"ok": True, "elapsed": time.monotonic() - t0}
        except BaseException as exc:  # noqa: BLE001
            accepted = {**error(exc), "elapsed": time.monotonic() - t0}
            ch = None
        t.join(3.5)
        out = {"accept": accepted, "consumer": {k: v for k, v in cons.items() if k != "channel"}}
        if ch is not None:
            ch.close()
        stray.close()
        return out

    out = bounded(scenario, 4)
    assert out["accept"].get("ok") and out["accept"]["elapsed"] < 1.5, out
    assert out["consumer"].get("ok"), out


def test_accept_with_only_a_stalled_client_raises_at_its_own_timeout(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        lst = listen(addr)
        stray = _silent_client(addr, "one-byte")
        t0 = time.monotonic()
        try:
            lst.accept(timeout=1)
            out = {"returned": True}
        except BaseException as exc:  # noqa: BLE001
            out = error(exc)
        out["elapsed"] = time.monotonic() - t0
        stray.close()
        lst.close()
        return out

    out = bounded(scenario, 3)
    assert out.get("error") == "WaitTimeoutError" and out["elapsed"] < 1.5, out


def test_a_refused_local_peer_is_dropped_counted_and_logged_not_raised(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        import logging

        records: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        logger = logging.getLogger("dmabuf_interop")
        logger.addHandler(Keep())
        logger.setLevel(logging.DEBUG)  # whatever level the refusal is logged at
        lst = listen(addr)
        bad_t, bad = connect_in_thread(addr, timeout=2, hello_overrides={"protocol": 99})
        time.sleep(0.2)  # the refused peer is first in the backlog
        good_t, good = connect_in_thread(addr, timeout=2)
        try:
            ch = lst.accept(timeout=2)
            accepted: dict[str, Any] = {"ok": True}
            ch.close()
        except BaseException as exc:  # noqa: BLE001
            accepted = error(exc)
        bad_t.join(4)
        good_t.join(4)
        t_end = time.monotonic() + 2  # the refusal is counted when its handshake thread ends, maybe after
        while getattr(lst, "refused", None) == 0 and time.monotonic() < t_end:  # the good one's (a loaded host)
            time.sleep(0.01)
        refused = getattr(lst, "refused", None)
        # Asked for, refusals surface.
        bad2_t, _ = connect_in_thread(addr, timeout=1, hello_overrides={"protocol": 99})
        try:
            lst.accept(timeout=1, raise_refused=True)
            asked: dict[str, Any] = {"returned": True}
        except BaseException as exc:  # noqa: BLE001
            asked = error(exc)
        bad2_t.join(4)
        lst.close()
        return {"accept": accepted, "good": good.get("ok"), "refused": refused, "log": records, "asked": asked}

    out = bounded(scenario, 8)
    assert out["accept"].get("ok") and out["good"], out
    assert out["refused"] == 1, out
    assert any("protocol" in line for line in out["log"]), out
    assert out["asked"].get("error") == "PeerRefusedError", out


@pytest.mark.nixl
@pytest.mark.parametrize("kind", ["http", "wrong-token", "silent"])
def test_a_stray_tcp_client_never_surfaces_from_accept(kind: str) -> None:
    def scenario() -> dict[str, Any]:
        lst = listen("tcp://127.0.0.1:0", token=TOKEN)
        host, port = lst.address[len("tcp://"):].rsplit(":", 1)
        if kind == "wrong-token":
            connect_in_thread(lst.address, timeout=3, token="f" * 32)
        else:
            raw = socket.create_connection((host, int(port)))
            if kind == "http":
                raw.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        good_t, good = connect_in_thread(lst.address, timeout=3, token=TOKEN)
        t0 = time.monotonic()
        try:
            ch = lst.accept(timeout=2.5)
            accepted: dict[str, Any] = {"ok": True}
            ch.close()
        except BaseException as exc:  # noqa: BLE001
            accepted = error(exc)
        accepted["elapsed"] = time.monotonic() - t0
        good_t.join(5)
        if good.get("ok"):
            good["channel"].close()
        lst.close()
        return {"accept": accepted, "good": {k: v for k, v in good.items() if k != "channel"},
                "refused": getattr(lst, "refused", None)}

    out = bounded(scenario, 12)
    assert out["accept"].get("ok") and out["accept"]["elapsed"] < 2.5, out
    assert out["good"].get("ok"), out
    if kind != "silent":
        assert out["refused"] == 1, out


@pytest.mark.nixl
def test_a_tcp_connect_whose_channel_is_closed_at_once_gets_it_ended_not_an_os_error() -> None:
    """The listener closes each channel as soon as accept gives it: the consumer's connect returns the channel
    (its peer address read before its reader could close the socket), or raises the library's error."""
    def scenario() -> dict[str, Any]:
        outcomes: dict[str, int] = {}
        for _ in range(12):
            lst = listen("tcp://127.0.0.1:0", token=TOKEN)
            t, got = connect_in_thread(lst.address, timeout=3, token=TOKEN)
            lst.accept(timeout=3).close()
            t.join(5)
            if got.get("ok"):
                assert got["channel"].peer_address.startswith("tcp://127.0.0.1:")
                got["channel"].close()
            key = "ok" if got.get("ok") else got.get("error", "hung")
            outcomes[key] = outcomes.get(key, 0) + 1
            lst.close()
        return outcomes

    outcomes = bounded(scenario, 60)
    assert set(outcomes) <= {"ok", "PeerClosedError"}, outcomes


# --------------------------------------------------------------------------- many consumers at once


def test_consumers_beyond_a_full_backlog_retry_within_their_timeout(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")
    n = 12

    def scenario() -> dict[str, Any]:
        consumers = [connect_in_thread(addr, timeout=6, wait=True) for _ in range(n)]
        time.sleep(0.3)  # the consumers wait for the producer, which is still loading
        lst = listen(addr, backlog=2)
        time.sleep(1.0)  # ... and starts accepting a second later
        chans = []
        deadline = time.monotonic() + 5
        while len(chans) < n and time.monotonic() < deadline:
            try:
                chans.append(lst.accept(timeout=0.3))
            except WaitTimeoutError:
                if all(not t.is_alive() for t, _ in consumers):
                    break
        for t, _ in consumers:
            t.join(3)
        failures = [{k: v for k, v in c.items() if k != "channel"} for _, c in consumers if not c.get("ok")]
        for ch in chans:
            ch.close()
        for _, c in consumers:
            if c.get("ok"):
                c["channel"].close()
        lst.close()
        return {"accepted": len(chans), "failures": failures}

    out = bounded(scenario, 10)
    assert out["failures"] == [] and out["accepted"] == n, out


# --------------------------------------------------------------------------- accept at the fd limit


def test_accept_at_the_fd_limit_refuses_the_consumer_and_backs_off(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        lst = listen(addr)

        def consumer() -> dict[str, Any]:
            t0 = time.monotonic()
            try:
                connect(addr, timeout=3).close()
                return {"ok": True, "elapsed": time.monotonic() - t0}
            except BaseException as exc:  # noqa: BLE001
                return {**error(exc), "elapsed": time.monotonic() - t0}

        pid, rfd = child(consumer)
        time.sleep(0.3)  # the consumer's connection waits in the backlog
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds[-1] + 16, hard))
        filler = []
        try:
            while True:
                filler.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
        errors_seen: dict[str, int] = {}
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            try:
                lst.accept(timeout=max(0.0, t_end - time.monotonic())).close()
            except WaitTimeoutError:
                pass
            except SyscallError as exc:
                errors_seen[str(exc)] = errors_seen.get(str(exc), 0) + 1
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        got = result(rfd, 5)
        reap(pid)
        lst.close()
        return {"accept_errors": errors_seen, "consumer": got}

    out = bounded(scenario, 9)
    assert sum(out["accept_errors"].values()) <= 20, out  # backs off: not a busy loop of errors
    cons = out["consumer"].get("ok", out["consumer"])  # (the consumer's own report of its connect)
    assert cons.get("error") == "PeerRefusedError" and cons["elapsed"] < 2.0, out
    assert any(w in cons["message"] for w in ("RLIMIT_NOFILE", "file descriptors", "EMFILE")), out
