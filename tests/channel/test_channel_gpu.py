"""Channels over device pools (CUDA VMM chunks exported as POSIX fds). Marked ``gpu``.

Each test runs its producer and consumer as spawned processes (CUDA does not
survive fork), so the pytest process never initialises CUDA.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SLEEP_KERNEL = r"""
extern "C" __global__ void late_fill(float* p, unsigned long long n, float v, unsigned long long spins) {
    unsigned long long t0 = clock64();
    while ((unsigned long long)(clock64() - t0) < spins) { }
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) p[i] = v;
}
"""


def _producer(addr: str, device: int, mode: str, ordering: str, q) -> None:
    try:
        import numpy as np
        import torch

        from dmabuf_interop.channel import SharedPool, listen

        torch.cuda.set_device(device)
        with SharedPool(device, chunk_bytes=2 << 20, max_bytes=64 << 20) as pool, \
                listen(addr, pool=pool, ordering=ordering) as listener:
            q.put("listening")
            with listener.accept(60) as ch:
                stream = torch.cuda.current_stream(device)
                if mode == "roundtrip":
                    t = torch.arange(1 << 16, dtype=torch.float32, device=f"cuda:{device}")
                    zc = torch.from_dlpack(pool.empty((256, 256), "float32"))
                    zc.copy_(t.view(256, 256) * 2)
                    bf = torch.ones(1000, dtype=torch.bfloat16, device=f"cuda:{device}") * 3
                    fives = torch.from_dlpack(pool.empty(1024, "float32"))
                    fives.fill_(5.0)
                    leases = [ch.send(t, stream=stream), ch.send(zc, stream=stream), ch.send(bf, stream=stream),
                              ch.send_many({"w": t[:100], "b": zc[0]}, stream=stream),
                              ch.send(fives, stream=stream)]  # released by the consumer's safety net
                    try:  # a CuPy array: read through the CUDA array interface, copied into the pool
                        import cupy

                        with cupy.cuda.Device(device):
                            cp = cupy.arange(1000, dtype=cupy.float32) * 3
                            cupy.cuda.runtime.deviceSynchronize()
                        leases.append(ch.send(cp))
                    except ImportError:
                        pass
                    for lease in leases:
                        lease.wait(60)
                    with ch.recv(60) as back:  # the consumer sent the (256, 256) array back, from its mapping
                        assert torch.equal(back.as_tensor().cpu(), zc.cpu())
                else:  # ordering: a kernel writes 7.0 after ~0.5 s; the consumer must see it
                    from cuda.core import LaunchConfig, Program, ProgramOptions, launch
                    from dmabuf_interop import _driver as driver

                    dev = driver.set_current(device)
                    code = Program(SLEEP_KERNEL, code_type="c++",
                                   options=ProgramOptions(arch=f"sm_{dev.arch}")).compile("cubin")
                    kernel = code.get_kernel("late_fill")
                    view = pool.empty(1 << 20, "float32")
                    s = dev.create_stream()
                    launch(s, LaunchConfig(grid=64, block=256), kernel, np.uint64(view.ptr), np.uint64(1 << 20),
                           np.float32(7.0), np.uint64(10**9))
                    ch.send(view, stream=s).wait(60)
        q.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put(f"producer: {type(exc).__name__}: {exc}")


def _consumer(addr: str, device: int, mode: str, q) -> None:
    try:
        import numpy as np
        import torch

        from dmabuf_interop.channel import SharedPool, connect

        torch.cuda.set_device(device)
        with SharedPool(device, chunk_bytes=2 << 20, max_bytes=8 << 20) as back_pool, \
                connect(addr, timeout=60, device=device, pool=back_pool) as ch:
            if mode == "roundtrip":
                with ch.recv(60) as r:
                    assert r.device == device and r.ordering in ("event", "sync")
                    assert torch.equal(r.as_tensor().cpu(), torch.arange(1 << 16, dtype=torch.float32))
                with ch.recv(60) as r:
                    want = torch.arange(1 << 16, dtype=torch.float32).view(256, 256) * 2
                    assert torch.equal(r.as_tensor().cpu(), want)
                    v = r.as_array()  # a DeviceView: the address at once, cuda.core's view on first DLPack use
                    assert (v.shape, v.strides, v.dtype, v.device_id) == ((256, 256), (256, 1), np.float32, device)
                    t = torch.from_dlpack(v)
                    assert t.device.index == device and t.data_ptr() == v.ptr and torch.equal(t.cpu(), want)
                    assert v.memory_view() is v.memory_view() and int(v.memory_view().ptr) == v.ptr
                    assert v.memory_view().__dlpack_device__() == v.__dlpack_device__() == (2, device)
                    try:
                        import cupy

                        assert float(cupy.from_dlpack(v).sum()) == float(want.sum())
                    except ImportError:
                        pass
                    back = ch.send(v)  # sent on, from the mapping
                with ch.recv(60) as r:
                    t = r.as_tensor()
                    assert r.dtype == "bfloat16" and t.dtype == torch.bfloat16 and float(t.float().sum()) == 3000.0
                many = ch.recv_many(60)
                assert torch.equal(many["w"].as_tensor().cpu(), torch.arange(100, dtype=torch.float32))
                assert torch.equal(many["b"].as_tensor().cpu(), torch.arange(256, dtype=torch.float32) * 2)
                for r in many.values():
                    r.release()
                ordering = r.ordering
                # A view, and a tensor made from it, each keep the Received (so its lease) alive.
                import gc
                import weakref

                r = ch.recv(60)
                view = r.as_array()
                alive = weakref.ref(r)
                del r
                gc.collect()
                assert alive() is not None
                t = torch.from_dlpack(view)
                del view
                gc.collect()
                assert alive() is not None and float(t.sum()) == 5.0 * 1024
                del t
                gc.collect()
                assert alive() is None  # the producer's lease.wait sees the safety net's release
                try:
                    import cupy  # noqa: F401

                    with ch.recv(60) as r:
                        assert float(r.as_tensor().sum()) == 3.0 * sum(range(1000))
                except ImportError:
                    pass
                back.wait(60)  # the producer has read it back
                q.put(f"ok {ordering}")
            else:
                with ch.recv(60) as r:  # no synchronisation by hand: the stream waited on the producer's event
                    total = float(r.as_tensor().sum())
                    q.put(f"ok {r.ordering} {total}")
    except BaseException as exc:  # noqa: BLE001
        q.put(f"consumer: {type(exc).__name__}: {exc}")


def _run(tmp_path: Path, pdev: int, cdev: int, mode: str, ordering: str = "event") -> str:
    ctx = mp.get_context("spawn")
    addr = str(tmp_path / "gpu.sock")
    pq, cq = ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=_producer, args=(addr, pdev, mode, ordering, pq))
    prod.start()
    assert pq.get(timeout=120) == "listening"
    cons = ctx.Process(target=_consumer, args=(addr, cdev, mode, cq))
    cons.start()
    try:
        got = cq.get(timeout=180)
        assert pq.get(timeout=60) == "ok"
        return got
    finally:
        for p in (prod, cons):
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("ordering", ["event", "sync"])
def test_device_pool_torch_round_trip(tmp_path: Path, ordering: str) -> None:
    # "event" records one only while the stream has work pending; an idle stream goes as "sync"
    assert _run(tmp_path, 0, 0, "roundtrip", ordering) in {f"ok {ordering}", "ok sync"}


def test_event_orders_a_late_kernel_write(tmp_path: Path) -> None:
    assert _run(tmp_path, 0, 0, "ordering") == f"ok event {7.0 * (1 << 20)}"


@pytest.mark.gpu(count=2)
def test_consumer_on_the_other_gpu(tmp_path: Path) -> None:
    assert _run(tmp_path, 0, 1, "roundtrip") in {"ok event", "ok sync"}


@pytest.mark.gpu(count=2)
def test_event_orders_a_late_kernel_write_for_a_consumer_on_the_other_gpu(tmp_path: Path) -> None:
    assert _run(tmp_path, 0, 1, "ordering") == f"ok event {7.0 * (1 << 20)}"


# A producer and a consumer channel in one process, over a pool of four CHUNK-byte chunks on GPU 0.
_PAIR = """
import gc, json, os, sys, tempfile, threading
import torch
from dmabuf_interop.channel import SharedPool, as_tensors, connect, listen

addr = os.path.join(tempfile.mkdtemp(), "s")
with SharedPool(0, chunk_bytes=CHUNK, max_bytes=4 * CHUNK) as pool, listen(addr, pool=pool, ordering="sync") as lst:
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", connect(addr, timeout=60, device=0)))
    t.start()
    prod = lst.accept(60)
    t.join()
    cons = box["c"]
"""

_BATCH_LIFETIME = "CHUNK = 2 << 20" + _PAIR + """\
    a = torch.from_dlpack(pool.empty((64, 32), "float32"))
    b = torch.from_dlpack(pool.empty((100,), "int16"))
    a.copy_(torch.arange(64 * 32, dtype=torch.float32).view(64, 32))
    b.fill_(7)
    torch.cuda.synchronize()
    lease = prod.send_many({"a": a.t(), "b": b[10:]})
    many = cons.recv_many(60)
    if sys.argv[1] == "each":
        ta, tb = many["a"].as_tensor(), many["b"].as_tensor()
    else:
        ta, tb = as_tensors(many).values()
    out = {"a_equal": bool(torch.equal(ta.cpu(), a.t().cpu())), "a_strides": list(ta.stride()),
           "b_shape": list(tb.shape), "b_sum": int(tb.sum())}
    del many
    gc.collect()
    out["held_while_tensors_live"] = not lease.done
    del ta, tb
    gc.collect()
    lease.wait(10)
    out["released_after"] = lease.reason
    cons.close(); prod.close()
print(json.dumps(out))
"""


_EXPERT_RUNS = "CHUNK = 4 << 20" + _PAIR + """\
    state = {"router": torch.from_dlpack(pool.empty((16, 8), "float32"))}
    for e in range(16):  # experts laid out in turn, as a MoE state dict is: runs of every third tensor
        for kind, shape in (("gate", (12, 8)), ("up", (12, 8)), ("down", (8, 12))):
            state[f"e{e}.{kind}"] = torch.from_dlpack(pool.empty(shape, "bfloat16"))
    state["odd"] = torch.from_dlpack(pool.empty((5, 3), "float32"))[:, 1:]  # strided
    out = {"steps": []}
    for step in range(2):  # the second batch is a repeat of the first's layout
        for i, v in enumerate(state.values()):
            v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) + 1000 * i + step)
        torch.cuda.synchronize()
        lease = prod.send_many(state)
        many = cons.recv_many(60)
        with torch.no_grad():  # as engines load weights: runs are cut outside grad mode only
            got = as_tensors(many)
        runs, singles = next(iter(many.values()))._batch.layout.cached[1] or ([], None)
        out["steps"].append({
            "equal": all(torch.equal(got[k].cpu(), v.cpu()) for k, v in state.items()),
            "meta": all((got[k].shape, got[k].stride(), got[k].dtype) == (v.shape, v.stride(), v.dtype)
                        for k, v in state.items()),
            "in_runs": sum(len(r[5]) for r in runs), "singles": None if singles is None else len(singles)})
        del many
        gc.collect()
        held = not lease.done
        del got
        gc.collect()
        lease.wait(10)
        out["steps"][-1]["held_then_released"] = held and lease.reason == "released"
    cons.close(); prod.close()
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_batch_tensors_cut_from_runs_of_like_items_equal_the_sent_tensors() -> None:
    import json
    import subprocess
    import sys

    from tests.helpers import env_with_src

    res = subprocess.run([sys.executable, "-c", _EXPERT_RUNS], capture_output=True, text=True, timeout=240,
                         env=env_with_src())
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # the first batch of the layout: one as_strided each; the second: 48 expert tensors in 3 runs of 16,
    # the router and the strided one alone
    step = {"equal": True, "meta": True, "held_then_released": True}
    assert out == {"steps": [{**step, "in_runs": 0, "singles": None}, {**step, "in_runs": 48, "singles": 2}]}


@pytest.mark.parametrize("how", ["each", "as_tensors"])
def test_batch_tensors_are_views_that_hold_their_items(how: str) -> None:
    import json
    import subprocess
    import sys

    from tests.helpers import env_with_src

    res = subprocess.run([sys.executable, "-c", _BATCH_LIFETIME, how], capture_output=True, text=True, timeout=240,
                         env=env_with_src())
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"a_equal": True, "a_strides": [1, 32], "b_shape": [90], "b_sum": 630,
                   "held_while_tensors_live": True, "released_after": "released"}
