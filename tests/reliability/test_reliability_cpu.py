"""Issue 6 on a machine with no GPU: bad input, dying peers, many peers, long runs, security.

Real fds, real sockets, real forks, no mocks of the kernel. The fd-transport
cases of issue 6 item 1 live in ``test_fdpass.py``; this file covers what
sits on top of them: the importers' user-space checks (made before any
driver call, so they work where there is no driver), the memfd mechanism end
to end under dying peers and eight consumers, a 2000-cycle soak, and the
security rules (close-on-exec, nothing unpickled, no named sockets).
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmabuf_interop import _driver as driver
from dmabuf_interop.errors import InvalidArgumentError, NotADmaBufError, PeerClosedError, ProtocolError
from dmabuf_interop.fd import OwnedFd, fd_is_open, open_fds
from dmabuf_interop.fdpass import recv_message, recv_token, send_message, send_token
from dmabuf_interop.procs import wait_child
from dmabuf_interop.mechanisms.memfd import count_mismatches_host, export_memfd, host_array, import_memfd, write_pattern_host
from tests.helpers import fork_child as _fork

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "dmabuf_interop"


def _memfd_maps() -> int:
    """How many of this process's mappings are our memfds (/proc/self/maps)."""
    with open("/proc/self/maps") as fh:
        return sum("/memfd:dmabuf-interop" in line for line in fh)


@pytest.fixture(autouse=True)
def no_leak():
    """The fds and the memfd mappings of this process are the same after every test."""
    gc.collect()
    fds, maps = open_fds(), _memfd_maps()
    yield
    gc.collect()
    assert open_fds() == fds, f"fd leak: {sorted(set(open_fds()) - set(fds))}"
    assert _memfd_maps() == maps, "a memfd mapping outlived its buffer"




# --------------------------------------------------------------------------- fds that are not dma-bufs


@pytest.fixture
def forbid_driver(monkeypatch):
    """Fail the test if anything reaches the CUDA driver."""
    calls = []

    def refuse(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"driver.{name} was called before the user-space checks")
        return fn

    for name in ("init", "bindings", "set_current", "device", "import_external_memory_dmabuf",
                 "external_memory_mapped_buffer", "vmm_import_posix_fd", "mem_alloc", "mem_alloc_host",
                 "vmm_create", "pointer_facts"):
        monkeypatch.setattr(driver, name, refuse(name))
    yield calls
    assert calls == []


def _closed_fd() -> int:
    fd = os.open("/dev/null", os.O_RDONLY)
    os.close(fd)
    return fd


@pytest.fixture(params=["minus-one", "closed", "pipe", "regular-file", "memfd", "socket", "dev-null"])
def not_a_dmabuf(request, tmp_path):
    """(fd, what the error must say); whatever is opened is closed afterwards."""
    opened = []
    kind = request.param
    if kind == "minus-one":
        fd, says = -1, "not a valid file descriptor"
    elif kind == "closed":
        fd, says = _closed_fd(), "not open"
    elif kind == "pipe":
        r, w = os.pipe()
        opened += [r, w]
        fd, says = r, "a pipe"
    elif kind == "regular-file":
        path = tmp_path / "data.bin"
        path.write_bytes(b"\0" * 16384)
        fd, says = os.open(path, os.O_RDONLY), "data.bin"
        opened.append(fd)
    elif kind == "memfd":
        fd, says = os.memfd_create("not-a-dmabuf"), "a memfd"
        os.ftruncate(fd, 16384)
        opened.append(fd)
    elif kind == "socket":
        a, b = socket.socketpair()
        opened += [a.detach(), b.detach()]
        fd, says = opened[0], "a socket"
    else:
        fd, says = os.open("/dev/null", os.O_RDWR), "/dev/null"
        opened.append(fd)
    yield fd, says
    for o in opened:
        os.close(o)


def test_import_dmabuf_refuses_what_is_not_a_dmabuf_before_the_driver(not_a_dmabuf, forbid_driver):
    from dmabuf_interop.mechanisms.dmabuf import import_dmabuf

    fd, says = not_a_dmabuf
    open_before = fd_is_open(fd)
    with pytest.raises(NotADmaBufError, match=says):
        import_dmabuf(fd, 16384, 0, 0)
    # Bad size, offset and device do not change the answer: the fd is checked first.
    with pytest.raises(NotADmaBufError):
        import_dmabuf(fd, 0, -3, -5)
    assert fd_is_open(fd) == open_before, "a refused import must not close (or consume) the caller's fd"


def test_import_dmabuf_takes_the_owned_fd_it_was_received_in(forbid_driver):
    """An OwnedFd (what a receiver holds) is judged by its fd, not refused as 'not a valid fd'."""
    from dmabuf_interop.mechanisms.dmabuf import import_dmabuf

    r, w = os.pipe()
    with OwnedFd(r) as owned, OwnedFd(w):
        with pytest.raises(NotADmaBufError, match=f"fd {r} is not a dma-buf: it is a pipe"):
            import_dmabuf(owned, 4096)


def test_import_posix_fd_checks_the_range_before_the_driver(forbid_driver):
    from dmabuf_interop.mechanisms.posix_fd import import_posix_fd

    # A character device passes the user-space kind check (CUDA handles are char-device or
    # anonymous-inode files), so the range checks are what answer here.
    with OwnedFd(os.open("/dev/null", os.O_RDWR)) as owned:
        with pytest.raises(InvalidArgumentError, match="exceeds the allocation's 2097152 bytes"):
            import_posix_fd(owned, 4096, 0, offset=2097152, export_size=2097152)
        with pytest.raises(InvalidArgumentError, match="size must be"):
            import_posix_fd(owned, 0, 0)
        with pytest.raises(InvalidArgumentError, match="offset must be"):
            import_posix_fd(owned, 4, 0, offset=-4)


def test_import_posix_fd_refuses_what_is_visibly_no_cuda_handle(not_a_dmabuf, forbid_driver):
    """The driver answers CUDA_ERROR_UNKNOWN for a pipe, memfd or file (H200, driver 580);
    the importer names what the fd is instead, without asking the driver."""
    from dmabuf_interop.mechanisms.posix_fd import import_posix_fd

    fd, _ = not_a_dmabuf
    link = os.readlink(f"/proc/self/fd/{fd}") if fd_is_open(fd) else ""
    if link == "/dev/null":
        pytest.skip("a character device: only the driver can tell")
    with pytest.raises(InvalidArgumentError) as err:
        import_posix_fd(fd, 4096, 0)
    assert "not an open file descriptor" in str(err.value) or "not a CUDA POSIX-fd handle" in str(err.value)
    assert fd < 0 or not link or fd_is_open(fd)


@pytest.mark.parametrize("fd", [-1, "closed"])
def test_import_posix_fd_refuses_bad_fds_before_the_driver(fd, forbid_driver):
    from dmabuf_interop.mechanisms.posix_fd import import_posix_fd

    fd = _closed_fd() if fd == "closed" else fd
    with pytest.raises(InvalidArgumentError, match="not an open file descriptor"):
        import_posix_fd(fd, 4096, 0)


def _bad_exports():
    from dmabuf_interop.mechanisms import dmabuf as exporter
    from dmabuf_interop.mechanisms import memfd
    from dmabuf_interop.mechanisms import posix_fd as vmm

    ptr = 0x7F0000000000
    return {
        "export_device(0)": lambda: exporter.export_device(0),
        "export_device(-4096)": lambda: exporter.export_device(-4096),
        "export_host(0)": lambda: exporter.export_host(0),
        "export_host(True)": lambda: exporter.export_host(True),
        "export_posix_fd(0)": lambda: vmm.export_posix_fd(0),
        "export_posix_fd(-1)": lambda: vmm.export_posix_fd(-1),
        "export_posix_fd(4096.0)": lambda: vmm.export_posix_fd(4096.0),
        "export_range(ptr, 0)": lambda: exporter.export_range(ptr, 0),
        "export_range(ptr) without a size": lambda: exporter.export_range(ptr),
        "export_memfd(0)": lambda: memfd.export_memfd(0),
        "export_memfd(-8)": lambda: memfd.export_memfd(-8),
    }


@pytest.mark.parametrize("call", sorted(_bad_exports()))
def test_exporters_refuse_bad_sizes_before_the_driver(call, forbid_driver):
    with pytest.raises(InvalidArgumentError):
        _bad_exports()[call]()


# --------------------------------------------------------------------------- the memfd importer


@pytest.fixture
def exported():
    with export_memfd(16384) as exp:
        write_pattern_host(exp)
        yield exp


@pytest.mark.parametrize("size,offset,match", [
    (16388, 0, "exceeds the memfd's 16384 bytes"),
    (16384, 4, "exceeds"),
    (4, 16384, "exceeds"),
    (4, 1 << 40, "exceeds"),
    (0, 0, "size must be > 0"),
    (-4, 0, "size must be > 0"),
    (4.0, 0, "size must be an integer"),
    (True, 0, "size must be an integer"),
    (4, -4, "offset must be >= 0"),
    (4, 0.5, "offset must be an integer"),
])
def test_import_memfd_refuses_bad_ranges(exported, size, offset, match):
    with pytest.raises(InvalidArgumentError, match=match):
        import_memfd(exported.fd, size, offset)
    assert fd_is_open(exported.fd)


def test_import_memfd_at_an_offset_reads_exactly_those_bytes(exported):
    with import_memfd(exported.fd, 4096, 8192) as imp:
        assert list(host_array(imp)) == list(host_array(exported)[2048:3072])
        assert count_mismatches_host(imp, 0x1000 + 2048) == 0


def test_import_memfd_refuses_non_memfds(tmp_path):
    r, w = os.pipe()
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 4096)
    f = os.open(path, os.O_RDONLY)
    try:
        for fd in (r, f):
            with pytest.raises(InvalidArgumentError, match="not a memfd"):
                import_memfd(fd, 4096)
        for bad in (-1, _closed_fd()):
            with pytest.raises(InvalidArgumentError, match="not an open file descriptor"):
                import_memfd(bad, 4096)
    finally:
        for fd in (r, w, f):
            os.close(fd)


def test_import_memfd_refuses_a_memfd_its_sender_could_shrink():
    """An unsealed memfd can be truncated under the mapping: the next read is SIGBUS.
    Demonstrated in a child, then refused by the importer."""
    fd = os.memfd_create("dmabuf-interop-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 16384)

        def reader():
            import faulthandler
            import mmap

            faulthandler.disable()  # the SIGBUS is the point: no "Fatal Python error" dump in the test log
            m = mmap.mmap(fd, 16384, mmap.MAP_SHARED, mmap.PROT_READ)
            os.ftruncate(fd, 0)  # what a hostile or buggy sender can do
            m[8192]  # noqa: B018 - SIGBUS
            return 0

        ended = wait_child(_fork(reader), 30)
        assert ended.signal == signal.SIGBUS
        os.ftruncate(fd, 16384)
        with pytest.raises(InvalidArgumentError, match="F_SEAL_SHRINK"):
            import_memfd(fd, 16384)
    finally:
        os.close(fd)


def test_exported_memfd_cannot_be_shrunk_or_grown(exported):
    for size in (0, 8192, 1 << 20):
        with pytest.raises(PermissionError):
            os.ftruncate(exported.fd, size)


# --------------------------------------------------------------------------- soak


def test_memfd_soak_2000_cycles_over_a_socketpair(capsys):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        def cycle(i: int) -> None:
            base = 0x1000 + i * 7919 % (1 << 24)
            with export_memfd(16384) as exp:
                write_pattern_host(exp, base)
                exp.send(a)
                msg, fds = recv_message(b, 5)
                with OwnedFd(fds[0]) as got, import_memfd(got, msg["size"], msg["offset"]) as imp:
                    assert count_mismatches_host(imp, base) == 0, f"cycle {i}"

        cycle(-1)  # warm-up: numpy, lazily created objects
        gc.collect()
        fds, maps = open_fds(), _memfd_maps()
        n = 2000
        start = time.perf_counter()
        for i in range(n):
            cycle(i)
        cost = (time.perf_counter() - start) / n * 1e6
        gc.collect()
        assert open_fds() == fds
        assert _memfd_maps() == maps
    with capsys.disabled():
        print(f"\n  memfd soak in one process: {n} cycles, {cost:.1f} us per cycle (not asserted)")


def test_soak_script_memfd_two_processes(tmp_path):
    report = tmp_path / "soak.json"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--mechanism", "memfd",
                          "--cycles", "500", "--timeout", "20", "--json", str(report)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    (r,) = json.loads(report.read_text())["results"]
    assert r["status"] == "pass", r
    p, c = r["producer"], r["consumer"]
    assert p["cycles"] == 500 and p["mismatches"] == 0 and p["errors"] == []
    assert p["fds_start"] == p["fds_end"] and c["fds_start"] == c["fds_end"]
    assert "cost per cycle" in out.stdout and "PASS" in out.stdout


# --------------------------------------------------------------------------- dying peers


def test_consumer_killed_while_producer_waits_for_ack():
    """The producer's wait for the ack ends by EOF (well before its timeout) and it frees."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def consumer():
        parent.close()
        msg, fds = recv_message(child, 10)
        imp = import_memfd(fds[0], msg["size"])
        send_message(child, {"mismatches": count_mismatches_host(imp)})
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the mapping, before the ack
        return 0

    pid = _fork(consumer)
    child.close()
    with parent:
        exp = export_memfd(1 << 20)
        write_pattern_host(exp)
        exp.send(parent)
        assert recv_message(parent, 10)[0] == {"mismatches": 0}
        start = time.monotonic()
        with pytest.raises(PeerClosedError):
            recv_token(parent, timeout=30)
        assert time.monotonic() - start < 5, "the wait must end by EOF, not by the timeout"
        exp.close()
        assert exp.closed
    ended = wait_child(pid, 10)
    assert ended.signal == signal.SIGKILL


@pytest.mark.parametrize("consumer_has", ["mapping", "fd-only"])
def test_producer_killed_after_sending_consumer_keeps_valid_memory(consumer_has):
    """A memfd's pages live while any fd or mapping refers to them: the producer's death
    changes nothing for a consumer that holds the mapping (or only the fd), and the
    consumer cleans up normally afterwards."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def producer():
        parent.close()
        exp = export_memfd(1 << 20)
        write_pattern_host(exp, 0x2000)
        exp.send(child)
        time.sleep(3600)  # killed here, never frees
        return 0

    pid = _fork(producer)
    child.close()
    with parent:
        msg, fds = recv_message(parent, 10)
    with OwnedFd(fds[0]) as fd:
        imp = import_memfd(fd, msg["size"]) if consumer_has == "mapping" else None
        if imp is not None:
            fd.close()  # only the mapping is left
        os.kill(pid, signal.SIGKILL)
        assert wait_child(pid, 10).signal == signal.SIGKILL
        if imp is None:
            imp = import_memfd(fd, msg["size"])  # the fd alone kept the memory
    with imp:
        assert count_mismatches_host(imp, 0x2000) == 0
        write_pattern_host(imp, 0x3000)  # still writable
        assert count_mismatches_host(imp, 0x3000) == 0


def test_one_producer_eight_consumers_at_once():
    """Each consumer maps and verifies the same memfd; all eight hold their mappings at
    the same time; the producer frees only after all eight acks."""
    n = 8
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
    pids = []
    for i in range(n):
        def consumer(i=i):
            for j, (p, c) in enumerate(pairs):
                p.close()
                if j != i:
                    c.close()
            sock = pairs[i][1]
            msg, fds = recv_message(sock, 20)
            with OwnedFd(fds[0]) as fd, import_memfd(fd, msg["size"]) as imp:
                send_message(sock, {"consumer": i, "pid": os.getpid(), "mismatches": count_mismatches_host(imp)})
                recv_token(sock, 20)  # "release": every consumer holds its mapping until now
            send_token(sock, b"A")
            return 0
        pids.append(_fork(consumer))
    for _, c in pairs:
        c.close()
    socks = [p for p, _ in pairs]
    try:
        with export_memfd(1 << 20) as exp:
            write_pattern_host(exp)
            for s in socks:
                exp.send(s)
            results = [recv_message(s, 20)[0] for s in socks]
            assert sorted(r["consumer"] for r in results) == list(range(n))
            assert all(r["mismatches"] == 0 for r in results), results
            # All eight map the buffer right now.
            inode = os.fstat(exp.fd).st_ino
            for r in results:
                with open(f"/proc/{r['pid']}/maps") as fh:
                    assert any(f" {inode} " in line and "memfd:dmabuf-interop" in line for line in fh), r
            for s in socks:
                send_token(s, b"R")
            acks = [recv_token(s, 20) for s in socks]
            assert acks == [b"A"] * n
            assert not exp.closed  # freed only now, after the last ack
    finally:
        for s in socks:
            s.close()
        ends = [wait_child(pid, 20) for pid in pids]
    assert all(e.ok for e in ends), [e.describe() for e in ends]


# --------------------------------------------------------------------------- security


_LIST_FDS = ("import os\nfor n in sorted(os.listdir('/proc/self/fd'), key=int):\n"
             "    try:\n        print(os.readlink('/proc/self/fd/' + n))\n    except OSError:\n        pass\n")


def test_fds_the_library_creates_or_receives_are_close_on_exec_and_not_inherited():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, export_memfd(16384) as exp:
        exp.send(a)
        msg, fds = recv_message(b, 5)
        with OwnedFd(fds[0]) as received, received.dup() as duplicate:
            ours = [exp.fd, received.fd, duplicate.fd]
            assert all(not os.get_inheritable(fd) for fd in ours)
            # close_fds=False: only close-on-exec keeps them out of the exec'd child.
            seen = subprocess.run([sys.executable, "-c", _LIST_FDS], close_fds=False, capture_output=True,
                                  text=True, timeout=30).stdout
            assert "memfd:dmabuf-interop" not in seen, seen
            # Positive control: an fd marked inheritable does reach the child.
            os.set_inheritable(duplicate.fd, True)
            seen = subprocess.run([sys.executable, "-c", _LIST_FDS], close_fds=False, capture_output=True,
                                  text=True, timeout=30).stdout
            assert "memfd:dmabuf-interop" in seen


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle",
                     "multiprocessing.connection", "multiprocessing.reduction"}
#: Modules allowed to unpickle, and why. Never on the library's sharing path.
UNPICKLING_ALLOWED = {
    "peers.py": "the benchmark's torch-IPC baseline measures torch's own pickled hand-off "
                      "(ForkingPickler) between two benchmark processes, for comparison",
    "weight_sync_peers.py": "the weight-sync benchmark's peers measure torch's pickled IPC handles "
                            "between two benchmark processes, for comparison",
}


def _package_sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10
    return files


def test_nothing_is_unpickled_package_imports_no_deserialiser():
    offenders = []
    for path in _package_sources():
        if path.name in UNPICKLING_ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec"):
                offenders.append(f"{path.name}:{node.lineno}: {node.func.id}()")
            for name in names:
                if name in FORBIDDEN_MODULES or name.split(".")[0] in FORBIDDEN_MODULES:
                    offenders.append(f"{path.name}:{node.lineno}: imports {name}")
    assert offenders == []
    # The allowed modules are leaves: nothing on the sharing path imports them.
    for path in _package_sources():
        if path.name in UNPICKLING_ALLOWED or path.parent.name == "bench":
            continue
        for allowed in UNPICKLING_ALLOWED:
            assert f".{allowed[:-3]}" not in path.read_text(), f"{path.name} imports {allowed}"


def test_a_pickle_from_a_peer_is_a_protocol_error_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    body = pickle.dumps(Evil())
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(struct.pack(">I", len(body)) + body)
        with pytest.raises(ProtocolError):
            recv_message(b, 5)
    assert not marker.exists()


def test_no_named_socket_without_peer_credentials_and_owner_only_permissions():
    """The project binds no named socket today (socketpair only). Any future bind() must
    come with an SO_PEERCRED check and owner-only permissions in the same module."""
    for path in _package_sources():
        text = path.read_text()
        tree = ast.parse(text, str(path))
        binds = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "bind"]
        if binds:
            assert "SO_PEERCRED" in text, f"{path.name}: bind() without an SO_PEERCRED check"
            assert "0o600" in text or "0o700" in text or "umask" in text, \
                f"{path.name}: bind() without owner-only permissions"


def test_received_bad_metadata_is_not_trusted_for_memfd_import():
    """A peer's metadata claiming more bytes than it sent is refused by the importer."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b, export_memfd(4096) as exp:
        send_message(a, {**exp.describe().to_json(), "size": 1 << 30}, exp.fd)
        msg, fds = recv_message(b, 5)
        with OwnedFd(fds[0]) as fd:
            with pytest.raises(InvalidArgumentError, match="exceeds"):
                import_memfd(fd, msg["size"], msg["offset"])



def test_host_mapping_tells_the_drivers_shared_anonymous_memory_from_a_callers_own():
    import ctypes
    import mmap

    from dmabuf_interop.mechanisms.dmabuf import _is_registered_host_memory
    from dmabuf_interop.procs import host_mapping

    shared = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    own = ctypes.create_string_buffer(1 << 16)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))
        assert host_mapping(addr) == ("rw-s", "/dev/zero (deleted)")
        assert not _is_registered_host_memory(addr)  # how cuMemAllocHost memory is mapped
        perms, _ = host_mapping(ctypes.addressof(own))
        assert perms.startswith("rw") and perms[3] == "p"
        assert _is_registered_host_memory(ctypes.addressof(own))
        assert host_mapping(0) is None
    finally:
        del addr
        gc.collect()
        shared.close()
