#!/usr/bin/env python3
"""Where a weight-sync step's time goes, per stage, in one process (needs a GPU and torch).

    PYTHONPATH=src python3 scripts/ws_stages.py [--workload ws-8b|ws-moe] [--device 0]
        [--consumer-device D] [--steps 10] [--copy-loop]

A device ``SharedPool`` holds one tensor per name of the workload's state dict,
each a few bytes (``(16, 16)`` or ``(64,)`` bf16: the per-tensor cost, not the
bytes); a channel connects this process to itself (``listen`` / ``connect``,
the consumer mapping the chunks on ``--consumer-device``). Each step:
``send_many`` of the whole state dict, ``recv_many``, ``as_tensors`` (under ``torch.no_grad()``), then
``release_all`` and the lease's wait, each timed with ``time.perf_counter``.
After a first step and three warm-ups, the median of ``--steps`` steps is
printed in ms and in µs per tensor.

``--copy-loop`` also times, on ``--device``, the full-size ws-8b tensors
copied by one ``Tensor.copy_`` each (on one stream; then as the bench's
engine copies them, dealt over four streams) against one copy
of the same bytes, and one ``Tensor.as_strided`` view per tensor of a
device tensor.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import threading
import time


def stages(workload: str, device: int, consumer: int, steps: int) -> None:
    import torch

    from dmabuf_interop.channel import SharedPool, as_tensors, connect, listen, release_all
    from dmabuf_interop.cli.bench.stats import percentile
    from dmabuf_interop.cli.bench.weight_sync import model_shapes

    model = model_shapes(workload)
    names = [n for n, _ in model]
    shapes = [(64,) if len(s) == 1 else (16, 16) for _, s in model]
    torch.cuda.set_device(device)
    folder = tempfile.TemporaryDirectory(prefix="ws-stages-")
    address = os.path.join(folder.name, "channel.sock")
    with SharedPool(device, chunk_bytes=64 << 20, max_bytes=2 << 30) as pool, listen(address, pool=pool) as lst:
        params = {n: torch.from_dlpack(pool.empty(s, "int16")).view(torch.bfloat16) for n, s in zip(names, shapes)}
        box: dict[str, object] = {}
        t = threading.Thread(target=lambda: box.setdefault("c", connect(address, timeout=60, device=consumer)))
        t.start()
        prod = lst.accept(timeout=60)
        t.join()
        cons = box["c"]
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(consumer):
            cstream = torch.cuda.Stream(consumer)

        def step() -> tuple[float, ...]:
            t0 = time.perf_counter()
            lease = prod.send_many(params, stream=stream)
            t1 = time.perf_counter()
            batch = cons.recv_many(60, stream=cstream)
            t2 = time.perf_counter()
            with torch.no_grad():  # as an engine loads weights, and as the bench's engine does
                views = as_tensors(batch)
            t3 = time.perf_counter()
            del views
            release_all(batch.values())
            lease.wait(60)
            return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

        first = threading.Thread(target=lambda: box.setdefault("b", cons.recv_many(120)))
        first.start()  # the first batch defines its layout: the engine must be reading while it goes
        lease = prod.send_many(params)
        first.join()
        release_all(box.pop("b").values())  # type: ignore[union-attr]
        lease.wait(60)
        gc.collect()
        gc.freeze()
        for _ in range(3):
            step()
        times = [step() for _ in range(steps)]
        n = len(names)
        print(f"{workload}: {n} tensors, producer GPU {device}, consumer GPU {consumer}, median of {steps} steps")
        for i, what in enumerate(("send_many", "recv_many", "as_tensors", "release_all + lease wait")):
            ms = percentile((x[i] for x in times), 50) * 1e3
            print(f"  {what:26s} {ms:8.2f} ms  {ms * 1e3 / n:6.2f} us per tensor")
        cons.close()
        prod.close()
    folder.cleanup()


def copy_loop(workload: str, device: int) -> None:
    import torch

    from dmabuf_interop.cli.bench.stats import percentile
    from dmabuf_interop.cli.bench.weight_sync import model_shapes
    from dmabuf_interop.cli.bench.weight_sync_backends import _Torch

    shapes = [s for _, s in model_shapes(workload)]
    engine = _Torch(device)  # sets the device
    src = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    dst = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    n = sum(t.numel() for t in src)
    flat_src, flat_dst = (torch.empty(n, dtype=torch.bfloat16, device=device) for _ in range(2))
    stream = torch.cuda.Stream(device)

    def timed(fn) -> float:
        out = []
        for _ in range(6):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            stream.synchronize()
            engine.stream.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
        return percentile(out[1:], 50)

    def each() -> None:
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)

    def one() -> None:
        with torch.cuda.stream(stream):
            flat_dst.copy_(flat_src, non_blocking=True)

    print(f"{workload}: {len(shapes)} tensors, {2 * n / 1e9:.2f} GB bf16 on GPU {device}, median of 5")
    print(f"  one Tensor.copy_ per tensor  {timed(each):8.2f} ms")
    print(f"  the same on four streams     {timed(lambda: engine.copy_all(dst, src)):8.2f} ms")
    print(f"  one copy of the same bytes   {timed(one):8.2f} ms")
    base = torch.empty(1 << 20, dtype=torch.bfloat16, device=device)
    views = [((16, 16), (16, 1), 256 * i) for i in range(4096)]
    t = time.perf_counter()
    for v in views:
        base.as_strided(*v)
    print(f"  Tensor.as_strided of a GPU tensor  {(time.perf_counter() - t) / len(views) * 1e6:.2f} us per view")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="ws-moe", choices=["ws-8b", "ws-moe"])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--copy-loop", action="store_true")
    args = ap.parse_args()
    stages(args.workload, args.device, args.device if args.consumer_device is None else args.consumer_device,
           args.steps)
    if args.copy_loop:
        copy_loop("ws-8b", args.device)


if __name__ == "__main__":
    main()
