"""fd passing beside other control messages, connections kept in step after a rejected message,
fds in flight past the kernel's limit, and the default timeouts. Real sockets, forks and fds."""

from __future__ import annotations

import inspect
import os
import resource
import socket
import struct
import time

import pytest

from dmabuf_interop import errors, fdpass
from dmabuf_interop.fdpass import DEFAULT_TIMEOUT, SO_PASSPIDFD, recv_message, send_message
from dmabuf_interop.procs import wait_child
from tests.helpers import fork_child

HEADER = struct.Struct(">I")


pytestmark = pytest.mark.usefixtures("no_fd_leak")  # every test here touches fds


@pytest.fixture
def memfd():
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    yield fd
    os.close(fd)


OPTIONS = {"SO_PASSCRED": socket.SO_PASSCRED, "SO_PASSSEC": socket.SO_PASSSEC, "SO_PASSPIDFD": SO_PASSPIDFD}


def _set_option(sock: socket.socket, name: str) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, OPTIONS[name], 1)
    except OSError as exc:
        pytest.skip(f"this kernel does not offer {name}: {exc}")


@pytest.mark.parametrize("options", [["SO_PASSCRED"], ["SO_PASSSEC"], ["SO_PASSPIDFD"],
                                     ["SO_PASSCRED", "SO_PASSSEC", "SO_PASSPIDFD"]], ids="+".join)
def test_fd_arrives_beside_control_messages_the_receiver_asked_for(pair, memfd, options):
    """The receiver's socket adds SCM_CREDENTIALS / SCM_SECURITY / SCM_PIDFD to each message: the
    sent fd still arrives, every pidfd the kernel installed is closed (the fixture checks), and the
    next messages read correctly."""
    a, b = pair
    for name in options:
        _set_option(b, name)
    send_message(a, {"n": 1}, memfd, timeout=5)
    send_message(a, {"n": 2}, timeout=5)
    send_message(a, {"n": 3}, memfd, timeout=5)
    for n in (1, 2, 3):
        msg, fds = recv_message(b, timeout=5)
        assert msg == {"n": n}
        assert len(fds) == (0 if n == 2 else 1)
        for fd in fds:
            assert os.fstat(fd).st_ino == os.fstat(memfd).st_ino
            os.close(fd)


def _raw(sock: socket.socket, body: bytes, length: int | None = None, fds: list[int] | None = None) -> None:
    frame = HEADER.pack(len(body) if length is None else length) + body
    socket.send_fds(sock, [frame], fds) if fds else sock.sendall(frame)


@pytest.mark.parametrize("case", ["too many fds", "bad JSON", "not an object", "fd on a later byte"])
def test_message_rejected_after_its_frame_leaves_the_connection_in_step(pair, memfd, case):
    a, b = pair
    body = b'{"x": 1}' if case != "bad JSON" else b'{"x": '
    if case == "not an object":
        body = b"[1, 2]"
    if case == "too many fds":
        _raw(a, body + b" " * 40000, fds=[memfd, memfd])
    elif case == "fd on a later byte":
        a.sendall(HEADER.pack(len(body)) + body[:2])
        socket.send_fds(a, [body[2:]], [memfd])
    else:
        _raw(a, body)
    with pytest.raises(errors.ProtocolError):
        recv_message(b, timeout=5)
    send_message(a, {"valid": True}, memfd, timeout=5)
    msg, fds = recv_message(b, timeout=5)
    assert msg == {"valid": True} and len(fds) == 1
    os.close(fds[0])


@pytest.mark.parametrize("case", ["bad length", "timeout mid-frame"])
def test_message_cut_off_mid_frame_marks_the_connection_broken(pair, case):
    """The rest of the frame cannot be found again: every later call raises at once, naming the
    first reason, instead of reading the rest as a new frame length."""
    a, b = pair
    if case == "bad length":
        _raw(a, b"x" * 16, length=fdpass.MAX_MESSAGE + 1)
        first = "more than"
    else:
        a.sendall(HEADER.pack(100) + b"{")
        first = "timed out"
    with pytest.raises((errors.ProtocolError, errors.WaitTimeoutError), match=first):
        recv_message(b, timeout=0.2)
    send_message(a, {"valid": True}, timeout=5)
    t0 = time.monotonic()
    for call in (lambda: recv_message(b, timeout=5), lambda: fdpass.recv_token(b, 5)):
        with pytest.raises(errors.ProtocolError, match=f"cut off in the middle of its frame.*{first}"):
            call()
    assert time.monotonic() - t0 < 1


def test_send_cut_off_by_timeout_marks_the_connection_broken_for_sending(pair):
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # smaller than one message
    big = {"pad": "x" * (fdpass.MAX_MESSAGE - 100)}
    t0 = time.monotonic()
    with pytest.raises(errors.WaitTimeoutError, match="socket buffer full"):
        send_message(a, big, timeout=0.3)
    assert time.monotonic() - t0 < 2
    with pytest.raises(errors.ProtocolError, match="cut off"):
        send_message(a, {"small": 1}, timeout=0.3)


def test_every_send_and_receive_waits_60_s_by_default():
    assert DEFAULT_TIMEOUT == 60.0
    for fn in (fdpass.send_message, fdpass.recv_message, fdpass.send_fd, fdpass.recv_fd,
               fdpass.send_token, fdpass.recv_token):
        assert inspect.signature(fn).parameters["timeout"].default == DEFAULT_TIMEOUT, fn.__name__


def test_too_many_fds_in_flight_is_fd_pass_error_naming_the_limit(pair):
    """An unprivileged sender with RLIMIT_NOFILE 64 sends 500 fds to a peer that never reads:
    FdsInFlightError naming the limit, not a bare OSError, and the sender still owns its fd."""
    a, b = pair
    report_r, report_w = os.pipe()

    def child() -> int:
        os.close(report_r)
        b.close()
        if os.geteuid() == 0:  # root has CAP_SYS_RESOURCE, which lifts the kernel's limit
            os.setgid(65534)
            os.setuid(65534)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        fd = os.memfd_create("inflight", os.MFD_CLOEXEC)
        try:
            for i in range(500):
                send_message(a, {"i": i}, fd, timeout=5)
        except errors.FdsInFlightError as exc:
            os.fstat(fd)  # still ours
            os.write(report_w, f"{i} {exc}".encode())
            return 0
        os.write(report_w, b"all 500 sent")
        return 1

    pid = fork_child(child)
    os.close(report_w)
    ended = wait_child(pid, 60)
    with os.fdopen(report_r) as fh:
        report = fh.read()
    assert ended.ok, report
    sent, _, text = report.partition(" ")
    assert 60 <= int(sent) <= 70
    assert "ETOOMANYREFS" in text and "RLIMIT_NOFILE soft limit of 64" in text and "not reading" in text
    b.setblocking(False)
    while True:  # drain what the child queued, closing every fd
        try:
            msg, fds = recv_message(b, timeout=0.5)
        except (errors.WaitTimeoutError, errors.PeerClosedError):
            break
        for fd in fds:
            os.close(fd)


def test_a_socket_in_timeout_mode_still_obeys_the_calls_own_timeout():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(30)  # CPython would wait 30 s inside recvmsg if called before the data is there
        t = time.monotonic()
        with pytest.raises(errors.WaitTimeoutError):
            recv_message(b, 0.2)
        assert time.monotonic() - t < 5
        send_message(a, {"k": 1})
        assert recv_message(b, 5) == ({"k": 1}, [])
