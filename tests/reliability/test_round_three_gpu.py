"""A channel server that stays up (GPU, marked gpu): the dtypes users send as CUDA tensors, and a channel
without a pool sending a CUDA tensor.

Each scenario runs in a fresh subprocess, which forks its consumer before it initialises CUDA, so the
pytest process never touches CUDA. Each test states the behaviour expected of the library.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import env_with_src

pytestmark = pytest.mark.gpu

_SCENARIO = """
import json, os, sys, tempfile, time
addr = os.path.join(tempfile.mkdtemp(), "s.sock")
names = sys.argv[1].split(",")
with_pool = sys.argv[2] == "pool"
VALUES = [0.5, 1, 2, 4, 0.25, 8, 1, 2]
r_fd, w_fd = os.pipe()
pid = os.fork()
if pid == 0:  # the consumer: CUDA is initialised after the fork
    out = {}
    try:
        import torch
        from dmabuf_interop.channel import connect
        from dmabuf_interop.errors import PeerClosedError
        ch = connect(addr, timeout=60, wait=True, device=0)
        try:
            while True:
                with ch.recv(timeout=60) as r:
                    name = r.meta["name"]
                    t = r.as_tensor()
                    want = torch.tensor(VALUES, dtype=torch.float32).to(getattr(torch, name))
                    out[name] = {"wire": r.dtype, "dtype": str(t.dtype).replace("torch.", ""),
                                 "device": str(t.device),
                                 "same_bytes": t.cpu().view(torch.uint8).tolist() == want.view(torch.uint8).tolist()}
        except PeerClosedError:
            pass
        ch.close()
    except BaseException as exc:
        out["consumer_error"] = f"{type(exc).__name__}: {exc}"
    os.write(w_fd, json.dumps(out).encode())
    os._exit(0)
os.close(w_fd)
import torch
from dmabuf_interop.channel import SharedPool, listen
pool = SharedPool(0, chunk_bytes=2 << 20, max_bytes=64 << 20) if with_pool else None
lst = listen(addr, pool=pool)
ch = lst.accept(timeout=60)
sent = {}
for name in names:
    t = torch.tensor(VALUES, dtype=torch.float32).to(getattr(torch, name)).cuda()
    try:
        ch.send(t, meta={"name": name}).wait(30)
        sent[name] = "sent"
    except Exception as exc:
        sent[name] = f"{type(exc).__name__}: {exc}"
ch.close()
got = b""
while True:
    chunk = os.read(r_fd, 65536)
    if not chunk:
        break
    got += chunk
os.waitpid(pid, 0)
lst.close()
if pool is not None:
    pool.close()
print(json.dumps({"sent": sent, "received": json.loads(got or b"{}")}))
"""


def _run(names: list[str], pool: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCENARIO), ",".join(names),
                          "pool" if pool else "none"], capture_output=True, text=True, timeout=180,
                         env=env_with_src())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_TORCH_DTYPES = ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "complex32"]


def test_cuda_tensors_of_every_torch_dtype_travel_with_their_dtype():
    out = _run(_TORCH_DTYPES, pool=True)
    assert out["sent"] == {name: "sent" for name in _TORCH_DTYPES}, out
    for name in _TORCH_DTYPES:
        got = out["received"].get(name)
        assert got == {"wire": name, "dtype": name, "device": "cuda:0", "same_bytes": True}, out


def test_a_channel_without_a_pool_makes_one_on_the_tensors_gpu():
    out = _run(["float32", "bfloat16"], pool=False)
    assert out["sent"] == {"float32": "sent", "bfloat16": "sent"}, out
    for name in ("float32", "bfloat16"):
        assert out["received"].get(name) == {"wire": name, "dtype": name, "device": "cuda:0", "same_bytes": True}, out
