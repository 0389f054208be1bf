"""memfd sharing: read-only shares, and sharing with no /proc mounted. Real memfds, mappings, forks."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dmabuf_interop import errors, export_memfd, import_memfd
from dmabuf_interop.fd import fd_kind, open_fds
from dmabuf_interop.mechanisms.memfd import F_SEAL_FUTURE_WRITE
from tests.helpers import env_with_src

SIZE = 16384


@pytest.fixture(autouse=True)
def no_fd_leak():
    gc.collect()  # an earlier test's garbage closes its fds now, not inside this test's count
    before = open_fds()
    yield
    assert open_fds() == before


def _sealed_memfd(extra_seal: int) -> int:
    fd = os.memfd_create("ro", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, b"\x07" * SIZE, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | extra_seal)
    return fd


def _reopened_read_only(extra_seal: int) -> int:
    fd = _sealed_memfd(extra_seal)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


@pytest.mark.parametrize("make", [lambda: _sealed_memfd(fcntl.F_SEAL_WRITE),
                                  lambda: _sealed_memfd(F_SEAL_FUTURE_WRITE),
                                  lambda: _reopened_read_only(0)],
                         ids=["F_SEAL_WRITE", "F_SEAL_FUTURE_WRITE", "reopened-O_RDONLY"])
def test_read_only_memfd_maps_read_only(make):
    fd = make()
    try:
        with import_memfd(fd, SIZE) as buf:
            assert buf.read_only
            a = buf.as_array()
            assert not a.flags.writeable
            assert int(a[0]) == 7 and int(a[-1]) == 7
            with pytest.raises(ValueError, match="read-only"):
                a[0] = 1
            del a
    finally:
        os.close(fd)


def test_exporter_seals_read_only_after_writing():
    with export_memfd(SIZE) as exported:
        exported.as_array()[:] = 9
        exported.seal_read_only()
        exported.as_array()[1] = 10  # the exporter's own mapping stays writable
        with import_memfd(exported.fd, SIZE) as imported:
            view = imported.as_array()
            assert imported.read_only and not view.flags.writeable
            assert view[0] == 9 and view[1] == 10
            del view
        with pytest.raises(PermissionError):  # the kernel refuses writes through the fd too
            os.pwrite(exported.fd, b"x", 0)


def test_unsealed_export_still_maps_writable():
    with export_memfd(SIZE) as exported, import_memfd(exported.fd, SIZE) as imported:
        assert not imported.read_only
        imported.as_array()[0] = 5
        assert exported.as_array()[0] == 5


_NO_PROC = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    assert not os.path.exists("/proc/self/fd"), "a tmpfs should hide /proc"
    from dmabuf_interop import export_memfd, import_memfd, is_dmabuf
    from dmabuf_interop.fd import fd_kind
    from dmabuf_interop.linux_dmabuf import _describe
    out = {}
    with export_memfd(8192) as e, import_memfd(e.fd, 8192, 0) as i:
        e.as_array()[:] = 3
        out["round_trip"] = int(i.as_array()[100])
        out["kind_memfd"] = fd_kind(e.fd)
    r, w = os.pipe()
    a, b = socket.socketpair()
    out["kinds"] = [fd_kind(r), fd_kind(a.fileno())]
    out["is_dmabuf"] = is_dmabuf(r)
    out["describe"] = _describe(r)
    cli = subprocess.run([sys.executable, "-m", "dmabuf_interop", "--mechanism", "memfd"], capture_output=True,
                         text=True, timeout=60)
    out["cli"] = [cli.returncode, cli.stdout.rstrip().splitlines()[-1:], cli.stderr]
    info = subprocess.run([sys.executable, "-m", "dmabuf_interop", "info", "--json"], capture_output=True,
                          text=True, timeout=120)
    out["info_memfd"] = json.loads(info.stdout)["mechanisms"]["memfd"]
    print(json.dumps(out))
""")


def test_memfd_sharing_needs_no_proc():
    """In a private mount namespace with an empty tmpfs over /proc: export and import work, fds are
    recognised by fstat/fstatfs, the demos pass and info agrees that memfd is usable."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          'mount -t tmpfs none /proc && exec "$0" -c "$1"', sys.executable, _NO_PROC],
                         capture_output=True, text=True, timeout=240, env=env_with_src())
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["round_trip"] == 3 and got["kind_memfd"] == "memfd"
    assert got["kinds"] == ["pipe", "socket"] and got["is_dmabuf"] is False
    assert got["describe"].endswith("it is a pipe")
    assert got["cli"] == [0, ["Done"], ""]
    assert got["info_memfd"]["usable"] is True, got["info_memfd"]


def test_fd_kind_tells_memfd_from_file_on_disk(tmp_path):
    with open(tmp_path / "f", "wb") as fh:
        assert fd_kind(fh.fileno()) == "file"
    with pytest.raises(errors.InvalidArgumentError, match="not a memfd: it is a file"):
        with open(tmp_path / "f", "rb") as fh:
            import_memfd(fh.fileno(), 1)
