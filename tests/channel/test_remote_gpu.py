"""tcp:// channels through NIXL between two processes with device pools: GPU 0 -> GPU 1 (run on 2 GPUs)."""

from __future__ import annotations

import pytest

from dmabuf_interop.channel.remote import ucx_read_transports
from tests.helpers.remote import peer_env, result, start, start_producer

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.nixl]


@pytest.mark.parametrize("tls", ["cuda_copy,tcp", "cuda_copy,cuda_ipc,tcp"])
def test_device_pool_gpu0_to_gpu1(tls: str, record_property) -> None:
    env = peer_env(tls=tls, UCX_PROTO_INFO="y")
    producer, addr = start_producer("producer", "300", "0", env=env)
    consumer = start("consumer", addr, "300", "1", env=env)
    out, err = consumer.communicate(timeout=300)
    assert consumer.returncode == 0, err[-4000:]
    import json

    got = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    sent = result(producer)
    transports = ucx_read_transports(out)
    record_property("ucx_read_transports", transports)
    print(f"UCX_TLS={tls}: READ went through {transports}")
    assert got["good"] == got["n"] == 300  # 0 mismatches
    assert got["transport"]["backend"] == "UCX"
    assert transports, "UCX_PROTO_INFO printed no ucp_get table"
    if "cuda_ipc" not in tls:
        assert not any(t.startswith("cuda_ipc") for t in transports)
    assert got["registered"] == sent["registered"] == 0
    # CUDA and UCX open fds of their own once device memory is registered and read (device nodes,
    # event fds), which live as long as the process: the check is that READs add none.
    assert got["fds_grew"] == 0, got
    record_property("fds_open_after_close", {"consumer": got["fds_leaked"], "producer": sent["fds_leaked"]})


_BATCH = """
import json, threading, torch
from dmabuf_interop.channel import SharedPool, as_tensors, connect, listen, release_all
TOKEN = "test-shared-secret-0123456789"
with SharedPool(0, chunk_bytes=8 << 20, max_bytes=32 << 20) as mine, \\
        SharedPool(0, chunk_bytes=8 << 20, max_bytes=32 << 20) as theirs:
    lst = listen("tcp://127.0.0.1:0", pool=mine, token=TOKEN)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", connect(lst.address, timeout=60, pool=theirs,
                                                                      token=TOKEN)))
    t.start()
    prod = lst.accept(60)
    t.join()
    cons = box["c"]
    state = {"a": torch.arange(1000, dtype=torch.float32, device=0),
             "b": torch.full((3, 7), 5, dtype=torch.int16, device=0)}
    lease = prod.send_many(state)
    batch = cons.recv_many(60)
    got = as_tensors(batch)
    out = {k: bool(torch.equal(got[k].cpu(), v.cpu())) for k, v in state.items()}
    del got
    release_all(batch.values())
    lease.wait(30)
    cons.close(); prod.close(); lst.close()
print(json.dumps(out))
"""


def test_a_batch_read_into_device_blocks_becomes_torch_tensors() -> None:
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _BATCH], capture_output=True, text=True, timeout=240,
                         env=peer_env(tls="cuda_copy,tcp"))
    assert res.returncode == 0, res.stderr[-4000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"a": True, "b": True}
