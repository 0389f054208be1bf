"""The weight-sync peers: what trainers and engines use today, measured beside the channel.

``torch-reductions``: one ``torch.multiprocessing.reductions.reduce_tensor`` handle per tensor, pickled over a
socket (``multiprocessing.connection``), rebuilt and copied in the engine, acknowledged.
``ipc-buckets``: tensors flattened into 512 MiB buckets; the engine opens each bucket's CUDA IPC handle, copies
out, synchronises, closes the handle (drops the last reference) and acknowledges, every step.
Pickling here is the peers' own path between two benchmark processes; nothing on the library's path imports this.
"""

from __future__ import annotations

import math
import time
from typing import Any

from .weight_sync_backends import _steps, _Torch, settle_gc

#: Bucket size of the ``ipc-buckets`` peer, bytes.
BUCKET_BYTES = 512 << 20


def run_peer(role: str, cfg: dict[str, Any], fd: int) -> dict[str, Any]:
    """Run one side of a peer over the connected socket ``fd`` (owned from now on)."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    try:
        return (_peer_trainer if role == "peer-trainer" else _peer_engine)(cfg, conn)
    finally:
        conn.close()


def _peer_trainer(cfg: dict[str, Any], conn: Any) -> dict[str, Any]:
    """The peers' trainer (torch only): per-tensor torch IPC handles, or 512 MiB CUDA IPC buckets."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    be = _Torch(cfg["devices"][0])
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]
    params = [be.from_pool(None, s) for _, s in shapes]
    be.fill(params)
    bucket = None
    if cfg["peer"] == "ipc-buckets":
        size = max(BUCKET_BYTES, max(2 * math.prod(s) for _, s in shapes))
        bucket = torch.empty(size, dtype=torch.uint8, device=be.device)
    cpu0 = 0.0
    settle_gc()
    for _, k, _timed in _steps(cfg):
        if k == cfg["warmup"]:
            cpu0 = time.process_time()
        be.bump(params)
        be.torch.cuda.synchronize(be.device)
        sums = be._sums(params).tolist()
        t0 = time.monotonic_ns()
        if bucket is None:  # one handle per tensor, pickled (the peer's own path)
            conn.send((k, t0, sums, [(n, reduce_tensor(p)) for (n, _), p in zip(shapes, params)]))
            conn.recv()
            continue
        group: list[tuple[str, int, tuple[int, ...]]] = []
        off = 0
        for i, ((n, s), p) in enumerate(zip(shapes, params)):
            nb = 2 * math.prod(s)
            if off + nb > bucket.numel():
                conn.send((k, t0, None, group, reduce_tensor(bucket)))
                conn.recv()  # ack: the engine copied the bucket out and closed its handle
                group, off = [], 0
            bucket[off:off + nb].copy_(p.view(-1).view(torch.uint8))
            group.append((n, off, s))
            off += (nb + 255) // 256 * 256
        torch.cuda.synchronize(be.device)
        conn.send((k, t0, sums, group, reduce_tensor(bucket)))
        conn.recv()
    return {"cpu_ms_per_step": round((time.process_time() - cpu0) * 1e3 / cfg["reps"], 3)}


def _peer_engine(cfg: dict[str, Any], conn: Any) -> dict[str, Any]:
    import torch

    be = _Torch(cfg["devices"][1])
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]
    own = be.empty_like_shapes(shapes)
    held = [own[n] for n, _ in shapes]
    out: dict[str, Any] = {"sync_ms": [], "bad_checksums": 0}
    cpu0 = 0.0
    settle_gc()
    for _, k, timed in _steps(cfg):
        if k == cfg["warmup"]:
            cpu0 = time.process_time()
        while True:
            msg = conn.recv()
            if cfg["peer"] == "torch-reductions":
                _, t0, sums, handles = msg
                # rebuild opens each handle (cached by torch), then copy
                be.copy_all([own[n] for n, _ in handles], [fn(*args) for _, (fn, args) in handles])
                be.stream.synchronize()
                del handles
            else:
                _, t0, sums, group, (fn, args) = msg
                src = fn(*args)  # cudaIpcOpenMemHandle
                be.copy_all([own[n] for n, _, _ in group],
                            [src[off:off + 2 * math.prod(s)].view(torch.bfloat16).view(s) for _, off, s in group])
                be.stream.synchronize()
                del src, fn, args, msg  # the last reference: cudaIpcCloseMemHandle
            if sums is not None:
                break
            conn.send(True)
        t1 = time.monotonic_ns()
        if timed:
            out["sync_ms"].append((t1 - t0) / 1e6)
        if not be.equal_sums(held, torch.tensor(sums, device=be.device)):
            out["bad_checksums"] += 1
        conn.send(True)
    out["cpu_ms_per_step"] = round((time.process_time() - cpu0) * 1e3 / cfg["reps"], 3)
    return out

