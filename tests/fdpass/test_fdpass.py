"""CPU-only tests of SCM_RIGHTS fd passing: real sockets, real forks, real fds, no mocks."""

from __future__ import annotations

import builtins
import fcntl
import io
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from dmabuf_interop import errors
from dmabuf_interop.fd import fd_is_open, open_fds
from dmabuf_interop.fdpass import (
    MAX_MESSAGE,
    encode_message,
    recv_fd,
    recv_message,
    recv_token,
    send_fd,
    send_message,
    send_token,
)
from dmabuf_interop.procs import reap_child, wait_child
from tests.helpers import fork_child as _fork

HEADER = struct.Struct(">I")


pytestmark = pytest.mark.usefixtures("no_fd_leak")  # every test here touches fds


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass




def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return out
        out += chunk


# --------------------------------------------------------------------------- round trips


def test_roundtrip_pipe_write_end_in_process(pair, pipe):
    a, b = pair
    r, w = pipe
    send_fd(a, w, {"what": "write end"})
    got = recv_fd(b, timeout=5)
    try:
        assert got not in (r, w)
        assert os.fstat(got).st_ino == os.fstat(w).st_ino  # same pipe
        os.write(got, b"through the passed fd")
    finally:
        os.close(got)
    os.close(w)
    assert _read_all(r) == b"through the passed fd"  # EOF: every write end is closed


def test_roundtrip_across_fork_child_sends_parent_receives(pair):
    a, b = pair

    def child():
        b.close()
        r, w = os.pipe()  # a pipe the parent never had
        send_fd(a, r, {"pid": os.getpid(), "note": "read end from the child"})
        os.close(r)
        os.write(w, b"hello from the child")
        os.close(w)
        return 0

    pid = _fork(child)
    a.close()
    meta, fds = recv_message(b, timeout=10)
    assert reap_child(pid, timeout=10, report=None)
    assert meta == {"pid": pid, "note": "read end from the child"}
    assert len(fds) == 1
    try:
        assert _read_all(fds[0]) == b"hello from the child"
    finally:
        os.close(fds[0])


def test_roundtrip_across_fork_parent_writes_child_reads(pair):
    a, b = pair

    def child():
        b.close()
        r, w = os.pipe()
        send_fd(a, w)
        os.close(w)
        data = _read_all(r)  # EOF once the parent closes its copy
        return 0 if data == b"parent->child" else 7

    pid = _fork(child)
    a.close()
    got = recv_fd(b, timeout=10)
    os.write(got, b"parent->child")
    os.close(got)
    result = wait_child(pid, timeout=10)
    assert result.ok, result.describe()


def test_json_metadata_roundtrip(pair, pipe):
    a, b = pair
    meta = {"size": 2 ** 40 + 3, "name": "bühne ✓", "shape": [2, 3, [4]], "ok": True,
            "none": None, "ratio": 0.125, "nested": {"k": {"x": -1}}}
    send_fd(a, pipe[0], meta)
    msg, fds = recv_message(b, timeout=5)
    try:
        assert msg == meta
        assert len(fds) == 1 and os.fstat(fds[0]).st_ino == os.fstat(pipe[0]).st_ino
    finally:
        for fd in fds:
            os.close(fd)


def test_message_without_fd_roundtrip(pair):
    a, b = pair
    send_message(a, {"kind": "plain"})
    assert recv_message(b, timeout=5) == ({"kind": "plain"}, [])


def test_back_to_back_messages_and_token_are_not_glued(pair, pipe):
    """A stream socket may deliver several sends in one read; each receive must take one message."""
    a, b = pair
    send_message(a, {"n": 1})
    send_message(a, {"n": 2})
    send_fd(a, pipe[1], {"n": 3})
    send_message(a, {"n": 4})
    send_token(a, b"g")
    assert recv_message(b, timeout=5) == ({"n": 1}, [])
    assert recv_message(b, timeout=5) == ({"n": 2}, [])
    msg, fds = recv_message(b, timeout=5)
    try:
        assert msg == {"n": 3} and len(fds) == 1
    finally:
        for fd in fds:
            os.close(fd)
    assert recv_message(b, timeout=5) == ({"n": 4}, [])
    assert recv_token(b, timeout=5) == b"g"


def test_large_message_arrives_in_pieces(pair, pipe):
    a, b = pair
    meta = {"blob": "x" * (MAX_MESSAGE - 100)}
    # The peer must read concurrently: the message is bigger than the socket buffer may hold.
    def child():
        a.close()
        msg, fds = recv_message(b, timeout=10)
        ok = msg == meta and len(fds) == 1
        for fd in fds:
            os.close(fd)
        return 0 if ok else 5

    pid = _fork(child)
    send_fd(a, pipe[0], meta)
    result = wait_child(pid, timeout=10)
    assert result.ok, result.describe()


def test_seqpacket_socket_roundtrip(pipe):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        send_fd(a, pipe[1], {"t": "seqpacket"})
        send_message(a, {"t": "second"})
        msg, fds = recv_message(b, timeout=5)
        try:
            assert msg == {"t": "seqpacket"} and len(fds) == 1
            os.write(fds[0], b"z")
        finally:
            for fd in fds:
                os.close(fd)
        assert os.read(pipe[0], 1) == b"z"
        assert recv_message(b, timeout=5) == ({"t": "second"}, [])


# --------------------------------------------------------------------------- errors


def test_eof_is_peer_closed(pair):
    a, b = pair
    a.close()
    with pytest.raises(errors.PeerClosedError) as info:
        recv_fd(b, timeout=5)
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value, errors.FdPassError)


def test_send_to_closed_peer_is_peer_closed(pair, pipe):
    a, b = pair
    b.close()
    with pytest.raises(errors.PeerClosedError):
        send_fd(a, pipe[0])
    with pytest.raises(errors.PeerClosedError):
        send_token(a, b"x")


def test_timeout_in_bounded_wall_time(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(errors.WaitTimeoutError) as info:
        recv_fd(b, timeout=0.2)
    elapsed = time.monotonic() - t0
    assert isinstance(info.value, builtins.TimeoutError)
    assert isinstance(info.value, errors.DmaBufError)
    assert 0.15 <= elapsed < 2.0, elapsed


def test_timeout_while_peer_never_writes(pair):
    """A forked peer that holds its end open but never writes: TimeoutError, not a hang."""
    a, b = pair

    def child():
        b.close()
        time.sleep(30)
        return 0

    pid = _fork(child)
    a.close()
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.WaitTimeoutError):
            recv_fd(b, timeout=0.3)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(builtins.TimeoutError):
            recv_token(b, timeout=0.1)
    finally:
        result = wait_child(pid, timeout=0)
    assert result.signal == signal.SIGKILL


def test_timeout_in_the_middle_of_a_message(pair):
    a, b = pair
    a.sendall(HEADER.pack(10) + b'{"a"')
    with pytest.raises(errors.WaitTimeoutError):
        recv_message(b, timeout=0.2)


def test_negative_timeout_is_invalid(pair):
    with pytest.raises(errors.InvalidArgumentError):
        recv_fd(pair[1], timeout=-1)


def test_message_with_no_fd_is_protocol_error(pair):
    a, b = pair
    send_message(a, {"k": 1})
    with pytest.raises(errors.ProtocolError, match="no fd"):
        recv_fd(b, timeout=5)


def test_two_fds_in_one_message_protocol_error_and_both_closed(pair, pipe):
    a, b = pair
    r, w = pipe
    w2 = os.dup(w)
    socket.send_fds(a, [encode_message({"two": True})], [w, w2])
    os.close(w2)
    with pytest.raises(errors.ProtocolError, match="2 fds"):
        recv_fd(b, timeout=5)
    os.close(w)
    # If either received copy of the write end were still open, this read would block.
    os.set_blocking(r, False)
    assert os.read(r, 1) == b""


def test_most_fds_one_message_can_carry_are_all_seen_and_closed(pair, pipe):
    """SCM_MAX_FD (253) fds on one message: all arrive (no MSG_CTRUNC), all are closed, and the
    connection stays in step for the next message."""
    a, b = pair
    r, w = pipe
    socket.send_fds(a, [encode_message({"many": 253})], [w] * 253)
    with pytest.raises(errors.ProtocolError, match="carried 253 fds"):
        recv_message(b, timeout=5, max_fds=1)
    send_message(a, {"next": 1})
    assert recv_message(b, timeout=5) == ({"next": 1}, [])
    os.close(w)
    os.set_blocking(r, False)
    assert os.read(r, 1) == b""  # all received copies of the write end are closed


def test_fd_limit_error_in_child(pair, pipe):
    """A receiver at RLIMIT_NOFILE: the kernel drops fds; FdLimitError names limit and count."""
    a, b = pair
    report_r, report_w = os.pipe()
    nsend = 8

    def child():
        a.close()
        os.close(report_r)
        before = open_fds()
        n = len(before)
        soft = n + 1
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        free_below = soft - sum(1 for fd in before if fd < soft)
        expect_arrived = min(free_below, nsend)
        out = {"n": n, "soft": soft, "expect_arrived": expect_arrived}
        try:
            recv_message(b, timeout=10, max_fds=nsend)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
        out["after"] = open_fds()
        out["before"] = before
        os.write(report_w, json.dumps(out).encode())
        os.close(report_w)
        return 0

    pid = _fork(child)
    os.close(report_w)
    try:
        socket.send_fds(a, [encode_message({"n": nsend})], [pipe[1]] * nsend)
        data = _read_all(report_r)
    finally:
        os.close(report_r)
        ok = reap_child(pid, timeout=10, report=None)
    assert ok
    out = json.loads(data)
    assert 1 <= out["expect_arrived"] < nsend, out  # precondition: the limit really bites
    assert out["error"] == "FdLimitError", out
    msg = out["message"]
    assert "RLIMIT_NOFILE" in msg and f"soft limit is {out['soft']}" in msg, msg
    assert f"has {out['n'] + out['expect_arrived']} fds open" in msg, msg
    assert f"{out['expect_arrived']} fd(s) arrived and were closed" in msg, msg
    assert out["after"] == out["before"], out  # every fd that arrived was closed
    assert issubclass(errors.FdLimitError, errors.ProtocolError)


def test_af_inet_socket_is_invalid_argument(pipe):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(errors.InvalidArgumentError, match="AF_UNIX") as info:
            send_fd(s, pipe[0])
        assert isinstance(info.value, ValueError)
        with pytest.raises(errors.InvalidArgumentError):
            recv_fd(s, timeout=0.1)
        with pytest.raises(errors.InvalidArgumentError):
            send_message(s, {"a": 1})


def test_not_a_socket_is_invalid_argument(pipe):
    with pytest.raises(errors.InvalidArgumentError):
        send_fd(pipe[1], pipe[0])  # type: ignore[arg-type]


def test_several_fds_on_one_message_arrive_in_order(pair, pipe):
    a, b = pair
    r, w = pipe
    send_message(a, {"parts": 3}, [r, w, r])
    msg, fds = recv_message(b, timeout=5, max_fds=3)
    try:
        assert msg == {"parts": 3} and len(fds) == 3
        assert [os.fstat(fd).st_ino for fd in fds] == [os.fstat(x).st_ino for x in (r, w, r)]
        os.write(fds[1], b"x")  # the second is the write end
        assert os.read(fds[0], 1) == b"x"
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(errors.InvalidArgumentError, match="at most 253"):
        send_message(a, {}, [r] * 254)
    with pytest.raises(errors.InvalidArgumentError):
        send_message(a, {}, [])
    with pytest.raises(errors.InvalidArgumentError):
        send_message(a, {}, [r, -1])
    with pytest.raises(errors.InvalidArgumentError, match="an int or a list"):
        send_message(a, {}, 3.0)  # type: ignore[arg-type]
    with pytest.raises(errors.WaitTimeoutError):  # nothing was put on the wire by the rejected sends
        recv_message(b, timeout=0.05)


def test_bad_fd_is_invalid_argument(pair, pipe):
    a, b = pair
    with pytest.raises(errors.InvalidArgumentError):
        send_fd(a, -1)
    closed = os.dup(pipe[0])
    os.close(closed)
    with pytest.raises(errors.InvalidArgumentError, match="not open"):
        send_fd(a, closed)
    with pytest.raises(errors.InvalidArgumentError):
        send_fd(a, "3")  # type: ignore[arg-type]
    # Nothing was put on the wire by the rejected sends.
    with pytest.raises(errors.WaitTimeoutError):
        recv_message(b, timeout=0.05)


def test_unserialisable_message_is_invalid_argument(pair, pipe):
    a, b = pair
    with pytest.raises(errors.InvalidArgumentError):
        send_fd(a, pipe[0], {"x": object()})
    with pytest.raises(errors.InvalidArgumentError):
        send_message(a, {"x": float("nan")})
    with pytest.raises(errors.InvalidArgumentError):
        send_message(a, ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(errors.WaitTimeoutError):
        recv_message(b, timeout=0.05)


# --------------------------------------------------------------------------- close-on-exec


def test_received_fd_is_close_on_exec(pair, pipe):
    a, b = pair
    send_fd(a, pipe[1])
    got = recv_fd(b, timeout=5)
    try:
        assert os.get_inheritable(got) is False
        assert fcntl.fcntl(got, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(got)


_PROBE = "import os, sys\ntry:\n    os.fstat(int(sys.argv[1]))\nexcept OSError:\n    sys.exit(9)\nsys.exit(0)\n"


def test_received_fd_not_inherited_by_subprocess(pair, pipe):
    a, b = pair
    send_fd(a, pipe[1])
    got = recv_fd(b, timeout=5)
    control = os.dup(pipe[1])
    try:
        os.set_inheritable(control, True)
        # close_fds=False: only close-on-exec stands between the fd and the child.
        seen = subprocess.run([sys.executable, "-c", _PROBE, str(got)], close_fds=False, timeout=30)
        assert seen.returncode == 9, "the received fd leaked into an exec'd child"
        # Positive control: an inheritable fd is visible to the same probe.
        ctrl = subprocess.run([sys.executable, "-c", _PROBE, str(control)], close_fds=False, timeout=30)
        assert ctrl.returncode == 0
    finally:
        os.close(got)
        os.close(control)


# --------------------------------------------------------------------------- framing over a socket


def test_truncated_frame_then_eof_is_peer_closed(pair):
    """EOF in the middle of a frame is documented as PeerClosedError (an FdPassError)."""
    a, b = pair
    a.sendall(HEADER.pack(20) + b'{"a":')
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.PeerClosedError, match="middle") as info:
        recv_message(b, timeout=5)
    assert isinstance(info.value, errors.FdPassError)


def test_truncated_header_then_eof_is_peer_closed(pair):
    a, b = pair
    a.sendall(b"\x00\x00")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.PeerClosedError):
        recv_message(b, timeout=5)


@pytest.mark.parametrize("body, match", [
    (b"{not json}", "not UTF-8 JSON"),
    (b"\xff\xfe{}", "not UTF-8 JSON"),
    (b"[1, 2]", "not an object"),
    (b"[" * 20000, "not UTF-8 JSON"),  # nesting deep enough to hit the recursion limit
])
def test_bad_body_over_socket_is_protocol_error(pair, pipe, body, match):
    a, b = pair
    socket.send_fds(a, [HEADER.pack(len(body)) + body], [pipe[1]])
    with pytest.raises(errors.ProtocolError, match=match):
        recv_message(b, timeout=5)
    os.close(pipe[1])
    os.set_blocking(pipe[0], False)
    assert os.read(pipe[0], 1) == b""  # the fd that rode on the bad message was closed


def test_oversize_announced_length_is_protocol_error(pair):
    a, b = pair
    a.sendall(HEADER.pack(MAX_MESSAGE + 1) + b"{}")
    t0 = time.monotonic()
    with pytest.raises(errors.ProtocolError, match="more than"):
        recv_message(b, timeout=5)
    assert time.monotonic() - t0 < 1.0  # rejected from the header, without waiting for the body


def test_fds_with_no_bytes_never_leak(pair, pipe):
    """An fd riding on a one-byte (truncated) header, then EOF: PeerClosedError, and the fd is closed."""
    a, b = pair
    socket.send_fds(a, [b"\x00"], [pipe[1]])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.PeerClosedError):
        recv_message(b, timeout=5)
    os.close(pipe[1])
    os.set_blocking(pipe[0], False)
    assert os.read(pipe[0], 1) == b""


# --------------------------------------------------------------------------- tokens


def test_token_roundtrip_and_eof_as_skip_signal(pair):
    a, b = pair
    send_token(a, b"g")
    send_token(a, b"\x00")
    assert recv_token(b, timeout=5) == b"g"
    assert recv_token(b, timeout=5) == b"\x00"
    a.close()
    with pytest.raises(errors.PeerClosedError):
        recv_token(b, timeout=5)


def test_token_eof_across_fork_skip_signal(pair):
    """The child skips: it closes its end without a token; the parent sees PeerClosedError."""
    a, b = pair

    def child():
        b.close()
        a.close()
        return 0

    pid = _fork(child)
    a.close()
    with pytest.raises(errors.PeerClosedError):
        recv_token(b, timeout=10)
    assert reap_child(pid, timeout=10, report=None)


def test_token_timeout_and_bad_token(pair):
    a, b = pair
    t0 = time.monotonic()
    with pytest.raises(errors.WaitTimeoutError):
        recv_token(b, timeout=0.1)
    assert time.monotonic() - t0 < 2.0
    for bad in (b"", b"go"):
        with pytest.raises(errors.InvalidArgumentError):
            send_token(a, bad)


# --------------------------------------------------------------------------- child reaping


def test_reap_child_exit_zero():
    pid = _fork(lambda: 0)
    report = io.StringIO()
    assert reap_child(pid, timeout=10, report=report) is True
    assert report.getvalue() == ""
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_reap_child_exit_three():
    pid = _fork(lambda: 3)
    report = io.StringIO()
    assert reap_child(pid, timeout=10, report=report) is False
    line = report.getvalue()
    assert line.strip() == f"child {pid} exited with status 3"


def test_wait_child_exit_three_fields():
    pid = _fork(lambda: 3)
    result = wait_child(pid, timeout=10)
    assert (result.pid, result.exitcode, result.signal, result.ok) == (pid, 3, None, False)


def test_reap_child_sigkill():
    def child():
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    pid = _fork(child)
    report = io.StringIO()
    assert reap_child(pid, timeout=10, report=report) is False
    assert "SIGKILL" in report.getvalue()
    assert str(pid) in report.getvalue()


def test_child_outliving_timeout_is_killed_and_reaped():
    def child():
        time.sleep(30)
        return 0

    pid = _fork(child)
    report = io.StringIO()
    t0 = time.monotonic()
    assert reap_child(pid, timeout=0.3, report=report) is False
    assert time.monotonic() - t0 < 5.0
    assert "SIGKILL" in report.getvalue()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(pid, os.WNOHANG)


def test_wait_child_timeout_without_kill_raises_then_cleanup():
    def child():
        time.sleep(30)
        return 0

    pid = _fork(child)
    try:
        with pytest.raises(errors.WaitTimeoutError) as info:
            wait_child(pid, timeout=0.1, kill_after=False)
        assert isinstance(info.value, builtins.TimeoutError)
        os.kill(pid, 0)  # still alive: it was not killed
    finally:
        result = wait_child(pid, timeout=0)
    assert result.signal == signal.SIGKILL and not result.ok
    assert "SIGKILL" in result.describe()


def test_wait_child_not_our_child():
    with pytest.raises(errors.SyscallError, match="not a child of this process"):
        wait_child(1, timeout=0.1)
