"""``dmabuf-interop bench --workload ws-8b|ws-moe``: push a whole model from a trainer to an engine, every step.

A trainer and an engine (fresh interpreters started by :mod:`.child`;
CUDA does not survive ``fork()``) are connected by a channel
(:mod:`dmabuf_interop.channel`). The trainer's parameters live in a
:class:`~dmabuf_interop.channel.SharedPool`. Each step the trainer adds 1 to
every parameter (viewed as int16: the new version), computes a checksum per
tensor (the int64 sum of a strided sample of at most :data:`SAMPLE` elements)
into a pool array that travels with the state dict, and sends the state dict as
a few ``send_many`` batches in order (:func:`_buckets`), which the engine uses
as they arrive. Variants:

=========  =================================================================
hand-off   the engine reads the trainer's tensors in place under the lease and
           holds version k until it gives its weights back for step k+1
copy       the engine copies every tensor into its own parameters on its stream,
           then releases
=========  =================================================================

Timed per step: trainer's ``send_many`` starts (its step's GPU work done: it
synchronises its stream first, as the peers do) -> the engine holds every tensor
of the new version (hand-off: torch tensors, ``as_tensors``, / NumPy arrays over
the blocks; copy: copies complete), from ``CLOCK_MONOTONIC`` stamps in both
processes. The checksum check runs after the timed span, every step.

Peers, measured in the same run (GPU only; torch): ``torch-reductions``
(``torch.multiprocessing.reductions.reduce_tensor`` per tensor, pickled handles
over a socket, rebuilt in the engine, ack) and ``ipc-buckets`` (512 MiB
flattened buckets, a CUDA IPC handle opened and closed per bucket every step,
ack then synchronise). The limit: one device-to-device copy of the whole
payload, and the peer copy to the other GPU (``cudaMemcpyPeer`` through torch).

``--host`` runs the same workload over host pools (memfd, NumPy, uint16 for
bf16), the CPU version; ``--small`` uses a few-MB model of the same layout.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import socket
import sys
import tempfile
import time
from typing import Any

from .child import Child, finish, report, serve, start
from .report import pyplot, save_figure, write_json
from .stats import Stats
from .targets import row_p50, workload_targets
from .weight_sync_backends import SAMPLE, _Numpy, _steps, _Torch, settle_gc

__all__ = ["WORKLOADS", "model_shapes", "payload_bytes", "add_arguments", "main"]

#: Name of the checksum array (it travels in the step's last batch).
SUMS = "__checksums__"
#: hand-off: a step's state dict goes as batches of at most this many tensors, so that the engine
#: builds the tensors of one while the trainer sends the next ...
HANDOFF_BUCKET_ITEMS = 4096
#: ... after a first batch of at most this many, so that the engine starts early.
HANDOFF_FIRST_ITEMS = 512
#: copy: a step's state dict goes as a small first batch, then this many batches of about equal bytes,
#: so that the engine's copies of one run while the next is handed over (within the layouts a channel
#: remembers).
COPY_BUCKETS = 8
#: copy: the first batch closes at this share of the payload (at least one tensor): the GPU starts
#: copying after a short hand-off, and copying it still outlasts the hand-off of the next batch.
COPY_FIRST_SHARE = 1 / 16

# Public config numbers (Qwen3-8B, Qwen3-30B-A3B); "small" keeps the layout at a few MB.
WORKLOADS: dict[str, dict[str, int]] = {
    "ws-8b": dict(hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                  experts=0, expert_intermediate=0),
    "ws-moe": dict(hidden=2048, intermediate=0, layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                   experts=128, expert_intermediate=768),
}
SMALL: dict[str, dict[str, int]] = {
    "ws-8b": dict(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1024,
                  experts=0, expert_intermediate=0),
    "ws-moe": dict(hidden=128, intermediate=0, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=512,
                   experts=8, expert_intermediate=64),
}


def model_shapes(workload: str, small: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in state-dict order; bf16 (2 bytes per element).

    ws-8b: 399 tensors, 16.38e9 bytes; ws-moe: 18,867 tensors, 61.1e9 bytes (untied embedding and
    lm_head, q/k norm weights, a router per MoE layer).
    """
    c = (SMALL if small else WORKLOADS)[workload]
    h, d = c["hidden"], c["head_dim"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab"], h))]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (c["heads"] * d, h)),
                (p + "self_attn.k_proj.weight", (c["kv_heads"] * d, h)),
                (p + "self_attn.v_proj.weight", (c["kv_heads"] * d, h)),
                (p + "self_attn.o_proj.weight", (h, c["heads"] * d)),
                (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,))]
        if c["experts"]:
            ei = c["expert_intermediate"]
            out.append((p + "mlp.gate.weight", (c["experts"], h)))
            for e in range(c["experts"]):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (ei, h)), (q + "up_proj.weight", (ei, h)),
                        (q + "down_proj.weight", (h, ei))]
        else:
            out += [(p + "mlp.gate_proj.weight", (c["intermediate"], h)),
                    (p + "mlp.up_proj.weight", (c["intermediate"], h)),
                    (p + "mlp.down_proj.weight", (h, c["intermediate"]))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]
    return out


def _buckets(state: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]], variant: str) -> list[dict[str, Any]]:
    """A step's batches, in order, the checksums in the last: (hand-off) :data:`HANDOFF_FIRST_ITEMS`
    tensors, then :data:`HANDOFF_BUCKET_ITEMS` each; (copy) a first batch of :data:`COPY_FIRST_SHARE` of
    the bytes, then :data:`COPY_BUCKETS` of about equal bytes."""
    out: list[dict[str, Any]] = [{}]
    total = payload_bytes(shapes)
    first = total * COPY_FIRST_SHARE
    each = (total - first) / COPY_BUCKETS
    filled = 0
    for name, shape in shapes:
        if variant == "copy":
            full = filled >= first + each * (len(out) - 1) and len(out) <= COPY_BUCKETS
        else:
            full = len(out[-1]) >= (HANDOFF_FIRST_ITEMS if len(out) == 1 else HANDOFF_BUCKET_ITEMS)
        if full:
            out.append({})
        out[-1][name] = state[name]
        filled += 2 * math.prod(shape)
    out[-1][SUMS] = state[SUMS]
    return out


def payload_bytes(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the bf16 payload."""
    return sum(2 * math.prod(s) for _, s in shapes)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- child processes ---------------------------------------------------------------------

def _trainer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from ...channel import SharedPool, listen
    from ...channel.segments import segments_for

    host = cfg["host"]
    be: Any = _Numpy() if host else _Torch(cfg["devices"][0])
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]
    total = payload_bytes(shapes) + 8 * len(shapes) + 256 * (len(shapes) + 1)
    in_pool = not cfg.get("expandable")  # else torch's own tensors: the channel lends their pages in place
    max_bytes = total + (1 << 30 if not in_pool else 0)
    pool = SharedPool(None if host else cfg["devices"][0], chunk_bytes=min(cfg["chunk_bytes"], max_bytes),
                      max_bytes=max_bytes + cfg["chunk_bytes"])
    params = [be.from_pool(pool if in_pool else None, s) for _, s in shapes]
    sums = pool.empty((len(shapes),), "int64")
    sums = sums if host else be.torch.from_dlpack(sums)
    be.fill(params)
    state = {n: p for (n, _), p in zip(shapes, params)}
    state[SUMS] = sums
    buckets = {v: _buckets(state, shapes, v) for v in cfg["variants"]}
    send_ms: list[float] = []
    mem: dict[str, Any] = {}
    with pool, listen(cfg["address"], pool=pool) as listener:
        report(ctl, {"ready": True})
        ch = listener.accept(timeout=cfg["timeout"])
        leases: list[Any] = []
        cpu0 = 0.0
        settle_gc()
        try:
            for variant, k, timed in _steps(cfg):
                if k == cfg["warmup"]:
                    mem.setdefault(variant, {"free_before": be.memory(), "fds_before": _fd_count()})
                    cpu0 = time.process_time()
                for lease in leases:
                    lease.wait(cfg["timeout"])  # the engine gave version k back
                be.bump(params)
                be.checksums(params, sums)
                be.synchronize()  # the new version is complete when the sync starts, as in the peers
                t0 = time.monotonic_ns()
                parts = buckets[variant]
                leases = [ch.send_many(part, stream=None if host else be.stream, timeout=cfg["timeout"],
                                       meta={"step": k, "variant": variant, "t0": t0, "part": i, "parts": len(parts)})
                          for i, part in enumerate(parts)]
                if timed:
                    send_ms.append((time.monotonic_ns() - t0) / 1e6)
                if k == cfg["warmup"] + cfg["reps"] - 1:
                    for lease in leases:
                        lease.wait(cfg["timeout"])
                    mem[variant].update(free_after=be.memory(), fds_after=_fd_count(),
                                        cpu_ms_per_step=round((time.process_time() - cpu0) * 1e3 / cfg["reps"], 3))
                    leases = []
        finally:
            ch.close()
        # torch's tensors were lent in place exactly when nothing but the checksums went into the pool
        in_place = in_pool or (pool.capacity <= cfg["chunk_bytes"] and len(segments_for(cfg["devices"][0])) > 0)
    return {"send_ms": send_ms, "memory": mem, "in_place": in_place}


def _engine(cfg: dict[str, Any], _ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from ...channel import connect, release_all
    from ...errors import PeerClosedError

    host = cfg["host"]
    be: Any = _Numpy() if host else _Torch(cfg["devices"][1])
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]
    own = be.empty_like_shapes(shapes) if "copy" in cfg["variants"] else {}
    out: dict[str, Any] = {"sync_ms": {v: [] for v in cfg["variants"]}, "memory": {}, "bad_checksums": 0}
    with connect(cfg["address"], timeout=cfg["timeout"], device=None if host else cfg["devices"][1]) as ch:
        cpu0 = 0.0
        settle_gc()
        for variant, k, timed in _steps(cfg):
            if k == cfg["warmup"]:
                out["memory"][variant] = {"free_before": be.memory(), "fds_before": _fd_count()}
                cpu0 = time.process_time()
            received: list[Any] = []  # every Received of the step
            views: dict[str, Any] = {}
            part, parts, meta = 0, 1, {}
            while part < parts:  # the step's batches, each used as it arrives
                batch = ch.recv_many(timeout=cfg["timeout"], stream=None if host else be.stream)
                received += batch.values()
                meta = next(iter(batch.values())).meta or {}
                if meta.get("step") != k or meta.get("variant") != variant or meta.get("part") != part:
                    raise RuntimeError(f"expected part {part} of step {k} of {variant}, got {meta}")
                parts = meta["parts"]
                part += 1
                got = be.views(batch)
                if variant == "copy":
                    be.copy_all([own[n] for n in got if n != SUMS], [v for n, v in got.items() if n != SUMS])
                    if SUMS in got:
                        views[SUMS] = got[SUMS]
                else:
                    views.update(got)
                got = None
            sums = views.pop(SUMS)
            if variant == "copy":
                release_all(r for r in received if r.name != SUMS)  # one cuStreamSynchronize: copies done
                t1 = time.monotonic_ns()
                held = [own[n] for n, _ in shapes]
            else:
                t1 = time.monotonic_ns()
                held = [views[n] for n, _ in shapes]
            if timed:
                out["sync_ms"][variant].append((t1 - meta["t0"]) / 1e6)
            if not be.equal_sums(held, sums):  # the "rollout": read version k
                out["bad_checksums"] += 1
            held = sums = views = None  # drop the views, then give version k back
            release_all(received)
            if k == cfg["warmup"] + cfg["reps"] - 1:
                out["memory"][variant].update(free_after=be.memory(), fds_after=_fd_count(),
                                              cpu_ms_per_step=round((time.process_time() - cpu0) * 1e3 / cfg["reps"],
                                                                    3))
        # The trainer closes first: its last fd count must see its channel whole, not one this end ended.
        try:
            ch.recv(timeout=cfg["timeout"])
        except PeerClosedError:
            pass
        else:
            raise RuntimeError("the trainer sent more than its steps")
    return out


#: Largest buffer the copy limit copies at once; a larger payload's time is scaled from it.
LIMIT_BYTES = 16 << 30


def _limit(cfg: dict[str, Any], _ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    """One copy of the payload: device to device on the trainer's GPU, and to the engine's GPU."""
    total = cfg["payload_bytes"]
    n = min(total, LIMIT_BYTES)
    reps = max(cfg["reps"], 5)
    if cfg["host"]:
        import numpy as np

        src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append((time.perf_counter() - t) * 1e3 * total / n)
        return {"copy_ms": times[1:], "bytes": n}
    import torch

    p, c = cfg["devices"]
    src = torch.ones(n, dtype=torch.uint8, device=p)
    out: dict[str, Any] = {"bytes": n}
    for key, dev in (("copy_ms", p), ("peer_ms", c)):
        if key == "peer_ms" and c == p:
            continue
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)  # cudaMemcpyAsync; across GPUs a peer copy (NVLink)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * total / n)
        out[key] = times[1:]
        del dst
    return out


def _peer(role: str) -> Any:
    def run(cfg: dict[str, Any], _ctl: socket.socket, socks: list[socket.socket]) -> dict[str, Any]:
        if cfg.get("peer") == "vllm-backend":
            from . import weight_sync_vllm as vb

            return (vb.trainer if role == "peer-trainer" else vb.engine)(cfg, socks[0].detach())
        from .weight_sync_peers import run_peer

        return run_peer(role, cfg, socks[0].detach())

    return run


#: The child roles (:func:`.child.serve`).
ROLES = {"trainer": _trainer, "engine": _engine, "limit": _limit, "peer-trainer": _peer("peer-trainer"),
         "peer-engine": _peer("peer-engine")}


# --- the parent: spawn, collect, report ------------------------------------------------------

#: Every path a placement runs, in table order: ours, the peers, the limit.
PATHS = ("hand-off", "copy", "vllm-backend", "expandable-segments", "torch-reductions", "ipc-buckets", "copy-limit")


def _paths(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [n for n in names if n not in PATHS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown path(s) {', '.join(bad) or '(none)'}; choose from {', '.join(PATHS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The weight-sync options of ``bench`` (it also uses ``--reps``, ``--warmup``, ``--devices``, ``--json``,
    ``--plot`` and ``--timeout``)."""
    p.add_argument("--workload", choices=tuple(WORKLOADS),
                   help="weight sync: push a whole Qwen3-8B-shaped (ws-8b) or Qwen3-30B-A3B-shaped (ws-moe) "
                        "bf16 state dict from a trainer to an engine every step; --devices P,C with C != P "
                        "adds the other-GPU placement")
    p.add_argument("--small", action="store_true", help="with --workload: a few-MB model of the same layout")
    p.add_argument("--paths", type=_paths, default=PATHS, metavar="P,Q",
                   help=f"with --workload: the paths to run, comma-separated (default all: {','.join(PATHS)})")
    p.add_argument("--host", action="store_true", help="with --workload: host pools (memfd, NumPy), no GPU")


def _merge(results: list[dict[str, Any]]) -> tuple[str, str | None]:
    bad = [r for r in results if r.get("status") != "ok"]
    if not bad:
        return "ok", None
    return bad[0]["status"], "; ".join(r["reason"] for r in bad)


def _run_ours(cfg: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    trainer = start("weight_sync", "trainer", cfg, env=env)
    children, results = [trainer], []
    try:
        ready = trainer.result(cfg["timeout"])
        if not ready.get("ready"):
            results = [ready]
            return {"status": ready["status"], "reason": ready["reason"]}
        children.append(start("weight_sync", "engine", cfg))
        results = [children[1].result(cfg["timeout"] * 4), trainer.result(cfg["timeout"] * 4)]
    finally:  # the children in the order of their results: the engine's first
        finish(list(reversed(children)), cfg["timeout"], results or [{"status": "error"}])
    status, reason = _merge(results)
    if status != "ok":
        return {"status": status, "reason": reason}
    eng, tr = results[0]["result"], results[1]["result"]
    return {"status": "ok", "reason": None, "engine": eng, "trainer": tr}


def _run_peer(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = {**cfg, "peer": name, "variants": [name]}
    a, b = socket.socketpair()
    children: list[Child] = []
    try:
        children.append(start("weight_sync", "peer-trainer", cfg, fds=[a]))
        children.append(start("weight_sync", "peer-engine", cfg, fds=[b]))
    except BaseException:
        finish(children, cfg["timeout"], [{"status": "error"}] * len(children))
        raise
    finally:
        a.close()
        b.close()
    results: list[dict[str, Any]] = []
    try:
        results = [c.result(cfg["timeout"] * 4) for c in reversed(children)]
    finally:
        finish(list(reversed(children)), cfg["timeout"], results or [{"status": "error"}])
    status, reason = _merge(results)
    if status != "ok":
        return {"status": status, "reason": reason}
    return {"status": "ok", "reason": None, "engine": results[0]["result"], "trainer": results[1]["result"]}


def _run_limit(cfg: dict[str, Any]) -> dict[str, Any]:
    child = start("weight_sync", "limit", cfg)
    res: dict[str, Any] = {}
    try:
        res = child.result(cfg["timeout"])
    finally:
        finish([child], cfg["timeout"], [res])
    return res


def _stats(values: list[float]) -> dict[str, float] | None:
    """A row's JSON statistics of its steps (ms), or ``None`` for no steps."""
    stats = Stats.of(values)
    return None if stats is None else stats.to_json("p50", "p99", "n")


def _vllm_backend_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``vllm-backend`` path for one placement: its two roles on a socket pair, as the peers."""
    res = _run_peer("vllm-backend", cfg)
    if res["status"] != "ok":
        return _row("vllm-backend", "ours", None, status=res["status"], reason=res["reason"])
    tr, en = res["trainer"], res["engine"]
    ms = [(t1 - t0) / 1e6 for t0, t1 in zip(tr["t0"], en["t1"])]
    return _row("vllm-backend", "ours", ms, status="ok", bad_checksums=en["bad_checksums"], trainer=tr["memory"],
                engine=en["memory"], staged_bytes=tr["staged_bytes"], batches=tr["batches"],
                what="TrainerEngine.send_weights -> WorkerEngine.receive_weights returned (load_weights copies)")


def _row(name: str, kind: str, values: list[float] | None, **extra: Any) -> dict[str, Any]:
    return {"path": name, "kind": kind, "ms": _stats(values or []), **extra}


def _placement(label: str, cfg: dict[str, Any], say: Any) -> dict[str, Any]:
    """Every path for one placement: ours (hand-off, copy, expandable segments), the peers, the limit."""
    rows: list[dict[str, Any]] = []
    say(f"placement {label}: trainer GPU/engine GPU {cfg['devices']}" if not cfg["host"] else "host pools")
    paths = cfg.get("paths", PATHS)
    ours = _run_ours(cfg) if cfg["variants"] else {"status": "ok"}
    for v in cfg["variants"]:
        if ours["status"] != "ok":
            rows.append(_row(v, "ours", None, status=ours["status"], reason=ours["reason"]))
            continue
        eng, tr = ours["engine"], ours["trainer"]
        rows.append(_row(v, "ours", eng["sync_ms"][v], status="ok", bad_checksums=eng["bad_checksums"],
                         trainer=tr["memory"].get(v), engine=eng["memory"].get(v),
                         send_ms=_stats(tr["send_ms"])))
    if "vllm-backend" in paths:  # the vLLM backend in vLLM's order (weight_sync_vllm's two roles)
        say(f"placement {label}: vllm-backend")
        rows.append(_vllm_backend_row(cfg))
    if cfg["host"]:  # (asked for by --paths: said so, not left out of the table without a word)
        for name, kind in (("expandable-segments", "ours"), ("torch-reductions", "peer"), ("ipc-buckets", "peer")):
            if name in paths:
                rows.append(_row(name, kind, None, status="unsupported",
                                 reason="GPU memory only: not measured over host pools (--host)"))
    if not cfg["host"] and "expandable-segments" in paths:
        exp = _run_ours({**cfg, "variants": ["hand-off"], "expandable": True},
                        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        ok = exp["status"] == "ok"
        rows.append(_row("expandable-segments", "ours", exp["engine"]["sync_ms"]["hand-off"] if ok else None,
                         status=exp["status"], reason=exp["reason"],
                         bad_checksums=exp["engine"]["bad_checksums"] if ok else None,
                         in_place=exp["trainer"]["in_place"] if ok else None,
                         trainer=exp["trainer"]["memory"].get("hand-off") if ok else None,
                         engine=exp["engine"]["memory"].get("hand-off") if ok else None,
                         send_ms=_stats(exp["trainer"]["send_ms"]) if ok else None))
    for peer in ("torch-reductions", "ipc-buckets"):
        if not cfg["host"] and peer in paths:
            say(f"placement {label}: peer {peer}")
            res = _run_peer(peer, cfg)
            rows.append(_row(peer, "peer", res["engine"]["sync_ms"] if res["status"] == "ok" else None,
                             status=res["status"], reason=res["reason"],
                             bad_checksums=res["engine"]["bad_checksums"] if res["status"] == "ok" else None,
                             trainer={"cpu_ms_per_step": res["trainer"]["cpu_ms_per_step"]}
                             if res["status"] == "ok" else None,
                             engine={"cpu_ms_per_step": res["engine"]["cpu_ms_per_step"]}
                             if res["status"] == "ok" else None))
    if "copy-limit" not in paths:
        return {"placement": label, "devices": cfg["devices"], "rows": rows}
    lim = _run_limit(cfg)
    limit = lim.get("result") or {}
    key = "peer_ms" if cfg["devices"][0] != cfg["devices"][1] else "copy_ms"
    rows.append(_row("copy-limit", "limit", limit.get(key), status=lim.get("status"), reason=lim.get("reason"),
                     what="cudaMemcpyPeer to the other GPU" if key == "peer_ms" else
                     ("numpy.copyto" if cfg["host"] else "device-to-device cudaMemcpy"),
                     measured_bytes=limit.get("bytes")))
    return {"placement": label, "devices": cfg["devices"], "rows": rows}


def _fmt(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def print_table(results: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    cfg = results["config"]
    print(f"{cfg['workload']}{' (small)' if cfg['small'] else ''}: {cfg['tensors']} tensors, "
          f"{cfg['payload_bytes'] / 1e9:.3f} GB bf16, {cfg['reps']} steps after {cfg['warmup']} warm-up(s)",
          file=file)
    print(f"{'placement':<10} {'path':<20} {'kind':<6} {'p50 ms':>9} {'p99 ms':>9} {'x limit':>8} "
          f"{'cpu ms/step T/E':>16}  notes", file=file)
    for pl in results["placements"]:
        lim = row_p50(pl["rows"], "copy-limit")
        for r in pl["rows"]:
            ms = r["ms"] or {}
            ratio = f"{ms['p50'] / lim:.2f}" if ms and lim else "-"
            cpu = "/".join(_fmt((r.get(s) or {}).get("cpu_ms_per_step")) for s in ("trainer", "engine"))
            note = r.get("reason") or r.get("what") or ""
            if r.get("in_place") is not None:
                note = ("torch's pages lent in place " if r["in_place"] else "copied into the pool ") + note
            if r.get("bad_checksums"):
                note = f"{r['bad_checksums']} BAD CHECKSUMS " + note
            if r.get("status") not in ("ok", None):
                note = f"{r['status']}: {note}"
            print(f"{pl['placement']:<10} {r['path']:<20} {r['kind']:<6} {_fmt(ms.get('p50')):>9} "
                  f"{_fmt(ms.get('p99')):>9} {ratio:>8} {cpu if cpu != '-/-' else '-':>16}  {note}", file=file)
    print("targets:", file=file)
    for t in results["targets"]:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        if t["met"] is None and t["placement"] == "host" and t["value"]:
            verdict = "n/a (the targets are for GPUs)"
        print(f"  [{t['placement']}] {t['target']}: {verdict} ({t['value'] or 'no number'})", file=file)


def plot(results: dict[str, Any], path: str) -> str | None:
    """A bar chart of p50 per path and placement; returns why it was skipped (no matplotlib, or the file could not
    be written), or ``None``."""
    plt, why = pyplot()
    if plt is None:
        return why
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels, values = [], []
    for pl in results["placements"]:
        for r in pl["rows"]:
            if r["ms"]:
                labels.append(f"{pl['placement']}: {r['path']}")
                values.append(r["ms"]["p50"])
    ax.barh(labels, values)
    ax.set_xscale("log")
    ax.set_xlabel("p50 ms per step (trainer sends -> engine holds the new version)")
    ax.set_title(results["config"]["workload"])
    fig.tight_layout()
    return save_figure(plt, fig, path)


def main(args: argparse.Namespace) -> int:
    """Run the weight-sync workload described by the parsed ``bench`` options; returns the exit status."""
    from .environment import environment
    from .progress import Progress

    _say = Progress(0).say
    env = environment()
    host = bool(args.host)
    p, c = args.devices
    if not host and not env["cuda"]["available"]:
        _say(f"weight sync on GPUs skipped: {env['cuda']['reason']} (--host runs it over host pools)")
        return 0
    if not host and max(p, c) >= len(env["gpus"]):
        print(f"dmabuf-interop: error: --devices {p},{c} out of range: this machine has {len(env['gpus'])} CUDA "
              f"device(s)", file=sys.stderr)
        return 2
    shapes = model_shapes(args.workload, args.small)
    total = payload_bytes(shapes)
    base = {"workload": args.workload, "small": args.small, "host": host, "shapes": shapes, "reps": args.reps,
            "warmup": args.warmup, "timeout": args.timeout, "payload_bytes": total,
            "variants": [v for v in ("hand-off", "copy") if v in args.paths], "paths": list(args.paths),
            "chunk_bytes": 2 << 30 if not args.small else 16 << 20}
    plan = [("host", [-1, -1])] if host else [("A", [p, p])] + ([("B", [p, c])] if c != p else [])
    results: dict[str, Any] = {
        "schema": 1, "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": env,
        "config": {k: v for k, v in base.items() if k != "shapes"} | {"tensors": len(shapes)},
        "placements": [], "plot": None,
    }
    _say(f"{args.workload}: {len(shapes)} tensors, {total / 1e9:.3f} GB, {args.reps} steps after {args.warmup} "
         f"warm-up(s)")
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-ws-") as tmp:
        for label, devices in plan:
            cfg = {**base, "devices": devices, "address": os.path.join(tmp, f"ws-{label}.sock")}
            results["placements"].append(_placement(label, cfg, _say))
    results["targets"] = workload_targets(args.workload, results["placements"], host)
    print_table(results)
    if args.plot:
        why = plot(results, args.plot)
        results["plot"] = {"path": None, "skipped": why} if why else {"path": args.plot}
        _say(f"plot skipped: {why}" if why else f"wrote {args.plot}")
    if args.json:
        write_json(results, args.json)
        _say(f"wrote {args.json}")
    failed = any(r.get("status") == "error" or r.get("bad_checksums") for pl in results["placements"]
                 for r in pl["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(serve(ROLES))
