"""Producer and consumer processes for the GPU tests of the torch-sharing drop-in.

``python torch_peer.py producer ours|torch``: reads commands on stdin, one per line, and answers one
line each on stdout: ``share N`` (a fresh float32 tensor of N elements, ``2*i + 1``, in an
expandable segment; the reply is the hex of ``ForkingPickler.dumps(reduce_tensor(t))``; the
producer keeps no reference of its own), ``bucket K`` (one flat uint8 buffer, K views of several
dtypes, as verl's bucketed sender: one hex line holding the K tuples, then the expected sums),
``stats`` (JSON: leases out, bytes allocated, open fds), ``quit``.

``python torch_peer.py consumer ours|torch [rewrite]``: for each hex line on stdin rebuilds the
tuple(s) (``func(*args)``, with ``args[6]`` rewritten to the current device when asked) and prints
JSON: ``{"sums": [...]}`` or ``{"error": "Type: message"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402
from torch.multiprocessing.reductions import reduce_tensor  # noqa: E402 - bound before install(), as frameworks do

from dmabuf_interop.integrations import torch_sharing  # noqa: E402


def _out(obj) -> None:
    sys.stdout.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    sys.stdout.flush()


def producer() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    keep = []
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "share":
            t = torch.arange(int(arg[0]), device="cuda", dtype=torch.float32) * 2 + 1
            _out(ForkingPickler.dumps(reduce_tensor(t)).hex())
            del t
        elif cmd == "keep":  # as share, but the producer keeps the tensor
            t = torch.arange(int(arg[0]), device="cuda", dtype=torch.float32) * 2 + 1
            keep.append(t)
            _out(ForkingPickler.dumps(reduce_tensor(t)).hex())
        elif cmd == "bucket":
            k = int(arg[0])
            flat = torch.empty(k * 4096 * 8, dtype=torch.uint8, device="cuda")
            views, sums = [], []
            for i in range(k):
                dt = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
                n = 4096 * 8 // torch.tensor([], dtype=dt).element_size()
                v = flat[i * 4096 * 8:(i + 1) * 4096 * 8].view(dt)[:n].view(64, -1)
                v.copy_(torch.arange(n, device="cuda").reshape(64, -1) % 7 + i)
                views.append(v)
                sums.append(float(v.double().sum()))
            keep.append(flat)
            _out(ForkingPickler.dumps([reduce_tensor(v) for v in views]).hex())
            _out(json.dumps(sums))
        elif cmd == "stats":
            torch.cuda.synchronize()
            b = torch_sharing.broker._broker
            _out({"outstanding": 0 if b is None else b.outstanding, "allocated": torch.cuda.memory_allocated(),
                  "fds": len(os.listdir("/proc/self/fd"))})
        elif cmd == "drop":
            keep.clear()
            _out({"ok": True})
        elif cmd == "quit":
            return


def consumer(rewrite: bool) -> None:
    torch.cuda.init()
    for line in sys.stdin:
        line = line.strip()
        if line == "stats":
            mapped = sum(c.mapped for c in torch_sharing.broker.iter_clients())
            free, _ = torch.cuda.mem_get_info()
            _out({"mapped": mapped, "fds": len(os.listdir("/proc/self/fd")), "free": free})
            continue
        if line == "quit":
            return
        try:
            obj = ForkingPickler.loads(bytes.fromhex(line))
            pairs = obj if isinstance(obj, list) else [obj]
            sums = []
            for func, args in pairs:
                if rewrite:  # verl / checkpoint-engine: the consumer's own index for the same GPU
                    args = list(args)
                    args[6] = torch.cuda.current_device()
                t = func(*args)
                sums.append(float(t.double().sum()))
                del t
            _out({"sums": sums})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            _out({"error": f"{type(exc).__name__}: {exc}"})


def spawn_child(q_in, q_out) -> None:
    torch_sharing.install()
    for _ in range(3):
        t = q_in.get(timeout=60)
        q_out.put(float(t.double().sum()))
        del t


def spawn_main() -> None:
    """torch.multiprocessing with the spawn context: Queue.put of CUDA tensors to a child."""
    ctx = torch.multiprocessing.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=spawn_child, args=(q_in, q_out))
    p.start()
    ts = [torch.arange(n, device="cuda", dtype=torch.float32) for n in (10, 1000, 1 << 20)]
    for t in ts:
        q_in.put(t)
    sums = [q_out.get(timeout=120) for _ in ts]
    p.join(60)
    b = torch_sharing.broker._broker
    for _ in range(100):  # the broker's reader sees the child's end of the connection
        if b is None or b.outstanding == 0:
            break
        time.sleep(0.05)
    _out({"sums": sums, "expect": [float(t.double().sum()) for t in ts], "exitcode": p.exitcode,
          "broker": b is not None, "outstanding": None if b is None else b.outstanding})


if __name__ == "__main__":
    role, mode = sys.argv[1], sys.argv[2]
    if role == "spawn":
        torch_sharing.install()
        spawn_main()
        sys.exit(0)
    if mode == "ours":
        torch_sharing.install()
    if role == "producer":
        producer()
    else:
        consumer(len(sys.argv) > 3 and sys.argv[3] == "rewrite")
