"""FrameReader: messages read through a buffer, fds matched to the message they rode on (CPU, real sockets)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from dmabuf_interop import errors
from dmabuf_interop.fdpass import FrameReader, encode_message, recv_message, send_message

HEADER = struct.Struct(">I")

pytestmark = pytest.mark.usefixtures("no_fd_leak")


def _memfd(tag: int) -> int:
    fd = os.memfd_create(f"t{tag}", os.MFD_CLOEXEC)
    os.write(fd, str(tag).encode())
    return fd


def _tag(fd: int) -> int:
    return int(os.pread(fd, 16, 0))


def _reader(sock: socket.socket, **kw) -> FrameReader:
    kw.setdefault("max_fds", 4)
    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("rest_timeout", 5.0)
    return FrameReader(sock, **kw)


def test_a_burst_of_messages_arrives_in_order_with_each_fd_on_its_own_message(pair):
    """100 messages sent before the first read, every seventh with an fd: each arrives whole and in
    order, and each fd with the message it was sent with (fds end a read: unix_stream_read_generic)."""
    a, b = pair
    for i in range(100):
        if i % 7 == 3:
            fd = _memfd(i)
            send_message(a, {"i": i}, fd, timeout=5)
            os.close(fd)
        else:
            send_message(a, {"i": i, "pad": "x" * (i * 5)}, timeout=5)
    r = _reader(b)
    for i in range(100):
        msg, fds = r.read(5)
        assert msg["i"] == i
        assert [_tag(fd) for fd in fds] == ([i] if i % 7 == 3 else [])
        for fd in fds:
            os.close(fd)
    assert r.pending_fds() == 0
    with pytest.raises(errors.WaitTimeoutError):
        r.read(0)  # nothing left, nothing begun: not broken
    send_message(a, {"after": True}, timeout=5)
    assert r.read(5) == ({"after": True}, [])


def test_a_message_larger_than_the_buffer_arrives_in_pieces(pair):
    a, b = pair
    body = {"blob": "y" * 300_000}
    frame = encode_message(body, 1 << 20)

    def trickle():
        for k in range(0, len(frame), 50_000):
            a.sendall(frame[k:k + 50_000])
            time.sleep(0.01)
        send_message(a, {"next": 1}, timeout=5)

    t = threading.Thread(target=trickle)
    t.start()
    r = _reader(b, bufsize=4096)
    assert r.read(5) == (body, [])
    assert r.read(5) == ({"next": 1}, [])
    t.join()


def test_fds_that_arrive_where_no_message_begins_are_refused_and_closed(pair):
    a, b = pair
    fd = _memfd(1)
    a.sendall(HEADER.pack(20) + b'{"x": ')

    def rest():
        time.sleep(0.2)  # after the reader has the first part
        socket.send_fds(a, [b'1' + b' ' * 12 + b'}'], [fd])

    t = threading.Thread(target=rest)
    t.start()
    r = _reader(b)
    with pytest.raises(errors.ProtocolError, match="after the first byte"):
        r.read(5)
    t.join()
    os.close(fd)
    with pytest.raises(errors.ProtocolError, match="cut off in the middle"):
        r.read(0)


def test_a_message_cut_off_marks_the_connection_broken_and_discard_closes_its_fds(pair):
    a, b = pair
    fd = _memfd(2)
    socket.send_fds(a, [HEADER.pack(100) + b"{"], [fd])  # the rest never comes
    os.close(fd)
    r = _reader(b, rest_timeout=0.2)
    with pytest.raises(errors.WaitTimeoutError, match="the rest of a message"):
        r.read(5)  # the caller's 5 s do not matter once a message has begun
    assert r.pending_fds() == 1
    with pytest.raises(errors.ProtocolError, match="cut off in the middle"):
        r.read(5)
    r.discard()
    assert r.pending_fds() == 0


@pytest.mark.parametrize("begun", [False, True])
def test_end_of_stream(pair, begun):
    a, b = pair
    if begun:
        a.sendall(HEADER.pack(10) + b"{")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(errors.PeerClosedError, match="in the middle" if begun else "before sending"):
        _reader(b).read(5)


def test_a_message_rejected_after_its_whole_frame_leaves_the_reader_in_step(pair):
    a, b = pair
    fds = [_memfd(3), _memfd(4)]
    a.sendall(HEADER.pack(6) + b'{"x": ')  # bad JSON
    socket.send_fds(a, [encode_message({"two": 1})], fds)  # more fds than allowed
    send_message(a, {"ok": 1}, timeout=5)
    for fd in fds:
        os.close(fd)
    r = _reader(b, max_fds=1)
    with pytest.raises(errors.ProtocolError, match="not UTF-8 JSON"):
        r.read(5)
    with pytest.raises(errors.ProtocolError, match="at most 1"):
        r.read(5)
    assert r.read(5) == ({"ok": 1}, [])


def test_a_length_over_the_limit_is_refused_before_the_body_is_read(pair):
    a, b = pair
    a.sendall(HEADER.pack(2000) + b"{}")
    with pytest.raises(errors.ProtocolError, match="more than 1000"):
        _reader(b, max_bytes=1000).read(5)


def test_what_recv_message_reads_first_is_not_read_again(pair):
    """A reader may take over a socket after unbuffered reads (the handshake), since those read exact frames."""
    a, b = pair
    send_message(a, {"hello": 1}, timeout=5)
    send_message(a, {"then": 2}, timeout=5)
    assert recv_message(b, 5) == ({"hello": 1}, [])
    assert _reader(b).read(5) == ({"then": 2}, [])


class _Interrupt(Exception):
    pass


def test_an_interrupted_wait_for_a_message_leaves_the_connection_usable(pair):
    """A signal handler's exception (as Ctrl-C's) while nothing has arrived loses nothing."""
    import signal

    a, b = pair
    r = _reader(b)

    def handler(*_):
        raise _Interrupt

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(_Interrupt):
            r.read(5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    send_message(a, {"hello": 1}, timeout=5)
    assert r.read(5) == ({"hello": 1}, [])


def test_an_interrupt_in_the_wait_for_the_rest_of_a_message(pair):
    """A reader that lives on keeps what came and goes on from there; recv_message, whose reader dies with what it
    read, marks the socket out of step (its next call raises instead of reading from the middle of a frame)."""
    import signal

    a, b = pair
    frame = encode_message({"first": "x" * 40})
    second = encode_message({"second": 2})

    def handler(*_):
        raise KeyboardInterrupt  # (not an Exception, as a signal handler's is)

    old = signal.signal(signal.SIGALRM, handler)
    try:
        r = _reader(b)
        a.sendall(frame[:10])  # the header and a few bytes of the body
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            r.read(5)
        a.sendall(frame[10:] + second)
        assert r.read(5) == ({"first": "x" * 40}, []) and r.read(5) == ({"second": 2}, [])
        a.sendall(frame[:10])
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            recv_message(b, timeout=5, max_fds=0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    a.sendall(frame[10:] + second)
    with pytest.raises(errors.ProtocolError, match="out of step|cut off"):
        recv_message(b, timeout=5, max_fds=0)


def test_fds_truncated_at_the_fd_limit_fail_their_own_message_only(pair):
    """A, then B with 3 fds, then C, read by a process with room for one more fd: A arrives, B raises
    FdLimitError (the fd that came is closed), C arrives, as with recv_message."""
    import resource

    a, b = pair
    fds = [_memfd(i) for i in range(3)]
    send_message(a, {"m": "A"}, timeout=5)
    send_message(a, {"m": "B"}, fds, timeout=5)
    send_message(a, {"m": "C"}, timeout=5)
    for fd in fds:
        os.close(fd)
    r = _reader(b)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(x) for x in os.listdir("/proc/self/fd"))
    fillers = []
    while True:  # fill every free number below the highest open fd
        fd = os.dup(0)
        if fd > top:
            os.close(fd)
            break
        fillers.append(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 2, hard))  # room for 1 of the 3 fds
    try:
        got = [r.read(5)]
        with pytest.raises(errors.FdLimitError):
            r.read(5)
        got.append(r.read(5))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)
    assert got == [({"m": "A"}, []), ({"m": "C"}, [])]


def test_a_reader_dropped_with_buffered_fds_closes_them(pair):
    import gc

    a, b = pair
    fd = _memfd(5)
    socket.send_fds(a, [HEADER.pack(100) + b"{"], [fd])  # a message begun, its rest not yet here
    os.close(fd)
    r = _reader(b, rest_timeout=0.1)
    with pytest.raises(errors.WaitTimeoutError):
        r.read(5)
    assert r.pending_fds() == 1
    del r
    gc.collect()  # the fixture checks the fd went


def test_a_reader_that_waits_polls_first_and_one_that_finds_data_tries_first(pair):
    """A read that found the socket empty makes the next poll before its recvmsg (no EAGAIN per message
    for a consumer ahead of its producer); a read that finds more than one message waiting goes back to
    trying first. Every message arrives whole, in order, either way; a timed-out wait leaves the mode."""
    a, b = pair
    reader = _reader(b)
    assert not reader._poll_first
    for i in range(3):
        threading.Timer(0.05, send_message, (a, {"i": i})).start()
        assert reader.read(5.0) == ({"i": i}, [])
        assert reader._poll_first  # it waited for the message
    with pytest.raises(errors.WaitTimeoutError):
        reader.read(0.01)
    assert reader._poll_first
    send_message(a, {"i": 3})
    send_message(a, {"i": 4})
    time.sleep(0.01)
    assert reader.read(5.0) == ({"i": 3}, [])  # both came in one recvmsg: behind the producer
    assert not reader._poll_first
    assert reader.read(5.0) == ({"i": 4}, [])  # from the buffer
    send_message(a, {"i": 5})
    assert reader.read(5.0) == ({"i": 5}, [])  # tried first: one recvmsg, the mode kept
    assert not reader._poll_first
