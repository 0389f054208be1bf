"""A channel server that stays up (CPU): forks, signals, and the process-wide state a library must not touch.

Real sockets, forks, fds and signals, no mocks. Every scenario that could hang runs in a forked child
with a hard bound (:func:`tests.helpers.bounded.bounded`), so a hang fails the test within seconds.
Each test states the behaviour expected of the library; those marked ``xfail`` show a fault that is
still there (the reason names it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dmabuf_interop.channel import SharedPool, connect, listen
from dmabuf_interop.fd import open_fds
from tests.helpers import env_with_src
from tests.helpers.bounded import bounded, child, error, reap, result
from tests.helpers.channels import connect_in_thread, local_pair


# --------------------------------------------------------------------------- fork


def test_a_forked_worker_closing_its_inherited_listener_leaves_the_parents_alone(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        lst = listen(addr)
        pid = os.fork()
        if pid == 0:
            lst.close()
            os._exit(0)
        os.waitpid(pid, 0)
        exists = os.path.exists(addr)
        t, cons = connect_in_thread(addr, timeout=2)
        try:
            lst.accept(timeout=2).close()
            accepted: dict[str, Any] = {"ok": True}
        except BaseException as exc:  # noqa: BLE001
            accepted = error(exc)
        t.join(3)
        lst.close()
        return {"exists": exists, "accept": accepted}

    out = bounded(scenario, 6)
    assert out["exists"] and out["accept"].get("ok"), out


_FORK_EXIT = """
import json, os, sys, threading
from dmabuf_interop.channel import connect, listen
addr = sys.argv[1]
lst = listen(addr)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a worker that ends normally: the interpreter's exit runs its finalizers
os.waitpid(pid, 0)
out = {"exists": os.path.exists(addr)}
res = {}
def consume():
    try:
        connect(addr, timeout=2).close(); res["ok"] = True
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
t = threading.Thread(target=consume); t.start()
try:
    lst.accept(timeout=2).close(); out["accept"] = "ok"
except Exception as exc:
    out["accept"] = f"{type(exc).__name__}: {exc}"
t.join(3)
out["consumer"] = res
lst.close()
print(json.dumps(out))
"""


def test_a_forked_worker_exiting_normally_leaves_the_parents_listener_alone(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")
    run = subprocess.run([sys.executable, "-c", _FORK_EXIT, addr], capture_output=True, text=True, timeout=20,
                         env=env_with_src())
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["exists"] and out["accept"] == "ok" and out["consumer"].get("ok"), out


@pytest.mark.parametrize("action", ["send", "close"])
def test_a_forked_worker_cannot_use_or_end_the_parents_channel(tmp_path: Path, action: str) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
        lst, prod, cons = local_pair(addr, pool=pool)
        prod.send(np.arange(4))  # the reader thread runs from the first send on
        with cons.recv(2) as r:
            first = r.as_array().tolist()

        def worker() -> dict[str, Any]:  # what it raises is reported as {"error", "message"}
            if action == "close":
                prod.close()
                return {"closed": True}
            prod.send(np.arange(16))
            return {"sent": True}

        pid, rfd = child(worker)
        in_worker = result(rfd, 3)
        reap(pid)
        try:
            prod.send(np.arange(8))
            with cons.recv(2) as r:
                after = r.as_array().tolist()
        except BaseException as exc:  # noqa: BLE001
            after = error(exc)
        out = {"first": first, "worker": in_worker, "after": after, "parent": os.getpid(),
               "prod_closed": prod.closed}
        cons.close()
        prod.close()
        lst.close()
        pool.close()
        return out

    out = bounded(scenario, 8)
    assert out["after"] == list(range(8)) and not out["prod_closed"], out
    if action == "send":
        w = out["worker"]
        assert w.get("error") == "ForkedResourceError" and str(out["parent"]) in w["message"], out


def test_a_forked_worker_cannot_allocate_from_the_parents_pool() -> None:
    def scenario() -> dict[str, Any]:
        pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
        keep = pool.empty(16, "int32")

        def worker() -> dict[str, Any]:  # what it raises is reported as {"error", "message"}
            pool.empty(16, "int32")
            return {"allocated": True}

        pid, rfd = child(worker)
        got = result(rfd, 3)
        reap(pid)
        del keep
        pool.close()
        return {"worker": got, "parent": os.getpid()}

    out = bounded(scenario, 5)
    w = out["worker"]
    assert w.get("error") == "ForkedResourceError" and str(out["parent"]) in w["message"], out


# --------------------------------------------------------------------------- SIGPIPE


def test_a_consumer_whose_producer_exited_is_not_killed_by_sigpipe(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()

        def producer() -> dict[str, Any]:
            pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
            lst = listen(addr, pool=pool)
            ch = lst.accept(timeout=3)
            ch.send(np.arange(4))
            os.read(go_r, 1)  # then exits without closing anything
            os._exit(0)

        def consumer() -> dict[str, Any]:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a host program may have it
            ch = connect(addr, timeout=3, wait=True)
            r = ch.recv(3)
            os.write(ready_w, b"x")
            os.read(go_r, 1)
            time.sleep(0.2)  # the producer has exited
            try:  # a quiet release, or PeerClosedError from it or from the next recv
                r.release()
                ch.recv(1)
                end = "received"
            except BaseException as exc:  # noqa: BLE001
                end = type(exc).__name__
            ch.close()
            return {"end": end}

        ppid, prfd = child(producer)
        cpid, crfd = child(consumer)
        os.read(ready_r, 1)
        os.write(go_w, b"xx")  # the producer exits; the consumer releases
        reap(ppid)
        got = result(crfd, 4)
        os.close(prfd)
        status = reap(cpid)
        return {"consumer": got, "signaled": status is not None and os.WIFSIGNALED(status),
                "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None}

    out = bounded(scenario, 8)
    assert not out["signaled"], out
    assert out["consumer"].get("ok", {}).get("end") == "PeerClosedError", out


# --------------------------------------------------------------------------- umask


_OBSERVER = """
import os, sys
fd = os.open(f"/proc/{sys.argv[1]}/status", os.O_RDONLY)
seen, reads = set(), 0
while not os.path.exists(sys.argv[2]):
    os.lseek(fd, 0, os.SEEK_SET)
    for line in os.read(fd, 8192).decode().splitlines():
        if line.startswith("Umask:"):
            seen.add(line.split()[1])
    reads += 1
print(" ".join(sorted(seen)), reads)
"""


def test_listen_never_changes_the_process_umask(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    obs = subprocess.Popen([sys.executable, "-c", _OBSERVER, str(os.getpid()), str(stop)],
                           stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)  # the observer is reading
        before = os.umask(0o022)
        os.umask(before)
        t_end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < t_end:
            listen(str(tmp_path / f"u{i % 4}.sock")).close()
            i += 1
    finally:
        stop.touch()
        out, _ = obs.communicate(timeout=10)
    seen, reads = out.split()[:-1], int(out.split()[-1])
    assert reads > 100, out  # the observer really watched
    assert seen == [f"{before:04o}"], f"umask values seen while listen() ran: {seen} ({i} listens)"


# --------------------------------------------------------------------------- two producers, one stale file


def test_two_producers_over_a_stale_socket_file_one_wins_one_is_told_in_use(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        outcomes: dict[str, int] = {}
        samples: dict[str, str] = {}
        for _ in range(20):
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(addr)
            stale.close()  # the file stays; nobody listens
            go_r, go_w = os.pipe()
            done_r, done_w = os.pipe()
            tried_r, tried_w = os.pipe()

            def producer() -> str:
                os.read(go_r, 1)
                try:
                    lst = listen(addr)
                except BaseException as exc:  # noqa: BLE001
                    return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
                finally:
                    os.write(tried_w, b"x")
                os.read(done_r, 1)  # hold the listener until the other has tried
                lst.close()
                return "listening"

            kids = [child(producer) for _ in range(2)]
            os.write(go_w, b"xx")
            tried = b""
            t_end = time.monotonic() + 3
            while len(tried) < 2 and time.monotonic() < t_end:  # both have tried (not a guess at how long)
                tried += os.read(tried_r, 2 - len(tried))
            os.write(done_w, b"xx")
            got = []
            for _, fd in kids:
                kind, _, message = str(result(fd, 3).get("ok", "hung")).partition(": ")
                got.append(kind)
                if message:
                    samples.setdefault(kind, message)
            got.sort()
            for pid, _ in kids:
                reap(pid)
            for fd in (go_r, go_w, done_r, done_w, tried_r, tried_w):
                os.close(fd)
            key = " + ".join(got)
            outcomes[key] = outcomes.get(key, 0) + 1
            try:
                os.unlink(addr)
            except FileNotFoundError:
                pass
        return {"outcomes": outcomes, "samples": samples}

    out = bounded(scenario, 20)
    assert out["outcomes"] == {"dmabuf_interop.errors.AddressInUseError + listening": 20}, out


# --------------------------------------------------------------------------- relative paths


def test_listen_binds_a_relative_name_from_a_deep_directory(tmp_path: Path, monkeypatch) -> None:
    deep = tmp_path
    while len(str(deep / "w.sock")) <= 120:
        deep = deep / ("d" * 40)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    lst = listen("w.sock")
    try:
        t, cons = connect_in_thread("w.sock", timeout=3)
        lst.accept(timeout=3).close()
        t.join(3)
        assert cons.get("ok"), cons
        cons["channel"].close()
        assert lst.address == "w.sock"
    finally:
        lst.close()
    assert not (deep / "w.sock").exists()


# --------------------------------------------------------------------------- close() from a signal handler


@pytest.mark.parametrize("timeout", [None, "default"])
def test_close_from_a_signal_handler_during_send_is_prompt(tmp_path: Path, timeout: Any) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        def consumer() -> dict[str, Any]:
            ch = connect(addr, timeout=3, wait=True)
            time.sleep(30)  # connected, never reads
            ch.close()
            return {}

        cpid, crfd = child(consumer)
        pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
        lst = listen(addr, pool=pool)
        ch = lst.accept(timeout=3)
        closed_in: list[float] = []

        def on_term(signum: int, frame: Any) -> None:
            t0 = time.monotonic()
            ch.close() if timeout == "default" else ch.close(timeout)
            closed_in.append(time.monotonic() - t0)

        signal.signal(signal.SIGTERM, on_term)
        main = threading.get_ident()
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGTERM)).start()
        a = pool.empty(1, "int32")
        meta = {"pad": "x" * 60000}
        sent = 0
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 5:
                ch.send(a, meta=meta)
                sent += 1
            end = "no error"
        except BaseException as exc:  # noqa: BLE001
            end = type(exc).__name__
        os.kill(cpid, signal.SIGKILL)
        reap(cpid)
        os.close(crfd)
        return {"closed_in": closed_in, "sent": sent, "send_ended": end, "after": time.monotonic() - t0}

    out = bounded(scenario, 3)
    assert out["closed_in"] and out["closed_in"][0] < 1.0, out
    assert out["send_ended"] != "no error", out


def test_close_from_a_signal_handler_during_recv_is_prompt(tmp_path: Path) -> None:
    """The same kind as above, on the receiving side: a recv() that reads in its caller's thread holds the
    read lock when the handler runs."""
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        lst = listen(addr)
        t, out = connect_in_thread(addr, timeout=3)
        prod = lst.accept(timeout=3)
        t.join(3)
        cons = out["channel"]
        closed_in: list[float] = []

        def on_alarm(signum: int, frame: Any) -> None:
            t0 = time.monotonic()
            cons.close(None)
            closed_in.append(time.monotonic() - t0)

        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t0 = time.monotonic()
        try:
            cons.recv(None)  # nothing comes: the handler closes it
            end = "received"
        except BaseException as exc:  # noqa: BLE001
            end = type(exc).__name__
        took = time.monotonic() - t0
        try:
            prod.recv(2)
            peer = "received"
        except BaseException as exc:  # noqa: BLE001
            peer = type(exc).__name__
        prod.close()
        lst.close()
        return {"closed_in": closed_in, "recv_ended": end, "took": took, "peer": peer,
                "fds_closed": cons._sock.fileno() == -1}

    out = bounded(scenario, 4)
    assert out["closed_in"] and out["closed_in"][0] < 1.0 and out["took"] < 1.5, out
    assert out["recv_ended"] == "ClosedError" and out["peer"] == "PeerClosedError" and out["fds_closed"], out


# --------------------------------------------------------------------------- a channel dropped without close()


def test_a_channel_dropped_without_close_is_closed_when_collected(tmp_path: Path) -> None:
    addr = str(tmp_path / "s.sock")

    def scenario() -> dict[str, Any]:
        import gc
        import warnings

        pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
        lst, prod, cons = local_pair(addr, pool=pool)
        lease = prod.send(np.arange(4))
        with cons.recv(2):
            pass
        lease.wait(2)
        fds_before = len(open_fds())
        threads_before = threading.active_count()  # the producer channel's reader is one of them
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del prod, lease
            gc.collect()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline and threading.active_count() >= threads_before:
                time.sleep(0.05)
            gc.collect()
        threads_after = threading.active_count()
        fds_after = len(open_fds())
        try:
            cons.recv(1)
            peer = "received"
        except BaseException as exc:  # noqa: BLE001
            peer = type(exc).__name__
        cons.close()
        lst.close()
        pool.close()
        return {"threads": [threads_before, threads_after], "fds": [fds_before, fds_after], "peer": peer,
                "warnings": [w.category.__name__ for w in caught]}

    out = bounded(scenario, 6)
    assert out["threads"][1] < out["threads"][0], out  # its reader thread ended
    assert out["fds"][1] < out["fds"][0], out  # the socket is closed
    assert out["peer"] == "PeerClosedError", out
    assert "ResourceWarning" in out["warnings"], out
