"""The torch-sharing drop-in without a GPU: the broker and its leases on host memory (memfd), real
sockets and forks; the handle format; refusals; install/uninstall against torch 2.13 CPU."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import socket
import time

import pytest

from dmabuf_interop.errors import InvalidArgumentError, ProtocolError, StaleHandleError
from dmabuf_interop.fd import open_fds
from dmabuf_interop.fdpass import recv_message, send_message
from dmabuf_interop.integrations.torch_sharing import broker as B
from dmabuf_interop.mechanisms.memfd import host_array

from ._memfd_chunk import Holds, MemfdChunk


@pytest.fixture
def brk():
    B.shutdown()
    b = B.broker()
    yield b
    B.shutdown()


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def _child(fn) -> int:
    """Run ``fn()`` in a forked child; its exit status (0: fn returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the exit status
            os.write(2, f"child: {type(exc).__name__}: {exc}\n".encode())
        os._exit(code)
    return pid


def _status(pid: int) -> int:
    _, st = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(st)


def test_handle_round_trip_and_malformed():
    h = B.ShareHandle("/tmp/x.sock", 42, 7, "ab" * 16, "boot", "GPU-1")
    raw = h.to_bytes()
    assert raw.startswith(B.MAGIC)
    assert B.ShareHandle.from_bytes(raw) == h
    assert h.producer == "pid 42 (broker /tmp/x.sock)"
    for bad in [b"", b"junk", B.MAGIC + b"{", B.MAGIC + b'["/a",1,2,"x","b",""]', raw[:-3],
                B.MAGIC + b'["rel",1,2,"' + b"a" * 32 + b'","b",""]', B.MAGIC + b'["/a",true,2,"' + b"a" * 32 + b'","b",""]',
                "str", None, raw + b"x" * 5000]:
        with pytest.raises(InvalidArgumentError):
            B.ShareHandle.from_bytes(bad)


def test_lease_in_a_forked_consumer_reads_the_bytes_and_returns_the_hold(brk):
    chunk, holds = MemfdChunk(), Holds()
    h = brk.register(chunk, 256, 1024, "hold", holds)
    raw = h.to_bytes()

    def consume():
        hh = B.ShareHandle.from_bytes(raw)
        c = B.client_for(hh, B.default_importer)
        lease, imp, off, n, ev = c.open(hh, 0, wait=False)
        assert (off, n, ev) == (256, 1024, b"")
        assert int(host_array(imp.buf, "int32")[64]) == 0x1000 + 64
        c.release(lease, imp)
        c.close()

    assert _status(_child(consume)) == 0
    _wait_for(lambda: holds.given == ["hold"])
    assert brk.outstanding == 0
    assert len(brk) == 0  # no relend: forgotten once given back


def test_sigkill_of_a_consumer_ends_its_lease(brk):
    chunk, holds = MemfdChunk(), Holds()
    raw = brk.register(chunk, 0, 4096, "hold", holds).to_bytes()
    r, w = os.pipe()

    def consume():
        hh = B.ShareHandle.from_bytes(raw)
        c = B.client_for(hh, B.default_importer)
        c.open(hh, 0, wait=False)
        os.write(w, b"x")
        time.sleep(60)

    pid = _child(consume)
    assert os.read(r, 1) == b"x"
    assert brk.outstanding == 1 and holds.given == []
    os.kill(pid, signal.SIGKILL)
    assert _status(pid) == -signal.SIGKILL
    _wait_for(lambda: holds.given == ["hold"])
    assert brk.outstanding == 0
    os.close(r)
    os.close(w)


def test_refusals_name_the_producer(brk):
    chunk, holds = MemfdChunk(), Holds()
    h = brk.register(chunk, 0, 64, "hold", holds)
    c = B.client_for(h, B.default_importer)
    forged = B.ShareHandle(h.address, h.pid, h.share, "0" * 32, h.boot_id, "")
    with pytest.raises(StaleHandleError, match="token does not match") as err:
        c.open(forged, 0, wait=False)
    assert err.value.producer == f"pid {os.getpid()} (broker {h.address})"
    assert pickle.loads(pickle.dumps(err.value)).producer == err.value.producer
    unknown = B.ShareHandle(h.address, h.pid, 10**9, h.token, h.boot_id, "")
    with pytest.raises(StaleHandleError, match="no share"):
        c.open(unknown, 0, wait=False)
    lease, imp, *_ = c.open(h, 0, wait=False)
    c.release(lease, imp)
    _wait_for(lambda: holds.given == ["hold"])
    with pytest.raises(StaleHandleError, match="no share"):  # stale: released
        c.open(h, 0, wait=False)
    other_host = B.ShareHandle(h.address, h.pid, h.share, h.token, "another-boot", "")
    with pytest.raises(StaleHandleError, match="another host"):
        B.Client(other_host, B.default_importer)


def test_a_share_opened_again_after_release_is_lent_again_while_alive(brk):
    chunk, holds = MemfdChunk(), Holds()
    alive = [True]
    h = brk.register(chunk, 0, 64, "hold", holds, relend=lambda: (chunk, 0, "again") if alive[0] else None,
                     alive=lambda: alive[0])
    c = B.client_for(h, B.default_importer)
    for expect in (["hold"], ["hold", "again"]):
        lease, imp, *_ = c.open(h, 0, wait=False)
        c.release(lease, imp)
        _wait_for(lambda: holds.given == expect)
    alive[0] = False
    with pytest.raises(StaleHandleError, match="no longer the producer's"):
        c.open(h, 0, wait=False)


def test_broker_gone(brk):
    h = brk.register(MemfdChunk(), 0, 64, "hold", Holds())
    c = B.client_for(h, B.default_importer)
    B.shutdown()
    with pytest.raises(StaleHandleError, match="broker"):
        c.open(h, 0, wait=False)
    with pytest.raises(StaleHandleError, match="broker is gone"):
        B.client_for(h, B.default_importer)


def test_garbage_from_a_consumer_ends_only_its_connection(brk):
    chunk, holds = MemfdChunk(), Holds()
    h = brk.register(chunk, 0, 64, "hold", holds)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(h.address)
    send_message(s, {"kind": "open", "share": h.share, "token": h.token, "wait": False})
    msg, fds = recv_message(s, 10, max_fds=1)
    for fd in fds:
        os.close(fd)
    assert msg["kind"] == "lease" and brk.outstanding == 1
    s.sendall(b"\x00\x00\x00\x05{{{{{")  # a frame that is not JSON
    _wait_for(lambda: holds.given == ["hold"])  # the connection ended, and its lease with it
    assert s.recv(1) == b""
    s.close()
    h2 = brk.register(chunk, 0, 64, "hold2", holds)  # the broker serves others still
    c = B.client_for(h2, B.default_importer)
    lease, imp, *_ = c.open(h2, 0, wait=False)
    c.release(lease, imp)
    for junk in ({"kind": "open", "share": True, "token": "x", "wait": False}, {"kind": "release", "leases": "x"},
                 {"kind": "nope"}):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(h.address)
        send_message(s, junk)
        assert s.recv(1) == b""
        s.close()


def test_a_fake_broker_sending_garbage_is_a_protocol_error(tmp_path):
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    h = B.ShareHandle(path, 1, 1, "a" * 32, B._BOOT_ID, "")

    def serve():
        conn, _ = srv.accept()
        recv_message(conn, 10, max_fds=0)
        send_message(conn, {"kind": "lease", "lease": 1, "chunk": 1, "offset": 0, "nbytes": 64, "retired": [],
                            "event": "", "size": 64, "parts": [64], "mechanism": "memfd", "device_uuid": ""})
        conn.recv(1)

    pid = _child(serve)
    c = B.Client(h, B.default_importer)
    with pytest.raises(ProtocolError, match="malformed reply"):  # parts without fds
        c.open(h, 0, wait=False)
    c.close()
    assert _status(pid) == 0
    srv.close()


def test_wait_asks_the_broker_to_synchronise(brk):
    waited = []
    h = brk.register(MemfdChunk(), 0, 64, "hold", Holds(), event="EV", wait=waited.append,
                     event_handle=b"\x01" * 64)
    c = B.client_for(h, B.default_importer)
    lease, imp, _, _, ev = c.open(h, 0, wait=False)
    assert ev == b"\x01" * 64 and waited == []
    c.wait(lease)
    assert waited == ["EV"]
    lease2, imp2, *_ = c.open(h, 0, wait=True)
    assert waited == ["EV", "EV"]
    c.release(lease, imp)
    c.release(lease2, imp2)


def test_wrong_uid_is_refused(brk):
    """A broker that allows only another uid refuses us (SO_PEERCRED) before reading anything."""
    b = B.Broker(allow_uids={os.geteuid() + 12345})
    try:
        h = b.register(MemfdChunk(), 0, 64, "hold", Holds())
        c = B.Client(h, B.default_importer)
        with pytest.raises(StaleHandleError, match=f"uid {os.geteuid()} is not allowed"):
            c.open(h, 0, wait=False)
        c.close()
    finally:
        b.close()


def test_fds_and_imports_do_not_leak(brk):
    gc.collect()  # earlier tests' sockets and mappings
    before = set(open_fds())
    chunks = [MemfdChunk(1 << 14) for _ in range(3)]
    after_chunks = set(open_fds())
    holds = Holds()
    c = None
    for i in range(300):
        h = brk.register(chunks[i % 3], 0, 1 << 12, i, holds)
        c = B.client_for(h, B.default_importer)
        lease, imp, *_ = c.open(h, 0, wait=False)
        c.release(lease, imp)
    _wait_for(lambda: len(holds.given) == 300)
    assert c.mapped == 3  # one import per chunk, cached
    listening = brk._sock.fileno()
    B.shutdown()
    assert set(open_fds()) == after_chunks - {listening}
    for ch in chunks:
        ch.buf.close()
    assert set(open_fds()) == before - {listening}


def test_fork_gives_the_child_its_own_broker_and_leaves_the_parents(brk):
    h = brk.register(MemfdChunk(), 0, 64, "hold", Holds())
    c = B.client_for(h, B.default_importer)

    def child():
        b2 = B.broker()
        assert b2.address != h.address and b2.pid == os.getpid()
        B.shutdown()  # the child's own; the parent's sockets are untouched

    assert _status(_child(child)) == 0
    lease, imp, *_ = c.open(h, 0, wait=False)  # the parent's broker and connection still work
    c.release(lease, imp)
    assert os.path.exists(h.address)


def test_socket_folder_is_owner_only(brk, tmp_path, monkeypatch):
    assert (os.stat(os.path.dirname(brk.address)).st_mode & 0o777) == 0o700
    assert (os.stat(brk.address).st_mode & 0o777) == 0o600
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    monkeypatch.setenv("DMABUF_INTEROP_SOCKET_DIR", str(loose))
    with pytest.raises(InvalidArgumentError, match="mode 0700"):
        B.Broker()


def test_install_and_uninstall_restore_torch():
    torch = pytest.importorskip("torch")
    import torch.multiprocessing.reductions as reductions
    from multiprocessing.reduction import ForkingPickler

    from dmabuf_interop.integrations import torch_sharing as ts

    reducers = dict(ForkingPickler._extra_reducers)
    orig_rebuild = reductions.rebuild_cuda_tensor
    assert "_share_cuda_" not in torch.UntypedStorage.__dict__
    ts.install()
    ts.install()  # idempotent
    try:
        assert ts.installed()
        assert torch.UntypedStorage._share_cuda_ is ts._share_cuda_
        assert reductions.rebuild_cuda_tensor is ts.rebuild_cuda_tensor
        assert dict(ForkingPickler._extra_reducers) == reducers
        # a CPU tensor still pickles torch's way
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        assert torch.equal(ForkingPickler.loads(ForkingPickler.dumps(t)), t)
        with pytest.raises(InvalidArgumentError):
            ts.install(fallback="copy")
    finally:
        ts.uninstall()
    ts.uninstall()
    assert not ts.installed()
    assert "_share_cuda_" not in torch.UntypedStorage.__dict__
    assert reductions.rebuild_cuda_tensor is orig_rebuild
    assert dict(ForkingPickler._extra_reducers) == reducers


@pytest.mark.parametrize("kw, text", [({"allow_uids": "0"}, "allow_uids must be an iterable"),
                                      ({"allow_uids": 0}, "allow_uids must be an iterable"),
                                      ({"timeout": -1}, "timeout must be >= 0"),
                                      ({"timeout": "60"}, "timeout must be a number")])
def test_install_refuses_bad_uids_and_timeouts_before_anything_changes(kw, text):
    # These were accepted and only failed later, in a rebuild, in another process (or, for "0", refused
    # every broker: a set of characters never holds a uid).
    torch = pytest.importorskip("torch")
    import torch.multiprocessing.reductions as reductions

    from dmabuf_interop.integrations import torch_sharing as ts

    orig_rebuild = reductions.rebuild_cuda_tensor
    with pytest.raises(InvalidArgumentError, match=text):
        ts.install(**kw)
    assert not ts.installed()
    assert reductions.rebuild_cuda_tensor is orig_rebuild
    assert "_share_cuda_" not in torch.UntypedStorage.__dict__


def _args(handle: bytes, device=0) -> list:
    torch = pytest.importorskip("torch")
    return [torch.Tensor, (4,), (1,), 0, torch.storage.TypedStorage, torch.float32, device, handle, 64, 0, False,
            b"", 0, b"", False]


def test_rebuild_refuses_forged_and_stale_tuples_before_any_cuda(brk):
    torch = pytest.importorskip("torch")  # noqa: F841
    from dmabuf_interop.integrations.torch_sharing import rebuild_cuda_tensor

    h = brk.register(MemfdChunk(), 0, 64, "hold", Holds())
    forged = B.ShareHandle(h.address, h.pid, h.share, "f" * 32, h.boot_id, "")
    with pytest.raises(StaleHandleError, match=f"pid {os.getpid()}.*token does not match"):
        rebuild_cuda_tensor(*_args(forged.to_bytes()))
    with pytest.raises(InvalidArgumentError, match="share handle"):
        rebuild_cuda_tensor(*_args(B.MAGIC + b"[garbage"))
    with pytest.raises(InvalidArgumentError, match="CUDA device"):
        rebuild_cuda_tensor(*_args(h.to_bytes(), device="cpu"))
    gone = B.ShareHandle("/nonexistent/dmabuf-interop.sock", 99999, 1, "a" * 32, h.boot_id, "")
    with pytest.raises(StaleHandleError, match="broker is gone"):
        rebuild_cuda_tensor(*_args(gone.to_bytes()))


def test_the_device_argument_of_a_rebuild_is_checked_with_typed_errors():
    """``args[6]``, which callers may rewrite: an int, a ``torch.device`` or a ``"cuda:N"`` string; anything else is
    refused with InvalidArgumentError (not torch's TypeError or RuntimeError)."""
    torch = pytest.importorskip("torch")
    from dmabuf_interop.integrations.torch_sharing import _device_index

    assert _device_index(3) == 3 and _device_index("cuda:2") == 2 and _device_index(torch.device("cuda", 1)) == 1
    for bad in ("cpu", True, None, 1.5, "cuda:x", torch.device("cpu"), b"cuda:0"):
        with pytest.raises(InvalidArgumentError, match="args\\[6\\] must name a CUDA device"):
            _device_index(bad)
