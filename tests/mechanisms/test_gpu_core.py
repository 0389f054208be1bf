"""GPU tests of the core library: export, import, POSIX-fd handles, DLPack, kernels.

Marked ``gpu``: skipped with the reason where no CUDA GPU is present. dma-buf
import tests skip with the driver's own answer where it is unsupported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dmabuf_interop import _driver as driver
from dmabuf_interop import capabilities
from dmabuf_interop.linux_dmabuf import DmaBuf, is_dmabuf
from dmabuf_interop.errors import CudaError, InvalidArgumentError, NotSupportedError
from dmabuf_interop.fd import open_fds
from dmabuf_interop.kinds import PROBE_KEYS
from dmabuf_interop.mechanisms.probes import probe_device
from tests.helpers import env_with_src

pytestmark = pytest.mark.gpu

PATTERN = 0x1000 + np.arange(4096, dtype=np.int32)


def _warm_up() -> None:
    """The driver opens its own fds (/dev/nvidia*, eventfds) on first use: open them first,
    so fd counts before and after a cycle compare our fds only."""
    from dmabuf_interop.kernels import count_mismatches, write_pattern
    from dmabuf_interop.mechanisms.posix_fd import export_posix_fd, import_posix_fd

    with export_posix_fd(4096, 0) as exp:
        write_pattern(exp.ptr, 4096, 0)
        with import_posix_fd(exp.fd, 4096, 0) as imp:
            count_mismatches(imp.ptr, 4096, 0)


def _pattern_ok(ptr: int, nbytes: int, device: int) -> int:
    from dmabuf_interop.kernels import count_mismatches

    return count_mismatches(ptr, nbytes, device)


def test_attributes_are_ints_or_unknown():
    attrs = capabilities.device_attributes(0)
    assert set(attrs) == set(capabilities.ATTRIBUTES)
    for name, value in attrs.items():
        assert value is None or value in (0, 1), (name, value)


def test_export_device_gives_a_named_dmabuf():
    from dmabuf_interop.mechanisms.dmabuf import export_device
    from dmabuf_interop._checks import page_size

    _warm_up()
    export_device(4096, 0).close()
    before = open_fds()
    if capabilities.attribute(0, "DMA_BUF_SUPPORTED") != 1:
        with pytest.raises(NotSupportedError):
            export_device(16384, 0)
        pytest.skip("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is not 1")
    with export_device(16384, 0) as exp:
        assert exp.mechanism == "dmabuf" and exp.memory == "device"
        assert exp.ptr % page_size() == 0 and exp.offset == 0
        assert is_dmabuf(exp.fd)
        info = exp.handle.info()
        assert info.size == exp.export_size == 16384
        assert info.exp_name  # e.g. nv_dmabuf
        exp.handle.set_name("dmabuf-interop-test")
        assert exp.handle.info().name.startswith("dmabuf-interop-test")
        with exp.handle.export_sync_file(write=False) as sync_fd:
            assert sync_fd.fd >= 0
        dup = exp.handle.dup()
        assert dup.fd != exp.fd and dup.info().inode == info.inode
        dup.close()
        assert exp.device_uuid.startswith("GPU-")
    assert open_fds() == before


def test_export_host_follows_the_attribute():
    from dmabuf_interop.mechanisms.dmabuf import export_host

    supported = capabilities.attribute(0, "HOST_ALLOC_DMA_BUF_SUPPORTED")
    if supported == 1:
        with export_host(16384, 0) as exp:
            assert exp.memory == "host" and is_dmabuf(exp.fd)
    else:
        with pytest.raises(NotSupportedError) as err:
            export_host(16384, 0)
        assert err.value.call == "cuMemGetHandleForAddressRange"
        assert "HOST_ALLOC_DMA_BUF_SUPPORTED" in str(err.value)


def test_dmabuf_round_trip_or_driver_answer():
    from dmabuf_interop.mechanisms.dmabuf import export_device
    from dmabuf_interop.mechanisms.dmabuf import import_dmabuf
    from dmabuf_interop.kernels import write_pattern

    with export_device(16384, 0) as exp:
        write_pattern(exp.ptr, exp.size, 0)
        try:
            imp = import_dmabuf(exp.handle, exp.size, 0, exp.offset)
        except NotSupportedError as exc:
            assert exc.call == "cuImportExternalMemory"
            pytest.skip(f"driver cannot import dma-bufs: {exc}")
        with imp:
            assert _pattern_ok(imp.ptr, imp.size, 0) == 0


def test_import_rejects_oversize_before_the_driver():
    from dmabuf_interop.mechanisms.dmabuf import export_device
    from dmabuf_interop.mechanisms.dmabuf import import_dmabuf

    with export_device(4096, 0) as exp:
        with pytest.raises(InvalidArgumentError, match="exceeds"):
            import_dmabuf(exp.fd, 4096, 0, offset=4)
        with pytest.raises(InvalidArgumentError):
            import_dmabuf(exp.fd, 0, 0)
        with pytest.raises(InvalidArgumentError, match="out of range"):
            import_dmabuf(exp.fd, 4096, 99)


def test_posix_fd_round_trip_same_process_no_leak():
    from dmabuf_interop.kernels import write_pattern
    from dmabuf_interop.mechanisms.posix_fd import export_posix_fd, import_posix_fd

    _warm_up()
    before_fds = open_fds()
    driver.set_current(0)
    free_before, _ = driver.mem_get_info()
    with export_posix_fd(16384, 0) as exp:
        assert exp.mechanism == "posix-fd" and exp.export_size % (2 << 10) == 0
        write_pattern(exp.ptr, exp.size, 0)
        with import_posix_fd(exp.fd, exp.size, 0, 0, exp.export_size) as imp:
            assert imp.ptr != exp.ptr
            assert _pattern_ok(imp.ptr, imp.size, 0) == 0
    driver.set_current(0)
    free_after, _ = driver.mem_get_info()
    assert open_fds() == before_fds
    assert abs(free_after - free_before) <= 4 << 20  # the 2 MiB allocation came back


def test_imported_buffer_reaches_torch_and_cupy_through_dlpack():
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    from dmabuf_interop.kernels import write_pattern
    from dmabuf_interop.mechanisms.posix_fd import export_posix_fd, import_posix_fd

    with export_posix_fd(16384, 0) as exp:
        write_pattern(exp.ptr, exp.size, 0)
        with import_posix_fd(exp.fd, exp.size, 0, 0, exp.export_size) as imp:
            t = torch.from_dlpack(imp.as_array("int32", (4096,)))
            assert t.device.type == "cuda" and t.dtype == torch.int32
            assert np.array_equal(t.cpu().numpy(), PATTERN)
            c = cupy.from_dlpack(imp.as_array("int32", (64, 64)))
            assert c.shape == (64, 64) and int(c[1, 0]) == 0x1000 + 64
            with pytest.raises(InvalidArgumentError):
                imp.as_array("int32", (4097,))
            del t, c


def test_vmm_allocation_also_exports_as_dmabuf():
    from dmabuf_interop.mechanisms.dmabuf import export_range
    from dmabuf_interop.mechanisms.posix_fd import export_posix_fd

    with export_posix_fd(1 << 20, 0) as exp:
        try:
            rng = export_range(exp.ptr, exp.size)
        except NotSupportedError as exc:
            pytest.skip(f"VMM memory cannot be exported as a dma-buf here: {exc}")
        with rng:
            assert is_dmabuf(rng.fd) and rng.offset == 0
            assert rng.handle.info().size == 1 << 20


def test_export_range_of_a_tensor_view_reports_its_offset():
    torch = pytest.importorskip("torch")
    from dmabuf_interop.mechanisms.dmabuf import export_range
    from dmabuf_interop._checks import page_size

    base = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
    view = base[1000:5000]
    try:
        exp = export_range(view)
    except NotSupportedError as exc:
        pytest.skip(f"device memory cannot be exported as a dma-buf here: {exc}")
    with exp:
        page = page_size()
        assert exp.ptr == view.data_ptr()
        assert exp.size == 4000 * 4
        assert exp.offset == view.data_ptr() % page
        assert exp.export_size % page == 0 and exp.export_size >= exp.offset + exp.size
        assert DmaBuf(os.dup(exp.fd)).size == exp.export_size


def test_export_range_names_page_and_misalignment_when_range_leaves_allocation():
    from dmabuf_interop.errors import AlignmentError
    from dmabuf_interop.mechanisms.dmabuf import export_range

    driver.set_current(0)
    # cuMemAlloc of 100 bytes: the allocation is smaller than a page, so the
    # enclosing pages of an interior range leave it (or export works if the
    # driver rounds allocations to pages, which it reports via cuMemGetAddressRange).
    ptr = driver.mem_alloc(100)
    try:
        base, size = driver.mem_address_range(ptr)
        if size % 4096 == 0:
            pytest.skip(f"allocations are page-rounded here ({size} bytes)")
        with pytest.raises(AlignmentError, match="4096-byte"):
            export_range(ptr + 4, 16)
    finally:
        driver.mem_free(ptr)


def test_kernels_are_cached_on_disk(tmp_path):
    code = ("from dmabuf_interop.kernels import write_pattern, count_mismatches;"
            "from dmabuf_interop import _driver as driver; driver.set_current(0); p = driver.mem_alloc(4096);"
            "write_pattern(p, 4096, 0); print(count_mismatches(p, 4096, 0)); driver.mem_free(p)")
    env = env_with_src()
    env["DMABUF_INTEROP_CACHE_DIR"] = str(tmp_path)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "0"
    entries = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert entries, "no cubin was cached"
    mtimes = [p.stat().st_mtime_ns for p in entries]
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0 and second.stdout.strip() == "0"
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == entries
    assert [p.stat().st_mtime_ns for p in entries] == mtimes  # read, not rewritten


def test_fork_after_init_raises_a_clear_error():
    code = ("import os\nfrom dmabuf_interop import _driver as driver\nfrom dmabuf_interop.errors import ForkedAfterInitError\n"
            "driver.set_current(0)\npid = os.fork()\nif pid == 0:\n"
            "    try:\n        driver.set_current(0)\n    except ForkedAfterInitError as e:\n"
            "        print('FORK-ERROR', e, flush=True); os._exit(0)\n    os._exit(3)\n"
            "print('child', os.waitpid(pid, 0)[1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_src(),
                         timeout=120)
    assert "FORK-ERROR" in out.stdout and "spawn" in out.stdout, out.stdout + out.stderr
    assert "child 0" in out.stdout


def test_the_compiled_driver_calls_agree_with_cuda_bindings():
    """Where ``_driver_hot`` is built, ``set_current``, ``stream_idle`` and ``stream_synchronize`` go through it: a
    context made current again, a stream with work pending, then done."""
    if driver._hot is None:
        pytest.skip("dmabuf_interop._driver_hot is not built (Cython and cuda.h are its build requirements)")
    drv = driver.bindings()
    driver.set_current(0)
    primary = int(driver.call(drv.cuCtxGetCurrent))
    driver.call(drv.cuCtxSetCurrent, drv.CUcontext(0))  # no context current
    driver.set_current(0)
    assert int(driver.call(drv.cuCtxGetCurrent)) == primary
    stream = driver.call(drv.cuStreamCreate, 0)
    size = 256 << 20
    ptr = driver.mem_alloc(size)
    try:
        for _ in range(16):  # milliseconds of writes: still queued when asked
            driver.call(drv.cuMemsetD8Async, ptr, 7, size, stream)
        assert driver.stream_idle(int(stream)) is False
        driver.stream_synchronize(int(stream))
        assert driver.stream_idle(int(stream)) is True
    finally:
        driver.stream_synchronize(int(stream))
        driver.mem_free(ptr)
        driver.call(drv.cuStreamDestroy, stream)


def test_probes_report_every_path():
    probes = probe_device(0)
    for key in PROBE_KEYS[:6]:  # the peer probe needs a second GPU
        assert probes[key].status in ("ok", "unsupported", "unknown"), key
    assert probes["posix_fd_export"].status == "ok"
    assert probes["posix_fd_import"].status == "ok"


def test_bad_device_ordinal_is_an_invalid_argument():
    from dmabuf_interop.mechanisms.posix_fd import export_posix_fd

    with pytest.raises(InvalidArgumentError, match="out of range"):
        export_posix_fd(4096, driver.device_count())


def test_cuda_error_names_call_and_result():
    driver.set_current(0)
    with pytest.raises(CudaError) as err:
        driver.mem_free(0xdead0000)
    assert err.value.call == "cuMemFree" and err.value.result.startswith("CUDA_ERROR_")


def test_export_shareable_records_why_it_fell_back():
    from dmabuf_interop.mechanisms import export_shareable, import_shared

    with export_shareable(16384, 0) as exp:
        probes = probe_device(0)
        if probes["dmabuf_import"].status == "ok":
            assert exp.mechanism == "dmabuf" and exp.fallback is None
        else:
            assert exp.mechanism == "posix-fd"
            assert exp.fallback.startswith("dmabuf: ") and probes["dmabuf_import"].result in exp.fallback
        with import_shared(exp.fd, exp.describe(), 0) as imp:
            assert imp.mechanism == exp.mechanism and imp.size == 16384
