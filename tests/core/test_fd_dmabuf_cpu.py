"""CPU-only tests of OwnedFd and of DmaBuf's refusal of fds that are not dma-bufs."""

from __future__ import annotations

import gc
import os
import select
import socket

import pytest

from dmabuf_interop import linux_dmabuf as dmabuf_mod
from dmabuf_interop.linux_dmabuf import DMA_BUF_NAME_LEN, DmaBuf, dmabuf_info, is_dmabuf
from dmabuf_interop.errors import DmaBufError, InvalidArgumentError, NotADmaBufError
from dmabuf_interop.fd import OwnedFd, fd_is_open, open_fds


@pytest.fixture(autouse=True)
def no_fd_leak():
    gc.collect()  # an earlier test's garbage closes its fds now, not inside this test's count
    before = open_fds()
    yield
    gc.collect()
    after = open_fds()
    assert after == before, f"fd leak: opened {sorted(set(after) - set(before))}, " \
                            f"closed {sorted(set(before) - set(after))}"


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        if fd_is_open(fd):
            os.close(fd)


def _closed_fd() -> int:
    fd = os.dup(0) if fd_is_open(0) else os.open("/dev/null", os.O_RDONLY)
    os.close(fd)
    assert not fd_is_open(fd)
    return fd


# --------------------------------------------------------------------------- OwnedFd


def test_close_closes_and_is_idempotent(pipe):
    r, w = pipe
    o = OwnedFd(w)
    assert o.fd == w and o.fileno() == w and not o.closed
    o.close()
    assert o.closed and not fd_is_open(w)
    o.close()  # idempotent
    with pytest.raises(ValueError):
        o.fd
    with pytest.raises(ValueError):
        o.fileno()
    assert "closed" in repr(o)
    assert os.read(r, 1) == b""  # the only write end is gone: EOF


def test_detach_hands_off_ownership(pipe):
    r, w = pipe
    o = OwnedFd(w)
    assert o.detach() == w
    assert o.closed
    del o
    gc.collect()
    assert fd_is_open(w)  # neither detach nor the finalizer closed it
    os.write(w, b"k")
    assert os.read(r, 1) == b"k"


def test_dup_is_independent_and_close_on_exec(pipe):
    r, w = pipe
    with OwnedFd(w) as o:
        d = o.dup()
        assert type(d) is OwnedFd
        assert d.fd != w and os.get_inheritable(d.fd) is False
        assert os.fstat(d.fd).st_ino == os.fstat(w).st_ino
    assert not fd_is_open(w)
    os.write(d.fd, b"via dup")  # still open after the original closed
    assert os.read(r, 16) == b"via dup"
    dfd = d.fd
    d.close()
    assert not fd_is_open(dfd)


def test_context_manager_closes_even_on_error(pipe):
    r, w = pipe
    with pytest.raises(RuntimeError):
        with OwnedFd(w) as o:
            assert o.fd == w
            raise RuntimeError("boom")
    assert o.closed and not fd_is_open(w)


def test_finalizer_closes_on_gc(pipe):
    r, w = pipe
    o = OwnedFd(w)
    assert fd_is_open(w)
    del o
    gc.collect()
    assert not fd_is_open(w)


def test_finalizer_closes_in_a_reference_cycle(pipe):
    r, w = pipe
    o = OwnedFd(w)
    o.self_ref = o  # a cycle: only the cyclic collector can free it
    del o
    gc.collect()
    assert not fd_is_open(w)


def test_works_with_select(pipe):
    r, w = pipe
    with OwnedFd(r) as o:
        os.write(w, b"x")
        ready, _, _ = select.select([o], [], [], 1.0)
        assert ready == [o]


@pytest.mark.parametrize("bad", [-1, -100])
def test_rejects_negative(bad):
    with pytest.raises(InvalidArgumentError, match="negative"):
        OwnedFd(bad)


def test_rejects_closed_fd():
    fd = _closed_fd()
    with pytest.raises(InvalidArgumentError, match="not open"):
        OwnedFd(fd)


@pytest.mark.parametrize("bad", ["3", 3.0, None, True, b"3", [3]])
def test_rejects_non_int(bad):
    with pytest.raises(InvalidArgumentError, match="int") as info:
        OwnedFd(bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DmaBufError)


# --------------------------------------------------------------------------- is_dmabuf / DmaBuf


@pytest.fixture(params=["pipe", "file", "memfd", "socket"])
def non_dmabuf(request, tmp_path):
    """(fd, words its NotADmaBufError message must contain) for one kind of non-dma-buf fd."""
    if request.param == "pipe":
        fd, other = os.pipe()
        owned, words = [fd, other], "a pipe"
    elif request.param == "file":
        path = tmp_path / "plain.bin"
        path.write_bytes(b"\0" * 4096)
        fd = os.open(path, os.O_RDWR)
        owned, words = [fd], repr(str(path))
    elif request.param == "memfd":
        fd = os.memfd_create("not-a-dmabuf")
        os.ftruncate(fd, 4096)
        owned, words = [fd], "a memfd"
    else:
        a, b = socket.socketpair()
        fd = a.detach()
        owned, words = [fd, b.detach()], "a socket"
    yield fd, words
    for x in owned:
        if fd_is_open(x):
            os.close(x)


def test_is_dmabuf_false_for_open_non_dmabufs(non_dmabuf):
    fd, _ = non_dmabuf
    assert fd_is_open(fd)
    assert is_dmabuf(fd) is False


@pytest.mark.parametrize("bad", [-1, "3", None, 2.0])
def test_is_dmabuf_false_for_invalid(bad):
    assert is_dmabuf(bad) is False


def test_is_dmabuf_false_for_closed_fd():
    assert is_dmabuf(_closed_fd()) is False


def test_dmabuf_refuses_non_dmabuf_and_leaves_fd_alone(non_dmabuf):
    fd, words = non_dmabuf
    with pytest.raises(NotADmaBufError) as info:
        DmaBuf(fd)
    msg = str(info.value)
    assert f"fd {fd} is not a dma-buf" in msg and words in msg, msg
    assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)
    assert fd_is_open(fd)  # a refused fd stays with its caller, not closed
    with pytest.raises(NotADmaBufError, match="not a dma-buf"):
        DmaBuf(fd, size=4096)
    with pytest.raises(NotADmaBufError, match="not a dma-buf"):
        dmabuf_info(fd)
    assert fd_is_open(fd)


def test_dmabuf_refuses_invalid_and_closed():
    with pytest.raises(NotADmaBufError, match="not a valid file descriptor"):
        DmaBuf(-1)
    with pytest.raises(NotADmaBufError, match="not a valid file descriptor"):
        dmabuf_info(-1)
    fd = _closed_fd()
    with pytest.raises(NotADmaBufError, match=f"fd {fd} is not open"):
        DmaBuf(fd)
    with pytest.raises(NotADmaBufError, match="not open"):
        dmabuf_info(fd)


# --------------------------------------------------------------------------- uAPI numbers


def test_ioctl_numbers_match_linux_uapi():
    # include/uapi/linux/dma-buf.h on a 64-bit kernel
    assert dmabuf_mod.DMA_BUF_IOCTL_SYNC == 0x40086200  # _IOW('b', 0, struct dma_buf_sync)
    assert dmabuf_mod.DMA_BUF_SET_NAME == 0x40086201  # _IOW('b', 1, const char *)
    assert dmabuf_mod.DMA_BUF_IOCTL_EXPORT_SYNC_FILE == 0xC0086202  # _IOWR('b', 2, struct dma_buf_export_sync_file)
    assert DMA_BUF_NAME_LEN == 32
    assert (dmabuf_mod.DMA_BUF_SYNC_READ, dmabuf_mod.DMA_BUF_SYNC_WRITE) == (1, 2)
    assert (dmabuf_mod.DMA_BUF_SYNC_START, dmabuf_mod.DMA_BUF_SYNC_END) == (0, 4)
