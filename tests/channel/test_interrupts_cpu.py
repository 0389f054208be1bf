"""A signal handler that raises (Ctrl-C's KeyboardInterrupt) while a channel handles the peer's messages.

Where it lands in a wait, the channel stays as it was. Where it lands in a step that cannot be undone (a chunk
announced and not yet imported, an arrival taken and not yet held by a Received), the connection ends with a
LocalError that names the interruption, and every later call says so; nothing is left half made (Note
[interrupted handling], in dmabuf_interop.channel._reader). The windows are a few steps of Python wide, so the
first tests put the interruption there by making one step of ours raise it; the last fires real signals.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dmabuf_interop.channel import SharedPool, connect, listen
from dmabuf_interop.channel.received import Hold
from dmabuf_interop.errors import InvalidArgumentError, LocalError, PeerClosedError, ProtocolError, WaitTimeoutError


class Interrupt(BaseException):
    """What a signal handler raises (as KeyboardInterrupt is, not an Exception)."""


@pytest.fixture
def unraisable(monkeypatch):
    """Errors raised where nothing could catch them (a __del__), collected."""
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    return seen


@pytest.fixture
def pair(tmp_path: Path):
    pool = SharedPool(chunk_bytes=1 << 20, max_bytes=8 << 20)
    listener = listen(str(tmp_path / "ch.sock"), pool=pool)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("cons", connect(str(tmp_path / "ch.sock"), timeout=10)))
    t.start()
    prod = listener.accept(10)
    t.join(10)
    cons = box["cons"]
    yield pool, prod, cons
    cons.close()
    prod.close()
    listener.close()
    pool.close()


def _once(exc: BaseException, then):
    """A callable that raises ``exc`` at its first call and calls ``then`` after."""
    calls = [0]

    def call(*args, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise exc
        return then(*args, **kw)
    return call


def _ended_by_interrupt(cons, what: str) -> None:
    with pytest.raises(PeerClosedError) as info:
        cons.recv(5)
    cause = info.value.__cause__
    assert isinstance(cause, LocalError) and "Interrupt" in str(cause) and what in str(cause), cause


def test_an_interrupt_while_a_chunk_message_is_handled_ends_the_connection(pair, monkeypatch, unraisable) -> None:
    pool, prod, cons = pair
    monkeypatch.setattr(cons._carrier, "import_chunk", _once(Interrupt(), cons._carrier.import_chunk))
    a = pool.empty(8, "int64")
    a[:] = 7
    lease = prod.send(a)  # the chunk's first block: a chunk message, then the array
    with pytest.raises(Interrupt):
        cons.recv(5)
    _ended_by_interrupt(cons, "'chunk' message")
    lease.wait(5)
    assert lease.reason == "disconnected"
    with pytest.raises(PeerClosedError):
        cons.recv(0)  # and it stays so
    assert not unraisable


@pytest.mark.parametrize("path", ["lane", "queue"])
def test_an_interrupt_between_an_arrival_taken_and_its_received_ends_the_connection(pair, monkeypatch, unraisable,
                                                                                   path) -> None:
    """The arrival is lost to the caller: its lease would be held for good, so the connection ends and the
    peer completes it. Both the ring's lane (a block lent again, its Received made by the lane) and the queue's
    path (a repeat with meta, by the socket: the carrier's make_received) are taken."""
    from dmabuf_interop.channel import _reader

    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 1
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    if path == "lane":
        monkeypatch.setattr(_reader, "Received", _once(Interrupt(), _reader.Received))
        again = prod.send(a)  # a repeat through the ring
    else:
        monkeypatch.setattr(cons._carrier, "make_received", _once(Interrupt(), cons._carrier.make_received))
        again = prod.send(a, meta={"step": 1})  # a repeat by the socket
    with pytest.raises(Interrupt):
        cons.recv(5)
    _ended_by_interrupt(cons, "recv()")
    again.wait(5)
    assert again.reason == "disconnected" and first.reason == "released"
    assert not unraisable


def test_an_interrupt_while_recv_waits_leaves_the_channel_as_it_was(pair, unraisable) -> None:
    pool, prod, cons = pair

    def handler(signum, frame):
        raise Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        for spin in (0.0, 0.001):
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(Interrupt):
                cons.recv(5, spin=spin)  # nothing comes: the interrupt lands in the wait
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    a = pool.empty(8, "int64")
    a[:] = 3
    for _ in range(3):
        lease = prod.send(a)
        r = cons.recv(5)
        assert r.as_array().tolist() == [3] * 8
        r.release()
        lease.wait(5)
    assert lease.reason == "released" and not unraisable


def test_a_hold_whose_init_was_cut_short_gives_back_nothing(unraisable) -> None:
    hold = Hold.__new__(Hold)  # as a hold is when an interrupt lands before __init__'s first line
    del hold
    assert not unraisable


def test_interrupts_at_random_moments_never_leave_a_channel_half_made(tmp_path: Path, unraisable) -> None:
    """A producer thread lends arrays (new chunks, copies by the socket, blocks lent again through the ring)
    while SIGALRM interrupts the consuming main thread every few hundred microseconds. After each interrupt the
    consumer goes on: every array it gets is whole and in order, and a connection that ends says it was
    interrupted. Connections are made again until enough interrupts landed."""
    armed = [False]

    def handler(signum, frame):
        if armed[0]:  # (a signal delivered after the timer was disarmed raises nothing: the test's own steps)
            armed[0] = False
            raise Interrupt()

    landed = ended = arrays = 0
    old = signal.signal(signal.SIGALRM, handler)
    try:
        for round_ in range(6):
            pool = SharedPool(chunk_bytes=64 << 10, max_bytes=4 << 20)
            addr = str(tmp_path / f"r{round_}.sock")
            listener = listen(addr, pool=pool)
            box: dict = {}
            t = threading.Thread(target=lambda: box.setdefault("cons", connect(addr, timeout=10)))
            t.start()
            prod = listener.accept(10)
            t.join(10)
            cons = box["cons"]
            stop = threading.Event()

            def produce() -> None:
                blocks = [pool.empty(512, "int64") for _ in range(4)]
                leases = [None] * 4
                i = 0
                try:
                    while not stop.is_set():
                        i += 1
                        if i % 3 == 0:
                            prod.send(np.full(512, i, dtype=np.int64), timeout=5)  # copied into a new block
                        else:
                            k = i % 4
                            if leases[k] is not None:
                                leases[k].wait(5)
                            blocks[k][:] = i
                            leases[k] = prod.send(blocks[k], timeout=5)
                except (PeerClosedError, WaitTimeoutError):
                    pass

            pt = threading.Thread(target=produce)
            pt.start()
            last = 0
            deadline = time.monotonic() + 3
            try:
                while time.monotonic() < deadline:
                    try:
                        armed[0] = True
                        signal.setitimer(signal.ITIMER_REAL, random.uniform(50e-6, 1500e-6))
                        r = cons.recv(5)
                        v = r.as_array()
                        armed[0] = False
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        assert v.min() == v.max() > last  # whole, and after the one before
                        last = int(v[0])
                        del v
                        r.release()
                        arrays += 1
                    except Interrupt:
                        landed += 1
                    except PeerClosedError as exc:
                        armed[0] = False
                        assert isinstance(exc.__cause__, LocalError) and "interrupted" in str(exc.__cause__), exc
                        ended += 1
                        break
            finally:
                armed[0] = False
                stop.set()
                cons.close()
                pt.join(20)
                prod.close()
                listener.close()
                pool.close()
            assert not pt.is_alive()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert landed > 0 and arrays > 100, (landed, ended, arrays)
    # (An interrupt that lands in a weakref callback or a __del__ is reported by Python and dropped: not ours.)
    assert not [u for u in unraisable if u.exc_type is not Interrupt]


def _after(exc: BaseException, real):
    """A callable that calls ``real`` and then, the first time, raises ``exc``: an interrupt that lands as the
    call returns, its effect done."""
    calls = [0]

    def call(*args, **kw):
        out = real(*args, **kw)
        calls[0] += 1
        if calls[0] == 1:
            raise exc
        return out
    return call


def _producer_ended_by_interrupt(prod, block) -> None:
    with pytest.raises(PeerClosedError) as info:
        for _ in range(100):  # (the reader ends it as it sees the shutdown)
            prod.send(block, timeout=5)
            time.sleep(0.01)
    cause = info.value.__cause__
    assert isinstance(cause, LocalError) and "Interrupt" in str(cause), cause


@pytest.mark.parametrize("where", ["ring slot", "ring slot, general path", "socket message", "chunk announcement"])
def test_an_interrupt_after_a_send_went_out_and_before_its_lease_was_recorded_ends_the_connection(
        pair, monkeypatch, unraisable, where) -> None:
    """Else the peer's release of it would be one this end calls forged (a ProtocolError blaming the peer),
    or a chunk or layout would be announced twice. A ring slot goes out by the host lane's publish, or (a send
    with an ordering asked: not the lane's case) by the general path's."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 5
    if where == "chunk announcement":
        monkeypatch.setattr(prod._proto, "chunk_announced", _after(Interrupt(), prod._proto.chunk_announced))
    else:
        first = prod.send(a)  # the chunk and the layout, by the socket
        cons.recv(5).release()
        first.wait(5)
        if where == "ring slot":
            monkeypatch.setattr(prod._rings, "push_host", _after(Interrupt(), prod._rings.push_host))
        elif where == "ring slot, general path":
            monkeypatch.setattr(prod._rings, "push_repeat", _after(Interrupt(), prod._rings.push_repeat))
        else:
            monkeypatch.setattr(prod._link, "send_locked", _after(Interrupt(), prod._link.send_locked))
    with pytest.raises(Interrupt):
        prod.send(a if where != "socket message" else np.full(8, 6), timeout=5,
                  ordering="sync" if where == "ring slot, general path" else None)
    _producer_ended_by_interrupt(prod, a)
    # The consumer sees the end, never a broken protocol.
    with pytest.raises(PeerClosedError) as info:
        for _ in range(3):
            cons.recv(5).release()
    assert not isinstance(info.value.__cause__, ProtocolError), info.value.__cause__
    assert not unraisable


@pytest.mark.parametrize("path", ["lane", "general path"])
def test_an_error_after_a_slot_went_out_and_before_its_lease_was_recorded_ends_the_connection(
        pair, monkeypatch, unraisable, path) -> None:
    """Not only an interrupt: any exception between the publish and the record (here the lease's making, as a
    MemoryError would) ends the connection, and the block keeps its reference, since the peer may be reading it.
    Else the peer's release would be a forged one here, blaming the peer."""
    from dmabuf_interop.channel import _lending

    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 5
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    block = prod._memos.single_again(a).blocks[0]
    block.pool._unref_many([block])  # (the lookup's own reference)
    refs = block.refs
    monkeypatch.setattr(_lending, "Lease", _once(MemoryError("no memory"), _lending.Lease))
    with pytest.raises(MemoryError):
        prod.send(a, timeout=5, ordering="sync" if path == "general path" else None)
    assert block.refs == refs + 1  # (kept: the slot is out)
    with pytest.raises(PeerClosedError) as info:
        for _ in range(100):  # (the reader ends it as it sees the shutdown)
            prod.send(a, timeout=5)
            time.sleep(0.01)
    cause = info.value.__cause__
    assert isinstance(cause, LocalError) and "MemoryError" in str(cause), cause
    with pytest.raises(PeerClosedError) as info:
        for _ in range(3):
            cons.recv(5).release()
    assert not isinstance(info.value.__cause__, ProtocolError), info.value.__cause__
    assert not unraisable


def _hold_send_lock(ch) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds ``ch``'s send lock until the event is set (as a send waiting for a slow peer)."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            assert ch._link.lock.acquire(timeout=5)
            taken.set()
            done.wait(30)
        finally:
            ch._link.release()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(5)
    return t, done


class _InterruptAfterTake:
    """The send lock, with an interrupt landing right after one take of it succeeded (``arm`` takes to let by
    first): where a signal handler can run between the take and the ``try`` that would let it go."""

    def __init__(self, lock, arm: int = 0) -> None:
        self.lock, self.arm = lock, arm

    def acquire(self, *args):
        got = self.lock.acquire(*args)
        if got and self.arm == 0:
            self.arm = -1
            raise Interrupt()
        self.arm -= 1
        return got

    def __getattr__(self, name: str):
        return getattr(self.lock, name)


def _free(ch) -> bool:
    """Whether another thread can take ``ch``'s send lock now."""
    out: list = []

    def take() -> None:
        got = ch._link.lock.acquire(False)
        out.append(got)
        if got:
            ch._link.lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join(5)
    return out == [True]


@pytest.mark.parametrize("where", ["send", "release", "close"])
def test_an_interrupt_right_after_the_send_lock_was_taken_leaves_it_free(pair, monkeypatch, unraisable,
                                                                         where) -> None:
    """Nothing was sent, and the lock is not left held: later sends go out and close() does not hang (it takes
    the lock to end the connection)."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 4
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    if where == "send":
        monkeypatch.setattr(prod._link, "lock", _InterruptAfterTake(prod._link.lock))
        with pytest.raises(Interrupt):
            prod.send(a, timeout=5)
        assert _free(prod) and prod._proto.error is None and prod.outstanding == 0
    elif where == "release":  # the consumer's release by the socket (no ring): its send lock
        monkeypatch.setattr(cons._link, "lock", _InterruptAfterTake(cons._link.lock))
        with pytest.raises(Interrupt):
            cons._link.send({"kind": "release", "leases": []})
        assert _free(cons)
    monkeypatch.undo()
    lease = prod.send(a, timeout=5)
    with cons.recv(5) as r:
        assert r.as_array().tolist() == [4] * 8
    lease.wait(5)
    assert lease.reason == "released"
    if where == "close":
        monkeypatch.setattr(prod._link, "lock", _InterruptAfterTake(prod._link.lock))
        with pytest.raises(Interrupt):
            prod.close(timeout=5)
        monkeypatch.undo()
        assert _free(prod)
    t0 = time.monotonic()
    prod.close(timeout=5)
    assert time.monotonic() - t0 < 3
    assert not unraisable


class _InterruptBeforeTake:
    """The send lock, with an interrupt landing in one take before it asked the lock anything."""

    def __init__(self, lock) -> None:
        self.lock, self.armed = lock, True

    def __getattr__(self, name: str):
        if self.armed:
            self.armed = False
            raise Interrupt()
        return getattr(self.lock, name)


def test_a_nested_send_cut_short_before_its_take_leaves_the_outer_send_its_hold(pair, monkeypatch,
                                                                              unraisable) -> None:
    """A second interrupt, inside a signal handler's send inside this thread's send, that the handler swallows:
    the outer send still holds the lock while it publishes, and a job deferred meanwhile runs only after it."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 3
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    seen: dict = {}
    push = prod._rings.push_host
    lock = prod._link.lock

    def nested(*args):
        prod._link.defer(lambda: seen.setdefault("job ran while the outer send held", prod._link.held_here()
                                                 and "published" in seen))
        prod._link.lock = _InterruptBeforeTake(lock)
        try:
            prod.send(np.full(8, 9), timeout=5)
        except Interrupt:
            seen["nested"] = "interrupted"
        finally:
            prod._link.lock = lock
        try:
            prod.send(np.full(8, 9), timeout=5)  # not interrupted: refused at once
        except InvalidArgumentError as exc:
            seen["refused"] = "own send" in str(exc)
        seen["held"], seen["free"] = prod._link.held_here(), _free(prod)
        got = push(*args)
        seen["published"] = True
        return got

    monkeypatch.setattr(prod._rings, "push_host", nested)
    lease = prod.send(a, timeout=5)
    monkeypatch.undo()
    assert seen["nested"] == "interrupted" and seen["refused"] and seen["held"] and not seen["free"], seen
    assert seen["job ran while the outer send held"] is True, seen  # after the outer send, in its release
    cons.recv(5).release()
    lease.wait(5)
    assert lease.reason == "released" and not unraisable


def test_releases_flushed_inside_this_threads_own_send_go_out_after_it(pair, unraisable) -> None:
    """A recv or release in a signal handler that interrupted this thread's send: the flush cannot send (the
    send lock is this thread's), so the releases wait for the flusher, and the peer's lease completes."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 5
    lease = prod.send(a)
    r = cons.recv(5)
    link, queue = cons._link, cons._releases
    with cons._state:
        assert cons._proto.released(r._hold.lease_id)
        r._hold.alive = False  # (its release is the one queued here)
        queue.pending.append(r._hold.lease_id)
    assert link.lock.acquire(timeout=5)  # as this thread's own send holds it
    try:
        queue.flush()  # what recv() does before it waits
        assert queue.pending == [r._hold.lease_id]  # kept, not dropped
    finally:
        link.release()
    lease.wait(5)
    assert lease.reason == "released" and not unraisable


@pytest.mark.parametrize("inner", ["new array", "repeat"])
def test_a_send_from_inside_this_threads_own_send_is_refused_and_the_first_goes_on(pair, monkeypatch, unraisable,
                                                                                   inner) -> None:
    """As a signal handler's send inside the main thread's send: refused at once (its message would interleave
    with the one half sent), and the first send completes under its lock. The inner send is a new array's (a
    definition by the socket) or a block's sent before (the steady-state lane's inline take)."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 3
    b = pool.empty(8, "int64")
    b[:] = 9
    for x in (a, b):
        first = prod.send(x)
        cons.recv(5).release()
        first.wait(5)
    refused: list = []
    still_held: list = []
    push = prod._rings.push_host

    def nested(*args):
        try:
            prod.send(np.full(8, 9) if inner == "new array" else b, timeout=5)
        except Exception as exc:  # noqa: BLE001 - kept for the assertion
            refused.append(exc)
        still_held.append(prod._link.held_here())  # the refusal let go of nothing: the outer send still holds it
        return push(*args)

    monkeypatch.setattr(prod._rings, "push_host", nested)
    t0 = time.monotonic()
    lease = prod.send(a, timeout=5)
    monkeypatch.undo()
    assert time.monotonic() - t0 < 2
    assert len(refused) == 1 and "own send" in str(refused[0]), refused
    assert still_held == [True]
    assert _free(prod)
    with cons.recv(5) as r:
        assert r.as_array().tolist() == [3] * 8
    lease.wait(5)
    lease = prod.send(a, timeout=5)  # the channel goes on
    cons.recv(5).release()
    lease.wait(5)
    assert not unraisable


def test_an_interrupt_while_a_send_waits_for_the_send_lock_leaves_the_channel_as_it_was(pair, unraisable) -> None:
    """Nothing of its message went out (another thread's send holds the connection): its lease is given back,
    and the channel goes on. (A send that waits for room in a full socket has most often sent part of its
    message already: an interrupt there ends the connection, the stream being out of step.)"""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    a[:] = 1
    held, done = _hold_send_lock(prod)  # as a send in another thread holds it, waiting for a slow peer

    def handler(signum, frame):
        raise Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(Interrupt):
            prod.send(np.full(8, 2), timeout=30)  # waits for the send lock
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        done.set()
        held.join(5)
    assert prod._proto.error is None and prod.outstanding == 0
    lease = prod.send(a, timeout=10)
    r = cons.recv(10)
    assert r.as_array().tolist() == [1] * 8
    r.release()
    lease.wait(10)
    assert lease.reason == "released" and not unraisable


def test_an_interrupt_as_a_release_goes_out_ends_the_connection_and_the_lease_completes(pair, monkeypatch,
                                                                                      unraisable) -> None:
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    lease = prod.send(a)
    r = cons.recv(5)
    monkeypatch.setattr(cons._conn.rings, "push_releases", _once(Interrupt(), cons._conn.rings.push_releases))
    with pytest.raises(Interrupt):
        r.release()  # the release forgotten here, and not out
    _ended_by_interrupt(cons, "release")
    lease.wait(5)
    assert lease.reason == "disconnected" and not unraisable


def test_an_interrupt_as_a_lease_completes_and_counts_its_waiter_out_still_wakes_the_waiter(pair, monkeypatch,
                                                                                          unraisable) -> None:
    """A thread waits on a lease; the thread that completes it (here the main thread, as a signal handler's
    exception can land only there) is interrupted as it counts the waiter out: the lease is done all the same
    and its waiter wakes at once, not at its timeout."""
    pool, prod, cons = pair
    a = pool.empty(8, "int64")
    first = prod.send(a)
    cons.recv(5).release()
    first.wait(5)
    lease = prod.send(a)
    r = cons.recv(5)
    woke: list = []
    waiter = threading.Thread(target=lambda: (lease.wait(5), woke.append(time.monotonic())), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 5
    while lease._waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lease._waiters == 1
    waits = type(lease._waits)
    monkeypatch.setattr(waits, "completed", _once(Interrupt(), waits.completed))
    t0 = time.monotonic()
    with pytest.raises(Interrupt):
        lease._complete("released")  # as the completing thread does, with the peer's release taken
    waiter.join(2)
    assert woke and woke[0] - t0 < 1, "the waiter slept on to its timeout"
    assert lease.done and lease.reason == "released"
    r.release()  # the peer's release of a lease already complete changes nothing
    lease2 = prod.send(a, timeout=5)  # the channel goes on
    cons.recv(5).release()
    lease2.wait(5)
    assert not unraisable
