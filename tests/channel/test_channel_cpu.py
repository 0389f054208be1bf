"""Channels over host pools: real sockets, real processes, no mocks."""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel import SharedPool, connect, listen, release_all
from dmabuf_interop.errors import (ClosedError, CudaError, InvalidArgumentError, NoDriverError, PeerClosedError,
                                   PeerRefusedError, PoolExhaustedError, WaitTimeoutError)
from dmabuf_interop.fd import open_fds

from tests.helpers import env_with_src

PEER = str(Path(__file__).with_name("peer.py"))
ROOT = Path(__file__).resolve().parents[2]


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, PEER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_with_src(), start_new_session=True)


def in_thread(fn):
    """Run ``fn`` in a thread; returns a getter that joins and returns its result or raises its error."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def get(timeout: float = 30):
        t.join(timeout)
        assert not t.is_alive(), "thread did not finish"
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    return get


@pytest.fixture
def addr(tmp_path: Path) -> str:
    return str(tmp_path / "chan.sock")


@pytest.fixture
def pool():
    with SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20) as p:
        yield p


def pair(addr: str, pool: SharedPool, **kw):
    listener = listen(addr, pool=pool, **kw)
    get = in_thread(lambda: connect(addr, timeout=10))
    prod = listener.accept(10)
    return listener, prod, get()


# --- rendezvous ----------------------------------------------------------------------

def test_path_socket_is_owner_only_unlinked_and_never_clobbers(tmp_path: Path, pool: SharedPool) -> None:
    path = tmp_path / "s.sock"
    listener, prod, cons = pair(str(path), pool)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert prod.peer.uid == os.geteuid() and prod.peer.pid == os.getpid()
    with pytest.raises(InvalidArgumentError, match="listening"):
        listen(str(path))
    cons.close()
    prod.close()
    listener.close()
    assert not path.exists()
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="not a socket"):
        listen(str(regular))
    assert regular.read_text() == "keep me"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # the file stays, nobody listens
    with listen(str(tmp_path / "stale.sock")):
        pass


def test_abstract_address(pool: SharedPool) -> None:
    name = f"@dmabuf-interop-test-{os.getpid()}"
    listener, prod, cons = pair(name, pool)
    lease = prod.send(np.arange(5))
    with cons.recv(5) as r:
        assert r.as_array().tolist() == [0, 1, 2, 3, 4]
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_peer_credentials_refused_on_both_sides_and_listener_keeps_serving(addr: str) -> None:
    other = os.geteuid() + 12345
    with listen(addr, allow_uids=[other]) as listener:
        for _ in range(2):
            get = in_thread(lambda: connect(addr, timeout=10))
            with pytest.raises(PeerRefusedError, match=f"uid {os.geteuid()}"):
                listener.accept(10, raise_refused=True)
            with pytest.raises(PeerRefusedError, match="not allowed"):
                get()
        with pytest.raises(WaitTimeoutError):
            listener.accept(0.1)
        # Not asked for, a refusal is counted and the wait goes on.
        get = in_thread(lambda: connect(addr, timeout=10))
        with pytest.raises(WaitTimeoutError):
            listener.accept(1)
        with pytest.raises(PeerRefusedError, match="not allowed"):
            get()
        assert listener.refused == 3
    with listen(addr, allow_uids=[other], allow_gids=[os.getegid()]) as listener:  # a gid widens it
        get = in_thread(lambda: connect(addr, timeout=10))
        listener.accept(10).close()
        get().close()


@pytest.mark.parametrize("kw, text", [({"allow_uids": "0"}, "allow_uids must be an iterable"),
                                      ({"allow_uids": 1000}, "allow_uids must be an iterable"),
                                      ({"allow_uids": ["1000"]}, "each of allow_uids must be an integer"),
                                      ({"allow_gids": [-1]}, "allow_gids must be ids >= 0"),
                                      ({"pool": 5}, "pool must be a SharedPool")])
def test_listen_and_connect_refuse_bad_uid_sets_and_pools_at_the_call(addr: str, kw: dict, text: str) -> None:
    # A string of digits was taken as a set of characters (every peer refused, the refusal naming
    # ['0'] as if it were uid 0); a pool that is not a SharedPool failed every handshake in the listener.
    before = open_fds()
    with pytest.raises(InvalidArgumentError, match=text):
        listen(addr, **kw)
    assert not os.path.exists(addr) and open_fds() == before
    with listen(addr) as listener:
        get = in_thread(lambda: listener.accept(10))
        with pytest.raises(InvalidArgumentError, match=text):
            connect(addr, timeout=10, **kw)
        with connect(addr, timeout=10, allow_uids=[os.geteuid()]) as cons, get() as prod:  # still serving
            prod.send(np.arange(3))
            with cons.recv(10) as r:
                assert r.as_array().tolist() == [0, 1, 2]


@pytest.mark.parametrize("override, text", [({"protocol": 99}, "protocol version mismatch"),
                                            ({"boot_id": "00000000-another-host"}, "peer is on another host")])
def test_handshake_mismatch_refused(addr: str, override: dict, text: str) -> None:
    with listen(addr) as listener:
        get = in_thread(lambda: connect(addr, timeout=10, hello_overrides=override))
        with pytest.raises(PeerRefusedError, match=text):
            listener.accept(10, raise_refused=True)
        with pytest.raises(PeerRefusedError, match=text):
            get()
    with listen(addr, hello_overrides=override) as listener:  # the listener's side differs
        get = in_thread(lambda: connect(addr, timeout=10))
        with pytest.raises(PeerRefusedError, match=text):
            listener.accept(10, raise_refused=True)
        with pytest.raises(PeerRefusedError, match=text):
            get()


# --- arrays -------------------------------------------------------------------------------

def mixed_arrays(pool: SharedPool) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = []
    for dtype in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                  "float32", "float64", "complex64", "complex128"):
        base = (rng.standard_normal((6, 10)) * 50).astype(dtype)
        out.append(base)  # copy path, contiguous
        out.append(base[::2, 1::3])  # copy path, strided
        out.append(base[::-1])  # copy path, negative strides (copied C-contiguous)
        z = pool.empty((6, 10), dtype)
        z[...] = base
        out.append(z)  # zero-copy
        out.append(z[1:, ::2])  # zero-copy, non-contiguous view with a byte offset
        out.append(z.T)  # zero-copy, Fortran order
    out.append(np.float32(3.5) * np.ones(()))  # 0-d
    out.append(np.zeros((0, 4), "float32"))  # empty
    return out


def test_many_mixed_arrays_verified_by_another_process(addr: str, pool: SharedPool) -> None:
    arrays = mixed_arrays(pool)
    with listen(addr, pool=pool) as listener:
        proc = start("consumer-verify", addr, str(len(arrays)))
        with listener.accept(30) as ch:
            leases = [ch.send(a, meta={"sha256": digest(a), "shape": list(a.shape), "dtype": a.dtype.name})
                      for a in arrays]
            for lease in leases:
                lease.wait(30)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["good"] == summary["n"] == len(arrays)


def test_zero_copy_shares_pages_and_copy_does_not(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    z = pool.empty(8, "int32")
    z[:] = 1
    used = pool.used_bytes
    lease = prod.send(z)
    assert pool.used_bytes == used  # no new block: zero-copy
    with cons.recv(5) as r:
        r.as_array()[:] = 42  # the consumer writes the producer's pages
    lease.wait(5)
    assert z.tolist() == [42] * 8
    src = np.ones(8, "int32")
    lease = prod.send(src)
    assert pool.used_bytes > used  # copied into a new block
    with cons.recv(5) as r:
        r.as_array()[:] = 42
    lease.wait(5)
    assert src.tolist() == [1] * 8
    assert pool.used_bytes == used
    for x in (cons, prod, listener):
        x.close()


def test_a_host_view_and_views_of_it_keep_the_lease_out_until_the_last_is_gone(addr: str, pool: SharedPool) -> None:
    """A dropped Received whose NumPy array (or a view cut from it) still lives is not released by the safety net:
    the array's base holds the Received; the lease completes once the last of them is collected."""
    listener, prod, cons = pair(addr, pool)
    lease = prod.send(np.arange(64, dtype=np.float32).reshape(8, 8))
    r = cons.recv(5)
    arr = r.as_array()
    assert arr.dtype == np.float32 and arr.shape == (8, 8) and arr.flags.writeable
    part = arr[2:, ::3]
    assert part.tolist() == np.arange(64, dtype=np.float32).reshape(8, 8)[2:, ::3].tolist()
    del r, arr
    gc.collect()
    time.sleep(0.05)
    assert not lease.done
    del part
    gc.collect()
    lease.wait(2)
    assert lease.reason == "released"


def test_a_chunk_the_peer_sealed_against_writing_arrives_as_read_only_arrays(addr: str) -> None:
    """A producer that seals its chunk's memfd against writing (F_SEAL_FUTURE_WRITE) before announcing it gets it
    mapped read-only here: its arrays read, and a write raises ValueError instead of killing the process."""
    import fcntl

    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
        listener, prod, cons = pair(addr, pool)
        a = pool.empty(8, "float32")
        a[:] = 7
        with pool._chunks[0].fds() as fds:  # (the hostile part: a seal the pool never adds)
            fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, 0x10)  # F_SEAL_FUTURE_WRITE
        for _ in range(2):  # the chunk's first array (a definition), then a repeat (the ring's steady state)
            lease = prod.send(a)
            with cons.recv(5) as r:
                x = r.as_array()
                assert x.tolist() == [7.0] * 8 and not x.flags.writeable
                with pytest.raises(ValueError):
                    x[0] = 1.0
                del x
            lease.wait(5)
        for c in (cons, prod, listener):
            c.close()


def test_lease_completes_on_release_and_block_returns(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    lease = prod.send(np.arange(100))
    r = cons.recv(5)
    time.sleep(0.05)
    assert not lease.done and prod.outstanding == 1 and pool.used_bytes > 0
    with pytest.raises(WaitTimeoutError):
        lease.wait(0.05)
    r.release()
    lease.wait(2)
    assert lease.reason == "released" and pool.used_bytes == 0
    with pytest.raises(InvalidArgumentError, match="released"):
        r.as_array()
    # the safety net: a dropped Received releases its block
    lease = prod.send(np.arange(100))
    r = cons.recv(5)
    del r
    gc.collect()
    lease.wait(2)
    # send_many: one message, one lease over every item
    lease = prod.send_many({"a": np.arange(3), "b": np.ones((2, 2))}, meta={"step": 1})
    got = cons.recv_many(5)
    assert sorted(got) == ["a", "b"] and got["a"].meta == {"step": 1}
    got["a"].release()
    time.sleep(0.05)
    assert not lease.done
    got["b"].release()
    lease.wait(2)
    # release_all: a whole batch at once (host items: nothing to synchronise)
    lease = prod.send_many([np.arange(4), np.zeros(3), np.ones(2)])
    got = cons.recv_many(5)
    assert [r.shape for r in got] == [(4,), (3,), (2,)]
    release_all(got)
    assert all(r.released for r in got)
    lease.wait(2)
    for x in (cons, prod, listener):
        x.close()


def test_pool_exhaustion_waits_then_raises(addr: str) -> None:
    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 16) as small:
        listener, prod, cons = pair(addr, small)
        lease = prod.send(np.zeros(1 << 14, "int32"))  # the whole pool
        r = cons.recv(5)
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError):
            prod.send(np.zeros(16, "int32"), timeout=0.3)
        assert time.monotonic() - t0 >= 0.29
        threading.Timer(0.2, r.release).start()
        lease2 = prod.send(np.zeros(16, "int32"), timeout=5)  # waits for the release
        assert lease.done
        cons.recv(5).release()
        lease2.wait(5)
        with pytest.raises(InvalidArgumentError, match="never fit"):
            small.alloc(1 << 17)
        for x in (cons, prod, listener):
            x.close()


@pytest.mark.parametrize("shape, dtype, text", [((2,), "float33", "'float33' is neither a NumPy dtype"),
                                                ((2,), 5, "5 is neither a NumPy dtype"),
                                                (None, "float32", "shape must be non-negative ints, got None"),
                                                (2.0, "float32", "shape must be non-negative ints, got 2.0")])
def test_pool_empty_refuses_what_is_not_a_dtype_or_a_shape_with_invalid_argument(shape, dtype, text) -> None:
    # NumPy's own TypeError ("data type 'float33' not understood", "'NoneType' object is not iterable")
    # came out of pool.empty, whose documented error is InvalidArgumentError.
    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 16) as pool:
        with pytest.raises(InvalidArgumentError, match=text):
            pool.empty(shape, dtype)
        assert pool.used_bytes == 0  # refused before a block was taken
        assert pool.empty(np.int64(3), "float32").shape == (3,)  # a NumPy integer is a 1-D shape, as an int


def test_a_raw_block_is_given_back_by_free_and_one_still_held_is_refused() -> None:
    # A raw block dropped without free stays allocated until close: two of them filled this pool for good.
    with SharedPool(chunk_bytes=1 << 20, max_bytes=2 << 20) as pool, SharedPool(chunk_bytes=1 << 20) as other:
        a, b = pool.alloc(1 << 20), pool.alloc(1 << 20)
        with pytest.raises(PoolExhaustedError):
            pool.alloc(1 << 20, timeout=0.05)
        pool.free(a)
        pool.free(a)  # given back already: nothing happens
        assert pool.used_bytes == 1 << 20
        c = pool.alloc(1 << 20, timeout=0.05)  # the room came back
        assert (c.chunk, c.offset) == (a.chunk, a.offset)
        pool.free(b)
        pool.free(c)
        assert pool.used_bytes == 0 and pool.trim() == 2  # both chunks idle again: retired
        arr = pool.empty(16, "uint8")
        held = pool.find(arr.ctypes.data, 16)
        with pytest.raises(InvalidArgumentError, match="still held"):
            pool.free(held)  # the array's block goes back with the array
        with pytest.raises(InvalidArgumentError, match="of this pool"):
            other.free(held)
        del arr
        assert pool.used_bytes == 0
        d = pool.alloc(64)
    pool.free(d)  # after close: nothing to give back


def test_a_negative_backlog_release_all_of_none_and_a_closed_pool_reentered_are_refused(addr: str) -> None:
    # listen(2) took -1 as 0 without a word; release_all(None) raised TypeError; `with` on a closed pool
    # handed the closed pool back, to fail at its first use.
    with pytest.raises(InvalidArgumentError, match="backlog must be an int >= 0"):
        listen(addr, backlog=-1)
    assert not os.path.exists(addr)  # refused before anything was bound
    with pytest.raises(InvalidArgumentError, match="release_all takes a batch"):
        release_all(None)
    release_all([])  # an empty batch: nothing to do
    pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 16)
    pool.close()
    with pytest.raises(InvalidArgumentError, match="the pool is closed"):
        with pool:
            pass


# --- peers dying --------------------------------------------------------------------------

def test_find_among_twenty_thousand_live_blocks() -> None:
    # find bisects a sorted offset list kept up to date by alloc and free, never re-sorting per call
    with SharedPool(chunk_bytes=8 << 20, max_bytes=8 << 20) as p:
        blocks = [p.alloc(200) for _ in range(20_000)]
        for b in blocks:
            p._ref(b)  # a raw alloc has no user yet; hold it as pool.empty's array would
        for b in blocks:
            assert p.find(b.ptr, b.size) is b
            assert p.find(b.ptr + 100, 4) is b
            assert p.find(b.ptr + 200, b.size) is None  # straddles into the next block
        for b in blocks[::2]:
            p._unref(b)
        for i, b in enumerate(blocks):
            assert p.find(b.ptr, 4) is (None if i % 2 == 0 else b)
        again = p.alloc(200)  # first fit: the lowest freed offset
        p._ref(again)
        assert again.offset == blocks[0].offset and p.find(blocks[0].ptr, 4) is again
        assert p.used_bytes == 10_001 * 256


def test_consumer_sigkill_releases_its_leases_and_listener_serves_the_next(addr: str, pool: SharedPool) -> None:
    with listen(addr, pool=pool) as listener:
        proc = start("consumer-hold", addr)
        ch = listener.accept(30)
        lease = ch.send(np.arange(10, dtype=np.int64))
        assert proc.stdout.readline().strip() == "held 45"
        other = ch.send(np.arange(10))  # queued but never received
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        lease.wait(1.0)
        other.wait(1.0)
        assert time.monotonic() - t0 < 1.0 and lease.reason == "disconnected"
        assert pool.used_bytes == 0
        with pytest.raises(PeerClosedError):
            ch.send(np.arange(3))
        ch.close()
        a = pool.empty(4, "int32")
        a[:] = [1, 2, 3, 4]
        proc = start("consumer-verify", addr, "1")
        with listener.accept(30) as ch2:
            ch2.send(a, meta={"sha256": digest(a), "shape": [4], "dtype": "int32"}).wait(30)
        out, err = proc.communicate(timeout=60)
        assert json.loads(out)["good"] == 1, err


def test_a_send_that_finds_the_peer_gone_raises_after_the_earlier_leases_completed(addr: str, pool: SharedPool) -> None:
    """Once a send has raised PeerClosedError, every lease lent before it says how it ended: the caller may look
    at ``reason`` at once (the reader thread completes them as it ends the connection, and the send waits for
    that end, bounded). Sends go as fast as they can after the kill, so one lands while the end is under way."""
    with listen(addr, pool=pool) as listener:
        for i in range(10):
            proc = start("consumer-hold", addr)
            ch = listener.accept(30)
            block = pool.empty(16, "int64")
            block[:] = 1
            lease = ch.send(block)
            assert proc.stdout.readline().strip() == "held 16"
            leases = [lease]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + 30
            with pytest.raises(PeerClosedError):
                while time.monotonic() < deadline:
                    # A repeat through the ring (which does not see the death itself), or a copy by the socket.
                    leases.append(ch.send(block if i % 2 else np.arange(3)))
            assert [x.reason for x in leases] == ["disconnected"] * len(leases) and all(x.done for x in leases)
            ch.close()
            proc.stdout.close()
            proc.stderr.close()


def test_producer_sigkill_held_block_stays_readable(addr: str) -> None:
    proc = start("producer-hold", addr)
    try:
        assert proc.stdout.readline().strip() == "listening"
        ch = connect(addr, timeout=30)
        r = ch.recv(30)
        assert proc.stdout.readline().strip() == "sent"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with pytest.raises(PeerClosedError):
            ch.recv(5)
        a = r.as_array()
        assert a.tolist() == list(range(1024))
        r.release()
        del a
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --- resources ----------------------------------------------------------------------------

def test_no_fd_leaks_and_ten_thousand_handoffs(addr: str) -> None:
    gc.collect()
    before = open_fds()
    with SharedPool(chunk_bytes=1 << 18, max_bytes=1 << 18) as p:  # one chunk: growth adds no fd mid-run
        listener, prod, cons = pair(addr, p)
        n = 10_000

        def consume() -> int:
            total = 0
            for _ in range(n):
                with cons.recv(30) as r:
                    total += int(r.as_array()[0])
            return total

        get = in_thread(consume)
        mid = None
        src = np.zeros(64, "int64")
        for i in range(n):
            src[0] = i
            prod.send(src, timeout=30)
            if i == 1000:
                mid = len(open_fds())
        assert get(120) == n * (n - 1) // 2
        assert len(open_fds()) == mid
        for x in (cons, prod, listener):
            x.close()
    gc.collect()
    assert open_fds() == before


def test_examples_run_as_two_unrelated_processes(tmp_path: Path) -> None:
    address = str(tmp_path / "example.sock")
    env = env_with_src()
    prod = subprocess.Popen([sys.executable, str(ROOT / "examples" / "producer.py"), "--address", address,
                             "--count", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cons = subprocess.run([sys.executable, str(ROOT / "examples" / "consumer.py"), "--address", address,
                           "--count", "3", "--timeout", "30"], capture_output=True, text=True, env=env, timeout=90)
    pout, perr = prod.communicate(timeout=60)
    assert cons.returncode == 0, cons.stderr
    assert cons.stdout.splitlines() == [f"consumer: array {i} int32[1024] ok" for i in range(3)] + ["consumer: done"]
    assert prod.returncode == 0, perr
    assert "producer: 3 arrays released" in pout


def test_accept_skips_connections_whose_peer_already_left(addr: str, pool: SharedPool) -> None:
    listener = listen(addr, pool=pool)
    with pytest.raises(InvalidArgumentError, match="someone is listening"):
        listen(addr)  # its liveness check connects, then leaves
    with pytest.raises(WaitTimeoutError, match="calling accept"):
        connect(addr, timeout=0.3)  # a client that gave up waiting for accept()
    got = in_thread(lambda: connect(addr, timeout=10))
    ch = listener.accept(10)  # the two dead connections are skipped, not raised
    cons = got()
    ch.send(np.arange(4))
    assert list(cons.recv(5).as_array()) == [0, 1, 2, 3]
    for x in (cons, ch, listener):
        x.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        listener.accept(1)


def test_listen_where_the_folder_is_missing_names_the_path(tmp_path: Path) -> None:
    from dmabuf_interop.errors import SyscallError

    where = tmp_path / "no-such-folder" / "w.sock"
    with pytest.raises(SyscallError) as info:
        listen(where)
    err = info.value
    assert (err.call, err.errno, err.filename) == ("bind", errno.ENOENT, str(where))
    assert str(where) in str(err) and "ENOENT" in str(err)


def test_closing_a_listener_wakes_a_thread_waiting_in_accept(addr: str, pool: SharedPool) -> None:
    listener = listen(addr, pool=pool)
    waiting = in_thread(lambda: listener.accept(None))
    time.sleep(0.3)
    listener.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        waiting(5)


def test_recv_timeout_zero_takes_what_has_arrived_and_negative_is_refused(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    with pytest.raises(WaitTimeoutError):
        cons.recv(0)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        cons.recv(-1)
    prod.send(np.arange(3))  # the chunk message, then the array: both read by one recv(0)
    time.sleep(0.2)
    with cons.recv(0) as r:
        assert list(r.as_array()) == [0, 1, 2]
    for x in (cons, prod, listener):
        x.close()


def test_send_many_refuses_what_the_receiver_would_refuse(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel.protocol import MAX_ITEMS

    listener, prod, cons = pair(addr, pool)
    one = pool.empty(4, "int32")
    for bad, text in (({}, "empty batch"), ([], "empty batch"), ({1: one, "1": one}, "str keys"),
                      ([one] * (MAX_ITEMS + 1), "at most")):
        with pytest.raises(InvalidArgumentError, match=text):
            prod.send_many(bad)
    lease = prod.send_many({"a": one})  # the channel is still up
    release_all(cons.recv_many(5).values())
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def round_trip(prod, cons, arrays, meta=None) -> tuple[dict, dict]:
    """One ``send_many`` -> ``recv_many`` -> ``release_all``, the lease waited for: each item's values
    (a NumPy copy) and meta, keyed as the batch is."""
    lease = prod.send_many(arrays, meta=meta)
    got = cons.recv_many(5)
    items = list(got.items() if isinstance(got, dict) else enumerate(got))
    out = ({k: np.array(r.as_array()) for k, r in items}, {k: r.meta for k, r in items})
    release_all([r for _, r in items])
    lease.wait(5)
    return out


def test_send_many_of_the_same_blocks_repeats_its_layout(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel.protocol import MAX_LAYOUTS

    listener, prod, cons = pair(addr, pool)
    state = {"w": pool.empty((4, 3), "int32"), "b": pool.empty(5, "float64")}
    for step in range(3):  # a trainer's loop: the same tensors, new values, every step
        state["w"][:] = step
        state["b"][:] = step / 2
        values, metas = round_trip(prod, cons, state, {"step": step})
        assert metas == {"w": {"step": step}, "b": None}
        assert (values["w"] == step).all() and (values["b"] == step / 2).all()
    assert len(prod.protocol_state.layouts_sent()) == len(cons.protocol_state.layouts_held()) == 1  # defined once, repeated twice
    # More layouts than either end remembers: the oldest is forgotten on both sides alike
    extra = [pool.empty(i + 1, "uint8") for i in range(MAX_LAYOUTS)]
    for a in extra:
        round_trip(prod, cons, [a])
    assert len(prod.protocol_state.layouts_sent()) == len(cons.protocol_state.layouts_held()) == MAX_LAYOUTS
    state["w"][:] = 7
    values, metas = round_trip(prod, cons, state, {"step": 7})  # defined again, not repeated
    assert metas["w"] == {"step": 7} and (values["w"] == 7).all()
    for x in (cons, prod, listener):
        x.close()


def test_a_ring_of_blocks_sent_one_at_a_time_repeats_their_layouts(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel.protocol import MAX_SINGLE_LAYOUTS

    listener, prod, cons = pair(addr, pool)
    ring = [pool.empty(4, "int32") for _ in range(40)]  # more than a batch layout's limit, fewer than a single's
    for step in range(3):
        for i, a in enumerate(ring):
            a[:] = step * 100 + i
            lease = prod.send(a, meta={"step": step, "i": i} if i % 2 else None)
            got = cons.recv(5) if i % 3 else cons.recv_many(5)[0]  # a single array's repeat is one array
            assert got.meta == ({"step": step, "i": i} if i % 2 else None)
            assert (np.asarray(got.as_array()) == step * 100 + i).all()
            got.release()
            lease.wait(5)
    # Each array defined its layout once and was repeated since; the batches' layouts are apart.
    assert len(prod.protocol_state.layouts_sent(single=True)) == len(cons.protocol_state.layouts_held(single=True)) == 40
    assert not prod.protocol_state.layouts_sent() and not cons.protocol_state.layouts_held()
    # More than either end remembers: the oldest are forgotten on both sides alike, and sent again in full.
    more = [pool.empty(1, "uint8") for _ in range(MAX_SINGLE_LAYOUTS)]
    for a in more:
        prod.send(a)
        cons.recv(5).release()
    assert len(prod.protocol_state.layouts_sent(single=True)) == len(cons.protocol_state.layouts_held(single=True)) == MAX_SINGLE_LAYOUTS
    ring[0][:] = 7
    lease = prod.send(ring[0])
    with cons.recv(5) as got:
        assert (np.asarray(got.as_array()) == 7).all()
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_views_at_one_address_are_each_sent_as_themselves(addr: str, pool: SharedPool) -> None:
    """Arrays sent one at a time are remembered by (address, shape, strides, dtype): views of one block at
    its start, of another dtype, shape or stride, are each their own placement, and each arrives as it was
    sent, again and again (a repeat only of the very same view)."""
    listener, prod, cons = pair(addr, pool)
    base = pool.empty(16, "uint8")
    base[:] = np.arange(16, dtype=np.uint8)
    views = [base, base.view(np.int32), base[:8], base[::2], base.reshape(4, 4), base.view(np.int32)[:2]]
    for _ in range(3):
        for v in views:
            lease = prod.send(v)
            with cons.recv(5) as got:
                arr = got.as_array()
                assert (arr.dtype, arr.shape, arr.strides) == (v.dtype, v.shape, v.strides)
                assert (arr == v).all()
            lease.wait(5)
    assert len(prod.protocol_state.layouts_sent(single=True)) == len(views)
    for x in (cons, prod, listener):
        x.close()


def test_a_state_dict_sent_again_is_lent_again_until_one_of_its_arrays_changes(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    state = {"w": pool.empty((4, 3), "int32"), "b": pool.empty(5, "float64"), "w2": None}
    state["w2"] = state["w"]  # the same block twice in one batch: referenced once per item
    live = pool.used_bytes
    for step in range(3):
        state["w"][:] = step
        state["b"][:] = step / 2
        values, _ = round_trip(prod, cons, state, {"step": step})
        assert (values["w"] == step).all() and (values["w2"] == step).all() and (values["b"] == step / 2).all()
        assert pool.used_bytes == live  # every lease gave its blocks back
        assert len(prod._memos) == 1  # remembered from the first send on
    (memo,) = prod._memos.values()
    assert memo.layout is not None and len(prod.protocol_state.layouts_sent()) == 1
    # A new array where the old one was (its block freed, another allocated at the same address):
    # the remembered block is gone, so the batch is looked up again and lends the new block.
    old_ptr = state["b"].ctypes.data
    state["b"] = None  # (the key keeps its place in the dict)
    gc.collect()
    state["b"] = pool.empty(5, "float64")
    state["b"][:] = 9
    values, _ = round_trip(prod, cons, state)
    assert (values["b"] == 9).all() and pool.used_bytes == live
    if state["b"].ctypes.data == old_ptr:
        assert prod._memos[memo.key] is not memo  # remembered again, for the new block
    # Another layout of the same memory under the same name: not the remembered one.
    state["w"] = state["w"].T
    values, _ = round_trip(prod, cons, state)
    assert values["w"].shape == (3, 4) and (values["w"] == 2).all()
    same_place = state["b"].ctypes.data == old_ptr  # then the new "b" repeats the first layout
    assert len(prod.protocol_state.layouts_sent()) == (2 if same_place else 3) and pool.used_bytes == live
    # Arrays copied into the pool are never remembered: each send copies anew.
    values, _ = round_trip(prod, cons, {"x": np.arange(3)})
    values, _ = round_trip(prod, cons, {"x": np.arange(3) + 1})
    assert (values["x"] == [1, 2, 3]).all()
    for x in (cons, prod, listener):
        x.close()


def test_single_sends_of_pool_arrays_are_remembered_per_array(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    ring = [pool.empty(6, "int64") for _ in range(3)]
    live = pool.used_bytes
    for rep in range(6):
        a = ring[rep % 3]
        a[:] = rep
        lease = prod.send(a)
        with cons.recv(5) as r:
            assert (r.as_array() == rep).all()
        lease.wait(5)
        assert pool.used_bytes == live
    assert len(prod._memos) == 3  # one per array of the ring
    ring[0] = None  # freed: a new array may take its place, and is lent for itself
    gc.collect()
    ring[0] = pool.empty(6, "int64")
    ring[0][:] = 42
    lease = prod.send(ring[0])
    with cons.recv(5) as r:
        assert (r.as_array() == 42).all()
    lease.wait(5)
    assert pool.used_bytes == live
    for x in (cons, prod, listener):
        x.close()


def test_views_of_one_pool_array_are_remembered_by_address_and_layout(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(8, "int32")
    a[:] = np.arange(8)
    views = [a, a[1:], a[::-1], a[::2], a[1::2], a[1:]]  # the last: a new view object of a layout sent before
    for rep in range(2):
        for v in views:
            lease = prod.send(v)
            with cons.recv(5) as r:
                assert (r.as_array() == v).all()
            lease.wait(5)
    assert len(prod._memos) == 4  # a[::-1] is copied each time (negative strides), never remembered
    for x in (cons, prod, listener):
        x.close()


def test_a_send_over_a_freed_remembered_block_keeps_its_timeout_while_another_send_holds_the_lock(
        addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(16, "int32")
    for _ in range(2):  # remembered, and its layout known to the peer
        lease = prod.send(a)
        cons.recv(5).release()
        lease.wait(5)
    address = a.ctypes.data
    del a
    gc.collect()
    b = pool.empty(16, "int32")
    assert b.ctypes.data == address  # the remembered placement's signature, over a new block
    assert prod._link.lock.acquire(timeout=1)  # another thread's send holds the connection
    try:
        t0 = time.monotonic()
        with pytest.raises(WaitTimeoutError):
            in_thread(lambda: prod.send(b, timeout=0.3))(3)
        assert time.monotonic() - t0 < 2  # it blocked on the lock, with no timeout, to forget the placement
    finally:
        prod._link.release()
    b[:] = 7
    lease = prod.send(b, timeout=5)
    with cons.recv(5) as r:
        assert (r.as_array() == 7).all()
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_a_pool_that_retires_a_chunk_keeps_its_timeout_while_another_send_holds_the_lock(addr: str) -> None:
    """``SharedPool.empty`` that retires an idle chunk to make room tells each channel, whose send lock another
    thread's send may hold while it waits for a slow peer: the retire goes out once that send lets go."""
    mib = 1 << 20
    with SharedPool(chunk_bytes=mib, max_bytes=2 * mib) as pool:
        listener, prod, cons = pair(addr, pool)
        a = pool.empty(mib, "uint8")
        lease = prod.send(a)
        cons.recv(5).release()
        lease.wait(5)
        chunk = pool._chunks[0].id
        assert prod._proto.is_announced(chunk)
        del a
        gc.collect()  # the chunk is idle: a 2 MiB block needs its room
        assert prod._link.lock.acquire(timeout=1)  # another thread's send holds the connection
        try:
            t0 = time.monotonic()
            b = in_thread(lambda: pool.empty(2 * mib, "uint8", timeout=0.5))(5)
            assert time.monotonic() - t0 < 2  # it waited for the send lock with no timeout
            assert b.nbytes == 2 * mib
            assert prod._proto.is_announced(chunk)  # not told yet: the lock is held
        finally:
            prod._link.release()  # the retire goes out now, in this thread
        assert not prod._proto.is_announced(chunk)
        b[:] = 9
        lease = prod.send(b, timeout=5)
        with cons.recv(5) as r:
            assert (r.as_array() == 9).all()
        lease.wait(5)
        assert chunk not in cons._imports  # the peer unmapped the retired chunk
        for x in (cons, prod, listener):
            x.close()


def test_a_retire_still_deferred_is_counted_before_the_next_announce(addr: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """At the chunk limit, a send that takes the send lock before a deferred retire has run (the holder let go and
    this send took the lock first) runs the retire itself before it counts: the new chunk is not refused."""
    from dmabuf_interop.channel import channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_CHUNKS", 1)
    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
        listener, prod, cons = pair(addr, pool)
        a = pool.empty(8, "uint8")
        lease = prod.send(a)
        cons.recv(5).release()
        lease.wait(5)
        first = pool._chunks[0].id
        del a
        gc.collect()
        assert prod._link.lock.acquire(timeout=1)
        assert pool.trim() == 1  # the retire is deferred: the lock is held
        assert prod._proto.is_announced(first) and prod._link.due
        prod._link.lock.release()  # let go as a holder does, before it runs what was deferred
        b = pool.empty(16, "int32")  # a second chunk (and no placement remembered for it): over the limit of 1
        # unless the retire is counted first
        b[:] = 3
        lease = prod.send(b, timeout=5)
        assert not prod._proto.is_announced(first) and not prod._link.due
        with cons.recv(5) as r:
            assert (r.as_array() == 3).all()
        lease.wait(5)
        assert first not in cons._imports
        for x in (cons, prod, listener):
            x.close()


def test_a_deferred_job_runs_once_under_the_send_lock_and_a_failing_one_is_logged(
        addr: str, pool: SharedPool, caplog: pytest.LogCaptureFixture) -> None:
    listener, prod, cons = pair(addr, pool)
    link = prod._link
    ran: list[bool] = []
    assert link.lock.acquire(timeout=1)
    link.defer(lambda: 1 / 0)  # deferred: the lock is held
    link.defer(lambda: ran.append(link.held_here()))
    assert ran == []
    link.release()  # both run now, in this thread, under the lock; the first's error does not reach here
    assert ran == [True] and not link.held_here() and not link.due
    assert "a job deferred to the channel's send lock failed" in caplog.text and "ZeroDivisionError" in caplog.text
    link.defer(lambda: ran.append(True))  # the lock is free: at once
    assert ran == [True, True]
    for x in (cons, prod, listener):
        x.close()


def test_a_close_during_the_first_send_leaves_no_reader_to_fail(addr: str) -> None:
    """The background reader starts after the first message; a ``close()`` that ended the connection while that
    send was stuck on a slow peer leaves it nothing to read: no thread dies on the closed socket."""
    died: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda a: died.append(a.exc_value)
    try:
        for _ in range(12):
            with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
                listener, prod, cons = pair(addr, pool)
                prod._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the peer does not read
                a = pool.empty(8, "uint8")
                sending = in_thread(lambda: prod.send(a, meta={"pad": "x" * 60000}, timeout=5))
                time.sleep(0.1)
                prod.close(timeout=0.2)
                with pytest.raises(ClosedError):
                    sending(10)
                time.sleep(0.1)  # a reader started after the send has run by now
                for x in (cons, listener):
                    x.close()
    finally:
        threading.excepthook = hook
    assert died == []


def test_a_close_while_the_first_send_starts_the_reader_does_not_fail(addr: str, monkeypatch) -> None:
    """The background reader is started by the first send once its message is out; a close() in another thread
    while that thread is starting (here it takes 0.3 s to start) closes the channel and joins the reader, with no
    "cannot join thread before it is started"."""
    start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name == "dmabuf-interop-channel-reader":
            time.sleep(0.3)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
        listener, prod, cons = pair(addr, pool)
        a = pool.empty(8, "uint8")
        sending = in_thread(lambda: prod.send(a, timeout=5))
        time.sleep(0.1)  # the message is out, the reader starting
        prod.close(timeout=2)
        assert prod.closed
        sending(5)  # the send itself succeeded: its message went out before the close
        for x in (cons, listener):
            x.close()


def test_a_reader_that_cannot_start_after_the_first_send_is_logged_and_the_lease_returned(
        addr: str, pool: SharedPool, caplog: pytest.LogCaptureFixture) -> None:
    """The message is out when the reader starts: a thread that cannot start fails nothing (the lease is lent and
    returned); the next send starts it."""
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(8, "uint8")
    a[:] = 5
    threading.stack_size(1 << 40)  # no thread can start now
    try:
        lease = prod.send(a, timeout=5)
    finally:
        threading.stack_size(0)
    assert prod._reader is None and "background reader could not start" in caplog.text
    with cons.recv(5) as r:
        assert (r.as_array() == 5).all()
    b = pool.empty(8, "uint8")
    second = prod.send(b, timeout=5)  # starts the reader, which reads both releases
    assert prod._reader is not None
    cons.recv(5).release()
    lease.wait(5)
    second.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_a_busy_consumer_batches_its_releases(addr: str) -> None:
    """On the socket (no shared-memory ring: its releases need no message), a busy consumer's releases share
    messages."""
    with SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        listener, prod, cons = pair(addr, pool, ring=False)
        seen: list[int] = []
        handle = prod._handle

        def counting(msg, fds, *rest):  # the producer's view: how many release messages came
            if msg.get("kind") == "release":
                seen.append(len(msg["leases"]))
            return handle(msg, fds, *rest)

        prod._handle = counting
        arrays = [pool.empty(8, "uint8") for _ in range(64)]
        leases = [prod.send(a) for a in arrays]  # all there before the consumer starts
        for _ in arrays:
            cons.recv(5).release()
        for lease in leases:
            lease.wait(5)
        # Gathered: RELEASE_BATCH at a time, or fewer by the flusher on a slow machine; a release after a
        # quiet spell still goes out alone, at once.
        assert sum(seen) == 64 and max(seen) > 1 and len(seen) < 64, seen
        for x in (cons, prod, listener):
            x.close()


def test_a_layout_whose_definition_failed_to_go_is_not_repeated(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel.wire import MAX_FRAME

    listener, prod, cons = pair(addr, pool)
    a = pool.empty(4, "float32")
    names = 1 + MAX_FRAME // (4096 * 1000)
    batch = {f"{i:05d}" + "x" * 4090: a for i in range(names * 1000)}  # the arrays message exceeds MAX_FRAME
    for _ in range(2):  # the retry must not send a repeat of a layout the peer never received
        with pytest.raises(InvalidArgumentError, match="bytes"):
            prod.send_many(batch)
    a[:] = 3
    values, _ = round_trip(prod, cons, {"a": a})  # the channel is still up, in step on both ends
    assert (values["a"] == 3).all()
    for x in (cons, prod, listener):
        x.close()


def test_a_batch_lease_is_released_when_its_last_item_goes(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    lease = prod.send_many([np.arange(4), np.zeros(3)])
    a, b = cons.recv_many(5)
    a.release()
    assert a.released and not b.released
    del a
    gc.collect()
    time.sleep(0.05)
    assert not lease.done  # b still holds the batch
    del b
    gc.collect()  # the safety net: every item of the batch is gone
    lease.wait(2)
    assert lease.reason == "released"
    for x in (cons, prod, listener):
        x.close()


def test_pool_retires_idle_chunks_to_make_room_for_a_larger_block() -> None:
    with SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20) as p:
        blocks = [p.empty(1 << 20, "uint8") for _ in range(4)]  # four 1 MiB chunks: the pool is full
        del blocks
        gc.collect()
        big = p.empty(2 << 20, "uint8", timeout=1)  # needs a 2 MiB chunk: idle ones are retired
        assert big.nbytes == 2 << 20 and p.capacity <= 4 << 20


def test_a_device_pool_without_cuda_fails_when_made() -> None:
    from dmabuf_interop.capabilities import driver_problem
    from dmabuf_interop.errors import NoDriverError

    if driver_problem() is None:
        pytest.skip("CUDA works here: the no-driver error cannot happen")
    with pytest.raises(NoDriverError):
        SharedPool(0)


def test_torch_lazy_conjugates_are_refused_and_parameters_copied(addr: str, pool: SharedPool) -> None:
    torch = pytest.importorskip("torch")
    listener, prod, cons = pair(addr, pool)
    c = torch.from_numpy(pool.empty(2, "complex64"))
    c[:] = torch.tensor([1 + 2j, 3 - 4j])
    lease = prod.send(c)  # remembered: a conjugate view of the same memory must not pass as it
    with cons.recv(5) as got:
        assert got.as_tensor().tolist() == [1 + 2j, 3 - 4j]
    lease.wait(5)
    # The memory holds the values before the conjugation: sent as it lies, they would arrive wrong.
    for lazy in (c.conj(), c.conj().imag, torch.tensor([1 + 2j]).conj()):
        with pytest.raises(InvalidArgumentError, match="resolve_conj"):
            prod.send(lazy)
    lease = prod.send(c.conj().resolve_conj())
    with cons.recv(5) as got:
        assert got.as_tensor().tolist() == [1 - 2j, 3 + 4j]
    lease.wait(5)
    # A parameter that requires grad, outside the pool: copied, its values only.
    layer = torch.nn.Linear(4, 2)
    lease = prod.send_many(dict(layer.named_parameters()))
    got = cons.recv_many(5)
    assert torch.equal(got["weight"].as_tensor(), layer.weight.detach())
    release_all(got.values())
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_torch_tensors_without_one_strided_storage_are_refused_with_typed_errors(addr: str, pool: SharedPool) -> None:
    """Sparse, nested and meta tensors have no block to lend: InvalidArgumentError names what to send instead, in
    send_many with the item, also after a dense tensor taught the sender's signature look-up torch's type."""
    import warnings

    torch = pytest.importorskip("torch")
    listener, prod, cons = pair(addr, pool)
    dense = torch.from_numpy(pool.empty(4, "float32"))
    dense[:] = 1
    lease = prod.send(dense)  # torch.Tensor's signature is read inline from now on
    cons.recv(5).release()
    lease.wait(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: sparse CSR and nested tensors are in beta / prototype)
        refused = {"sparse_coo": torch.eye(2).to_sparse(), "sparse_csr": torch.eye(2).to_sparse_csr(),
                   "'meta'": torch.empty(3, device="meta"),
                   "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}
    for what, t in refused.items():
        with pytest.raises(InvalidArgumentError, match=what):
            prod.send(t)
        with pytest.raises(InvalidArgumentError, match=f"item 's': .*{what}"):
            prod.send_many({"ok": dense, "s": t})
    lease = prod.send(dense)  # the channel is as it was
    with cons.recv(5) as got:
        assert got.as_array().tolist() == [1, 1, 1, 1]
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_host_bfloat16_arrives_as_torch_bfloat16(addr: str, pool: SharedPool) -> None:
    """NumPy has no bfloat16: the host view is read as int16 and re-viewed, a transposed one too."""
    torch = pytest.importorskip("torch")
    listener, prod, cons = pair(addr, pool)
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) / 4
    for sent in (x, x.t()):
        lease = prod.send(sent)
        with cons.recv(5) as got:
            y = got.as_tensor()
            assert y.dtype == torch.bfloat16 and torch.equal(y, sent)
            del y
        lease.wait(5)
    for c in (cons, prod, listener):
        c.close()


@pytest.fixture
def send_timeout(monkeypatch: pytest.MonkeyPatch):
    """Sets, for one test, how long a send waits for a peer that takes nothing (``SEND_TIMEOUT``)."""
    from dmabuf_interop.channel import channel as channel_mod

    return lambda seconds: monkeypatch.setattr(channel_mod, "SEND_TIMEOUT", seconds)


def test_a_message_cut_off_by_a_peer_that_stopped_reading_ends_the_connection(addr: str, pool: SharedPool,
                                                                                send_timeout) -> None:
    send_timeout(0.5)
    listener, prod, cons = pair(addr, pool)
    state = {f"layer.{i}.weight": pool.empty(4, "float32") for i in range(5000)}  # about 1 MB of JSON
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError, match="cut off"):
        prod.send_many(state)  # the consumer is not reading: the socket buffer fills part-way
    assert time.monotonic() - t0 < 5
    with pytest.raises(PeerClosedError, match="WaitTimeoutError") as info:  # the first cause, not our own EOF
        prod.send(state["layer.0.weight"])
    assert isinstance(info.value.__cause__, WaitTimeoutError)
    # The consumer reads what arrived, then the end: at once, not after the rest's 60 s.
    t0 = time.monotonic()
    with pytest.raises(PeerClosedError):
        cons.recv_many(30)
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while not prod.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prod.closed
    # The recorded cause holds no frame of the failed send: its arrays go once the caller drops them.
    probe = weakref.ref(state["layer.1.weight"])
    del state
    gc.collect()
    assert probe() is None
    for x in (cons, prod, listener):
        x.close()  # no error: the connection is over


def test_close_does_not_wait_for_a_send_stuck_on_a_peer_that_stopped_reading(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    state = {f"layer.{i}.weight": pool.empty(4, "float32") for i in range(5000)}
    sending = in_thread(lambda: prod.send_many(state))
    time.sleep(0.5)  # stuck: the consumer is not reading
    t0 = time.monotonic()
    prod.close(timeout=0.5)
    with pytest.raises(ClosedError):
        sending(5)  # ended under it, by this end: not the peer's doing
    assert time.monotonic() - t0 < 5 and prod.closed and prod.outstanding == 0  # every lease completed
    with pytest.raises(PeerClosedError):
        cons.recv_many(30)
    for x in (cons, listener):
        x.close()


def test_fds_a_host_chunk_holds_and_the_cause_of_a_local_end(addr: str, tmp_path: Path) -> None:
    per_chunk = 1 if sys.version_info >= (3, 13) else 2  # the memfd, and before 3.13 the dup mmap keeps
    with SharedPool(None, chunk_bytes=1 << 16, max_bytes=1 << 24) as pool:
        before = len(open_fds())
        arrays = [pool.empty(1 << 14, "float32") for _ in range(8)]  # a chunk each
        assert len(open_fds()) - before == 8 * per_chunk
        del arrays
    # A consumer under a low fd limit: before 3.13 it runs out of fds mapping chunks, and the next recv
    # says so, with the error as its cause.
    script = tmp_path / "consumer.py"
    script.write_text(f"""
import resource, sys
from dmabuf_interop.channel import connect
from dmabuf_interop.errors import PeerClosedError, SyscallError
with connect({addr!r}, timeout=10, wait=True) as ch:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held = []
    try:
        while True:
            held.append(ch.recv(10))
    except PeerClosedError as exc:
        if sys.version_info >= (3, 13):  # a mapped chunk holds no fd: all 80 fit, then the producer closed
            assert len(held) == 80 and "peer closed" in str(exc), (len(held), repr(exc))
        else:  # one fd per mapped chunk: mapping fails with EMFILE, which ends the connection here
            assert len(held) < 80 and isinstance(exc.__cause__, SyscallError) and "EMFILE" in str(exc), repr(exc)
        print("ok", len(held))
""")
    with SharedPool(None, chunk_bytes=1 << 16, max_bytes=1 << 24) as pool, listen(addr, pool=pool) as listener:
        proc = subprocess.Popen([sys.executable, str(script)], env=env_with_src(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        with listener.accept(10) as prod:
            try:
                for _ in range(80):
                    prod.send(pool.empty(1 << 14, "float32"))
            except PeerClosedError:
                pass  # the consumer ended the connection
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.startswith("ok"), out + err[-2000:]


def test_a_received_that_dies_in_a_reference_cycle_still_releases_its_lease(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    lease = prod.send(pool.empty(4, "int32"))

    def consume() -> None:
        r = cons.recv(5)  # noqa: F841 - held by the frame
        try:
            raise ValueError("caught")
        except ValueError as exc:
            err = exc  # noqa: F841 - err -> traceback -> this frame -> err: r becomes cyclic garbage

    consume()
    gc.collect()
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_a_repeat_carries_its_own_meta_exactly(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(4, "int32")
    got = []
    for meta in ({"flag": 1}, {"flag": True}, {"flag": 1.0}, None, {"flag": 1}):  # 1 == True == 1.0 in Python
        lease = prod.send(a, meta=meta)
        got.append(cons.recv(5))
        assert got[-1].meta == meta and type((got[-1].meta or {}).get("flag")) is type((meta or {}).get("flag"))
    assert got[0].meta is not got[4].meta  # each message its own object
    release_all(got)
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_close_is_bounded_by_its_timeout_on_a_peer_that_stopped_reading(addr: str, pool: SharedPool,
                                                                         send_timeout) -> None:
    send_timeout(0.3)
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(4, "int32")
    with pytest.raises((WaitTimeoutError, PeerClosedError)):
        for _ in range(100_000):  # the consumer never reads: its socket buffer fills
            prod.send(a)
    send_timeout(30.0)
    t0 = time.monotonic()
    prod.close(timeout=0.5)
    assert time.monotonic() - t0 < 2 and prod.closed
    cons.close(None)  # no timeout: waits as long as it must
    listener.close()


def test_close_takes_none_or_a_negative_timeout(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    lease = prod.send(pool.empty(4, "int32"))
    prod.close(-0.001)  # "deadline - now", already past: closes without waiting, never raises
    assert prod.closed
    lease.wait(5)  # completed by the reader as it ends, just after
    assert lease.reason == "closed"
    cons.close(None)
    assert cons.closed
    listener.close()


_OPS = st.one_of(
    st.tuples(st.just("one"), st.integers(0, 5), st.sampled_from([None, {"k": 1}, {"k": 1.0}, {"k": True}])),
    st.tuples(st.just("batch"), st.sets(st.integers(0, 5), min_size=1), st.sampled_from([None, {"k": 1}])),
    st.tuples(st.just("renew"), st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("write"), st.integers(0, 5), st.integers(-100, 100)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_OPS, max_size=40))
def test_layouts_stay_in_step_whatever_is_sent_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    ops: list) -> None:
    """Single arrays and batches sent again, renewed and rewritten in any order, past both layout limits
    (made small here): the two ends keep the same layouts, and every array and meta arrives as sent."""
    from dmabuf_interop.channel import channel as channel_mod

    monkeypatch.setattr(channel_mod, "MAX_SINGLE_LAYOUTS", 3)
    monkeypatch.setattr(channel_mod, "MAX_LAYOUTS", 2)
    addr = str(tmp_path / f"p{len(ops)}-{os.getpid()}-{time.monotonic_ns()}.sock")
    with SharedPool(None, chunk_bytes=1 << 16, max_bytes=1 << 22) as pool:
        listener, prod, cons = pair(addr, pool)
        ring = [pool.empty(2, "int32") for _ in range(6)]
        for i, a in enumerate(ring):
            a[:] = i
        for op in ops:
            if op[0] == "renew":
                ring[op[1]] = pool.empty(op[2], "int32")
                ring[op[1]][:] = op[1]
            elif op[0] == "write":
                ring[op[1]][:] = op[2]
            elif op[0] == "one":
                lease = prod.send(ring[op[1]], meta=op[2])
                with cons.recv(5) as r:
                    assert np.array_equal(r.as_array(), ring[op[1]]) and r.meta == op[2]
                    assert type((r.meta or {}).get("k")) is type((op[2] or {}).get("k"))
                lease.wait(5)
            else:
                names = {f"a{i}": ring[i] for i in sorted(op[1])}
                lease = prod.send_many(names, meta=op[2])
                got = cons.recv_many(5)
                assert list(got) == list(names)
                assert all(np.array_equal(got[n].as_array(), names[n]) for n in names)
                release_all(got.values())
                lease.wait(5)
            assert len(prod.protocol_state.layouts_sent(single=True)) == len(cons.protocol_state.layouts_held(single=True)) <= 3
            assert len(prod.protocol_state.layouts_sent()) == len(cons.protocol_state.layouts_held()) <= 2
            assert prod.protocol_state.layouts_sent(single=True) == cons.protocol_state.layouts_held(single=True)
            assert prod.protocol_state.layouts_sent() == cons.protocol_state.layouts_held()
        for x in (cons, prod, listener):
            x.close()


def test_as_tensors_gives_what_as_tensor_gives_for_each_item(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel import as_tensors
    from dmabuf_interop.errors import NotSupportedError

    listener, prod, cons = pair(addr, pool)
    lease = prod.send_many({"w": np.arange(12, dtype=np.int32).reshape(3, 4), "b": np.ones(5)})
    batch = cons.recv_many(5)
    with pytest.raises(InvalidArgumentError, match="Received"):
        as_tensors([batch["w"], np.zeros(1)])
    try:
        import torch
    except ImportError:
        with pytest.raises(NotSupportedError, match="torch"):
            as_tensors(batch)
    else:
        ts = as_tensors(batch)
        assert list(ts) == ["w", "b"]
        assert torch.equal(ts["w"], torch.arange(12, dtype=torch.int32).view(3, 4))
        assert torch.equal(ts["b"], torch.ones(5, dtype=torch.float64))
        assert [t.shape for t in as_tensors(list(batch.values()))] == [(3, 4), (5,)]
        del ts
    release_all(batch.values())
    lease.wait(5)
    with pytest.raises(InvalidArgumentError, match="released"):
        as_tensors(batch)
    for x in (cons, prod, listener):
        x.close()


def test_arrays_queued_before_the_end_stay_readable_after_it(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    theirs = SharedPool(chunk_bytes=1 << 20, max_bytes=1 << 20)
    lease = cons.send(theirs.empty(1, "int64"))  # the consumer lends too: its background reader takes the socket
    arrays = [pool.empty(4, "int64") for _ in range(3)]
    for i, a in enumerate(arrays):
        a[:] = i
        prod.send(a)
    prod.recv(5).release()  # the consumer's array: its reader is reading now
    deadline = time.monotonic() + 5
    while len(cons._queue) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    prod.close()  # retires nothing itself; the end of the connection unmaps idle chunks on the consumer
    pool.close()  # retire messages, then the chunks' exports are closed
    deadline = time.monotonic() + 5
    while not cons.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cons.closed
    got = []
    for _ in arrays:
        with cons.recv(5) as r:  # queued before the end: still mapped, still readable
            got.append(r.as_array().tolist())
    assert got == [[i] * 4 for i in range(3)]
    with pytest.raises(PeerClosedError):
        cons.recv(1)
    lease.wait(5)
    listener.close()
    cons.close()
    theirs.close()


def test_a_large_batch_pauses_the_collector_and_leaves_it_as_it_was(addr: str) -> None:
    from dmabuf_interop.channel._torch_views import BULK_ITEMS

    with SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        listener, prod, cons = pair(addr, pool)
        state = {f"p{i}": pool.empty(2, "uint8") for i in range(BULK_ITEMS + 1)}
        for enabled in (True, False, True):
            (gc.enable if enabled else gc.disable)()
            try:
                for _ in range(2):  # found, then sent again (remembered)
                    lease = prod.send_many(state)
                    batch = cons.recv_many(5)
                    assert gc.isenabled() is enabled
                    release_all(batch.values())
                    lease.wait(5)
            finally:
                gc.enable()
        for x in (cons, prod, listener):
            x.close()


def test_a_view_of_another_kind_at_the_same_address_is_not_taken_for_a_remembered_one(addr: str,
                                                                                      pool: SharedPool) -> None:
    from cuda.core.utils import StridedMemoryView

    listener, prod, cons = pair(addr, pool)
    a = pool.empty(16, "float32")
    a[:] = np.arange(16)

    def sent(x) -> list:
        lease = prod.send(x)
        with cons.recv(5) as r:
            out = r.as_array().tolist()
        lease.wait(5)
        return out

    sent(StridedMemoryView.from_any_interface(pool.empty(3, "float32"), stream_ptr=-1))  # the type is known now
    for _ in range(2):
        assert sent(a[:2]) == [0.0, 1.0]  # remembered: NumPy strides are in bytes, (4,)
    view = StridedMemoryView.from_any_interface(a[::4][:2], stream_ptr=-1)  # strides in items, (4,)
    assert sent(view) == [0.0, 4.0]
    for x in (cons, prod, listener):
        x.close()


def test_arrays_of_another_pool_are_not_remembered(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    with SharedPool(chunk_bytes=1 << 20, max_bytes=1 << 20) as other:
        a = other.empty(4, "int64")
        for _ in range(2):
            lease = prod.send(a)
            cons.recv(5).release()
            lease.wait(5)
        assert len(prod._memos) == 0  # a remembered block would hold that pool
    for x in (cons, prod, listener):
        x.close()


def test_a_bad_stream_does_not_lose_the_array(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    lease = prod.send(np.arange(3))
    for bad in ("not a stream", object()):
        with pytest.raises(InvalidArgumentError, match="stream"):
            cons.recv(5, stream=bad)
        with pytest.raises(InvalidArgumentError, match="stream"):
            cons.recv_many(5, stream=bad)
    with cons.recv(5) as r:
        assert r.as_array().tolist() == [0, 1, 2]
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_an_imported_chunk_is_unmapped_once_whoever_lets_go_last_retire_or_release() -> None:
    """Its references are taken and dropped without a lock (one list call each): threads that take and drop
    them while it is retired leave it mapped while any is held, and unmapped exactly once after."""
    from dmabuf_interop.channel._carrier import ImportedChunk
    from dmabuf_interop.mechanisms.memfd import export_memfd, import_memfd

    for _ in range(20):
        with export_memfd(1 << 16) as exported:
            buf = import_memfd(exported.fd, 1 << 16)
        closes = []
        close = buf.close
        buf.close = lambda: (closes.append(1), close())  # counts the unmaps
        chunk = ImportedChunk(1, 1 << 16, buf)
        chunk.retain()  # the caller's: dropped after the retire
        go = threading.Barrier(5)

        def churn() -> None:
            go.wait()
            for _ in range(2000):
                chunk.retain()
                assert not buf.closed  # a holder's chunk stays mapped
                chunk.release()

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for t in threads:
            t.start()
        go.wait()
        chunk.retire()
        for t in threads:
            t.join()
        assert not buf.closed and closes == []  # the caller's reference still holds it
        chunk.release()
        assert buf.closed and closes == [1] and chunk.refs == 0
        chunk.retire()  # (again: nothing more to close)
        assert closes == [1]
    for _ in range(200):  # the last release and the retire at once: one unmap, whichever comes last
        with export_memfd(1 << 16) as exported:
            buf = import_memfd(exported.fd, 1 << 16)
        closes = []
        close = buf.close
        buf.close = lambda: (closes.append(1), close())
        chunk = ImportedChunk(1, 1 << 16, buf)
        chunk.retain()
        go = threading.Barrier(2)
        racers = [threading.Thread(target=lambda f=f: (go.wait(), f())) for f in (chunk.release, chunk.retire)]
        for t in racers:
            t.start()
        for t in racers:
            t.join()
        assert buf.closed and closes == [1]


def test_a_host_view_holds_its_chunk_for_exactly_as_long_as_it_or_a_view_of_it_lives(addr: str,
                                                                                      pool: SharedPool) -> None:
    """The span under a host array takes a reference on the imported chunk and lets it go as it goes: one per
    as_array, kept by slices and views of the array past release(), none left once they are all gone."""
    listener, prod, cons = pair(addr, pool)
    a = pool.empty(64, "int32")
    a[:] = range(64)
    lease = prod.send(a)
    r = cons.recv(5)
    (chunk,) = cons._imports.values()
    held = chunk.refs  # (the Received's own)
    views = [r.as_array() for _ in range(3)]
    assert chunk.refs == held + 3
    tail = views[0][32:].view("uint8")[::4]  # (a view of a view: the same span under it)
    del views
    gc.collect()
    assert chunk.refs == held + 1  # (the one under tail)
    r.release()
    lease.wait(5)
    assert tail[0] == 32 and chunk.refs == 1  # (released, and still mapped for the view)
    del tail
    gc.collect()
    assert chunk.refs == 0
    for x in (cons, prod, listener):
        x.close()


def test_close_drops_arrays_that_were_not_received_and_unmaps_their_chunks(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    with SharedPool(chunk_bytes=1 << 20, max_bytes=1 << 20) as theirs:
        cons.send(theirs.empty(1, "int64"))  # the consumer's background reader now queues what arrives
        prod.recv(5).release()
        lease = prod.send(np.arange(3))
        deadline = time.monotonic() + 5
        while not cons._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        (chunk,) = cons._queue[0].chunks.values()
        cons.close()
        assert chunk.refs == 0 and chunk.retired and chunk.buf.closed
        with pytest.raises(ClosedError):  # closed by this end: not the peer's doing
            cons.recv(1)
        lease.wait(5)
        assert lease.reason in ("disconnected", "closed")
    for x in (prod, listener):
        x.close()


def test_senders_in_two_threads_keep_their_leases(addr: str) -> None:
    """One thread sends batches under ever new names (layouts come and go), another sends arrays
    whose blocks are freed and allocated again (remembered placements die): every lease is released
    by the consumer, none is completed by the producer alone."""
    with SharedPool(chunk_bytes=1 << 22, max_bytes=1 << 26) as pool:
        listener, prod, cons = pair(addr, pool)
        stop = threading.Event()
        errors: list[BaseException] = []
        arrays = [pool.empty(4, "int64") for _ in range(64)]

        consumed = threading.Event()  # set once the senders are done: the consumer takes everything till then

        def consume() -> None:
            while not consumed.is_set():
                try:
                    got = cons.recv_many(0.2)
                except WaitTimeoutError:
                    continue
                release_all(got.values() if isinstance(got, dict) else got)

        def batches() -> None:
            i = 0
            while not stop.is_set():
                lease = prod.send_many({f"k{i % 64}": arrays[i % 64]})
                i += 1
                if i % 32 == 0:
                    lease.wait(5)
                    assert lease.reason == "released", lease.reason

        def singles() -> None:
            while not stop.is_set():
                a = pool.empty(4, "int64")
                for _ in range(2):
                    lease = prod.send(a)
                    lease.wait(5)
                    assert lease.reason == "released", lease.reason
                del a
                gc.collect(0)

        def run(fn):
            def body() -> None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                    stop.set()
            return threading.Thread(target=body, daemon=True)

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads often: the interleavings that break shared state
        try:
            reader = threading.Thread(target=consume, daemon=True)
            senders = [run(f) for f in (batches, singles)]
            for t in (reader, *senders):
                t.start()
            stop.wait(3)
            stop.set()
            for t in senders:
                t.join(10)
            consumed.set()
            reader.join(10)
        finally:
            sys.setswitchinterval(old)
        assert not errors, errors
        assert not prod.closed and not cons.closed
        for x in (cons, prod, listener):
            x.close()


_VIEW_AFTER_END = """
import os, sys, tempfile, threading
import numpy as np
from dmabuf_interop.channel import SharedPool, connect, listen
addr = os.path.join(tempfile.mkdtemp(), "s")
pool = SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20)
lst = listen(addr, pool=pool)
box = {}
t = threading.Thread(target=lambda: box.setdefault("c", connect(addr, timeout=10)))
t.start()
prod = lst.accept(10)
t.join()
cons = box["c"]
a = pool.empty(1000, "int64")
a[:] = np.arange(1000)
prod.send(a)
with cons.recv(5) as r:
    view = r.as_array()
if sys.argv[1] == "consumer":
    cons.close()
else:
    prod.close(); pool.close(); lst.close()
    try:
        cons.recv(5)
    except Exception as exc:
        print(type(exc).__name__)
print(int(view.sum()))  # released, and the connection is over: stale, but still mapped
del view
cons.close()
"""


@pytest.mark.parametrize("who", ["consumer", "producer"])
def test_a_view_read_after_release_and_the_end_reads_stale_bytes_not_unmapped_memory(who: str) -> None:
    res = subprocess.run([sys.executable, "-c", _VIEW_AFTER_END, who], capture_output=True, text=True,
                         timeout=60, env=env_with_src())
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])  # -11 was a SIGSEGV
    assert res.stdout.split()[-1] == "499500"


def test_misuse_is_refused_with_typed_errors(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.channel import as_tensors

    listener, prod, cons = pair(addr, pool)
    with pytest.raises(InvalidArgumentError, match="use send"):
        prod.send_many(np.arange(6).reshape(2, 3))  # not a batch of its rows
    with pytest.raises(InvalidArgumentError, match="timeout"):
        prod.send(np.arange(3), timeout=-1)
    with pytest.raises(InvalidArgumentError, match=r"\.\.\. \(str\)"):
        prod.send_many({"k" * 100_000: np.arange(3)})  # the name is cut short in the message
    with pytest.raises(InvalidArgumentError, match="timeout"):
        connect(addr, timeout=-1)
    for bad in (5, None, b"/tmp/a", ""):  # (an int or None reached os.fspath's TypeError)
        with pytest.raises(InvalidArgumentError, match="address must be a path"):
            listen(bad)
        with pytest.raises(InvalidArgumentError, match="address must be a path"):
            connect(bad, timeout=1)
    lease = prod.send(np.arange(3))
    r = cons.recv(5)
    with pytest.raises(InvalidArgumentError, match="as_tensor"):
        as_tensors(r)
    r.release()
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_refusals_of_what_cannot_travel_name_the_dict_and_the_batch_item(addr: str, pool: SharedPool) -> None:
    # A dict given to send, and a None or nested dict inside a state dict, were refused as
    # "dtype object cannot travel", naming neither the mistake nor the item.
    listener, prod, cons = pair(addr, pool)
    with pytest.raises(InvalidArgumentError, match="cannot send a dict as one array: send_many"):
        prod.send({"w": np.arange(3)})
    with pytest.raises(InvalidArgumentError, match=r"^item 'b': dtype object cannot travel"):
        prod.send_many({"a": np.arange(3), "b": None})
    with pytest.raises(InvalidArgumentError, match=r"^item 'b': cannot send a dict"):
        prod.send_many({"a": np.arange(3), "b": {"c": np.arange(2)}})
    with pytest.raises(InvalidArgumentError, match=r"^item 1: dtype <U1 cannot travel"):
        prod.send_many([np.arange(3), np.array(["x"])])
    assert pool.used_bytes == 0  # nothing was placed, nothing sent: the channel goes on
    lease = prod.send_many({"a": np.arange(3)})
    batch = cons.recv_many(5)
    assert batch["a"].as_array().tolist() == [0, 1, 2]
    release_all(batch)
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()


def test_connect_can_wait_for_a_listener_that_starts_later(addr: str, pool: SharedPool) -> None:
    from dmabuf_interop.errors import SyscallError

    with pytest.raises(SyscallError):  # by default: at once
        connect(addr, timeout=5)
    with pytest.raises(WaitTimeoutError, match="nothing listened"):
        connect(addr, timeout=0.2, wait=True)
    get = in_thread(lambda: connect(addr, timeout=10, wait=True))
    time.sleep(0.3)
    listener = listen(addr, pool=pool)
    prod = listener.accept(10)
    cons = get()
    lease = prod.send(np.arange(3))
    with cons.recv(5) as r:
        assert r.as_array().tolist() == [0, 1, 2]
    lease.wait(5)
    for x in (cons, prod, listener):
        x.close()
    # The timeout covers the wait for the listener and the handshake together.
    late = in_thread(lambda: (time.sleep(0.6), listen(addr, pool=pool))[1])  # listens, never accepts
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="no hello"):
        connect(addr, timeout=1, wait=True)
    assert time.monotonic() - t0 < 1.5
    late().close()
    with pytest.raises(InvalidArgumentError, match="local"):
        connect("tcp://127.0.0.1:1", timeout=1, wait=True)


def test_device_view_is_a_dlpack_producer_on_its_gpu_that_keeps_its_owners_and_goes_on_with_its_dtype() -> None:
    from dmabuf_interop.channel.sending import inspect_array as _inspect
    from dmabuf_interop.channel.pool import DeviceView

    class Owner:
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    view = DeviceView(0x7F0000001000, (3, 4), (8, 1), np.dtype("uint16"), 1, 2 * (2 * 8 + 4), (owner,), "bfloat16")
    del owner
    gc.collect()
    assert alive() is not None  # the view holds what keeps the mapping and the lease
    assert view.__dlpack_device__() == (2, 1)  # kDLCUDA, the GPU the mapping is accessible from
    assert not hasattr(view, "__cuda_array_interface__")  # it would name the GPU that holds the memory
    assert (view.ptr, view.strides, view.device_id, view.is_device_accessible) == (0x7F0000001000, (8, 1), 1, True)
    assert repr(view) == "<DeviceView uint16[3, 4] at 0x7f0000001000 on GPU 1>"
    # Sent on: its address, byte strides and the sender's dtype, with no memory view made (no driver here)
    src = _inspect(view)
    assert (src.ptr, src.shape, src.strides, src.dtype, src.device) == (0x7F0000001000, (3, 4), (16, 2), "bfloat16", 1)
    del view, src
    gc.collect()
    assert alive() is None


def test_sending_a_cuda_array_interface_object_without_a_gpu_raises_a_typed_error(addr: str, pool: SharedPool) -> None:
    class FakeDeviceArray:  # what CuPy or numba offer: device memory described by the CUDA array interface
        __cuda_array_interface__ = {"version": 3, "shape": (4,), "typestr": "<f4", "data": (0x7F0000001000, False)}

    listener, prod, cons = pair(addr, pool)
    try:
        with pytest.raises((NoDriverError, CudaError)):  # never an AttributeError
            prod.send(FakeDeviceArray())
        lease = prod.send(np.arange(3))  # the channel is as it was
        with cons.recv(5) as r:
            assert r.as_array().tolist() == [0, 1, 2]
        lease.wait(5)
    finally:
        for c in (prod, cons, listener):
            c.close()


def test_a_bad_handshake_timeout_is_refused_by_its_own_name(addr: str) -> None:
    # It was refused as "timeout must be >= 0 seconds", a name listen's caller never gave.
    for bad, text in ((-1, "handshake_timeout must be >= 0 seconds"),
                      ("10", "handshake_timeout must be a number of seconds")):
        with pytest.raises(InvalidArgumentError, match=text):
            listen(addr, handshake_timeout=bad)
        assert not os.path.exists(addr)


def test_timeouts_take_none_or_inf_for_no_limit_and_refuse_nan_and_negatives_with_typed_errors(addr: str) -> None:
    import math

    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 16) as small:
        listener = listen(addr, pool=small)
        get = in_thread(lambda: connect(addr, timeout=math.inf))  # no limit: a socket takes no inf
        prod = listener.accept(math.inf)
        cons = get()
        try:
            full = small.empty((1 << 16) - 256, "uint8", timeout=math.inf)  # there is room: no wait
            tiny = small.empty(4, "uint8", timeout=1e300)  # the last 256-byte block: the pool is full
            for bad in (float("nan"), -1, "1", True, -10**400):
                with pytest.raises(InvalidArgumentError, match="timeout"):
                    small.empty(16, "uint8", timeout=bad)  # NaN once spun forever on a full pool
                with pytest.raises(InvalidArgumentError, match="timeout"):
                    cons.recv(bad)
            for none_left in (0, np.int64(0), np.float32(0.0)):  # NumPy scalars are numbers of seconds too
                with pytest.raises(PoolExhaustedError):
                    small.empty(16, "uint8", timeout=none_left)
            # Two threads in recv with no limit (None, math.inf): one reads, the other waits on a condition,
            # which once raised OverflowError for math.inf.
            # (and an int past any float: no limit either; it was OverflowError from float())
            first, second = in_thread(lambda: cons.recv(None)), in_thread(lambda: cons.recv(10**400))
            time.sleep(0.2)
            leases = [prod.send(full), prod.send(tiny)]
            got = [first(), second()]
            assert sorted(r.shape for r in got) == [(4,), ((1 << 16) - 256,)]
            lease = leases[0]
            for bad in (float("nan"), -1):
                with pytest.raises(InvalidArgumentError, match="timeout"):
                    lease.wait(bad)
            big = next(r for r in got if r.shape != (4,))
            threading.Timer(0.2, big.release).start()
            lease.wait(math.inf)  # was OverflowError; now waits for the release
            small_one = next(r for r in got if r.shape == (4,))
            threading.Timer(0.2, small_one.release).start()
            leases[1].wait(1e12)  # past what a lock takes: no limit, and it waits for the release
            assert [x.reason for x in leases] == ["released", "released"]
            with pytest.raises(InvalidArgumentError, match="timeout"):
                prod.close(timeout=float("nan"))
        finally:
            prod.close(timeout=math.inf)
            cons.close(timeout=1e300)
            listener.close()


def test_release_all_takes_a_recv_many_dict_as_it_is(addr: str, pool: SharedPool) -> None:
    listener, prod, cons = pair(addr, pool)
    try:
        lease = prod.send_many({"a": np.arange(3), "b": np.ones(2)})
        batch = cons.recv_many(5)
        release_all(batch)  # the dict itself, as as_tensors takes it
        lease.wait(5)
        with pytest.raises(InvalidArgumentError, match="Received"):
            release_all(["not a Received"])
    finally:
        for c in (prod, cons, listener):
            c.close()
