"""export_range by memory kind, and a consumer that cannot see the exporter's GPU (GPU, marked gpu).
Each scenario runs in a fresh subprocess so the pytest process never initialises CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import env_with_src

pytestmark = pytest.mark.gpu


def _run(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=240, env={**env_with_src(), **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_KINDS = """
    import json
    from cuda.bindings import driver as d
    from dmabuf_interop import _driver, errors, export_range
    _driver.set_current(0)
    out = {}
    def attempt(name, ptr, size):
        try:
            export_range(ptr, size).close()
            out[name] = "exported"
        except errors.DmaBufError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    err, managed = d.cuMemAllocManaged(1 << 20, d.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
    attempt("managed", int(managed), 4096)
    import ctypes
    host = ctypes.create_string_buffer((1 << 20) + 4096)
    base = (ctypes.addressof(host) + 4095) // 4096 * 4096
    d.cuMemHostRegister(base, 1 << 20, 0)
    attempt("registered", base, 4096)
    err, dev = d.cuMemAlloc(1 << 20)
    attempt("device", int(dev), 4096)
    err, stream = d.cuStreamCreate(0)
    err, pool_ptr = d.cuMemAllocAsync(1 << 20, stream)
    d.cuStreamSynchronize(stream)
    attempt("pool", int(pool_ptr), 4096)
    print(json.dumps(out))
"""


def test_export_range_names_the_memory_kind_it_cannot_export():
    out = _run(_KINDS)
    assert out["managed"].startswith(("NotSupportedError", "CudaNotSupportedError")) and "cuMemAllocManaged" in out["managed"]
    assert "copy it into device memory" in out["managed"]
    assert out["registered"].startswith(("NotSupportedError", "CudaNotSupportedError")) and "cuMemHostRegister" in out["registered"]
    assert "HOST_ALLOC_DMA_BUF_SUPPORTED=" not in out["registered"]
    assert out["device"] == "exported"
    assert out["pool"] == "exported" or "stream-ordered pool memory" in out["pool"], out["pool"]


_VMM_OTHER_DEVICE = """
    import json
    from dmabuf_interop import _driver, export_posix_fd, export_range
    buf = export_posix_fd(1 << 21, 1)
    _driver.set_current(0)
    r = export_range(buf.ptr, 4096)
    print(json.dumps({"device": r.device, "uuid": r.device_uuid == _driver.device_uuid(1)}))
    r.close(); buf.close()
"""


@pytest.mark.gpu(count=2)
def test_export_range_of_vmm_memory_takes_the_device_of_its_allocation():
    assert _run(_VMM_OTHER_DEVICE) == {"device": 1, "uuid": True}


_PRODUCER = """
    import json, os, socket, sys
    from dmabuf_interop import export_posix_fd, send_message
    sock = socket.socket(fileno=int(sys.argv[1]))
    buf = export_posix_fd(1 << 21, 0)
    send_message(sock, buf.describe().to_json(), buf.fd, timeout=60)
    sock.recv(1)
    print(json.dumps({"uuid": buf.device_uuid}))
"""

_CONSUMER = """
    import json, socket, sys
    from dmabuf_interop import errors, import_shared, recv_message
    sock = socket.socket(fileno=int(sys.argv[1]))
    meta, fds = recv_message(sock, 60)
    try:
        import_shared(fds[0], meta, 0).close()
        out = {"error": None}
    except errors.NotSupportedError as exc:
        out = {"error": str(exc)}
    sock.send(b"k")
    print(json.dumps(out))
"""


@pytest.mark.gpu(count=2)
def test_consumer_that_cannot_see_the_exporters_gpu_is_told_its_uuid():
    import socket

    a, b = socket.socketpair()
    with a, b:
        env = env_with_src()
        prod = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_PRODUCER), str(a.fileno())],
                                pass_fds=[a.fileno()], stdout=subprocess.PIPE, text=True,
                                env={**env, "CUDA_VISIBLE_DEVICES": "1"})
        cons = subprocess.run([sys.executable, "-c", textwrap.dedent(_CONSUMER), str(b.fileno())],
                              pass_fds=[b.fileno()], capture_output=True, text=True, timeout=120,
                              env={**env, "CUDA_VISIBLE_DEVICES": "0"})
        uuid = json.loads(prod.communicate(timeout=120)[0].strip().splitlines()[-1])["uuid"]
    err = json.loads(cons.stdout.strip().splitlines()[-1])["error"]
    assert err and uuid in err and "not visible to this process" in err and "CUDA_VISIBLE_DEVICES='0'" in err
