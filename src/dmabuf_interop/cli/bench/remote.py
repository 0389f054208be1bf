"""``dmabuf-interop bench --remote``: a tcp:// channel on loopback against a bare NIXL READ loop and a local channel.

Three measurements per size, in one run, host memory, each a serving child and a
reading child (:mod:`.child`; this process loads neither NIXL nor UCX, so Ctrl-C
ends every child before the exit line): ``channel`` (``recv`` + release over a
tcp:// channel: control message, one NIXL READ into the receiver's pool, release
message), ``nixl`` (the same READ with two bare agents: ``initialize_xfer`` once,
``transfer`` + ``check_xfer_state`` per iteration) and ``local`` (``recv`` +
release over an AF_UNIX channel: zero-copy, no bytes move, so its GB/s is the
size over the channel's cost per message, not a transfer rate). Each size runs
``--warmup`` untimed reads (at least one: the first READ registers the receiving
chunk), then ``--reps`` timed ones, each timed on its own. A column is the median
of the reads' GB/s (1e9 bytes per second) with its spread (:attr:`.stats.Stats.spread`);
the verdict is :func:`.targets.remote_verdict`. UCX is pinned to
``UCX_TLS=tcp UCX_NET_DEVICES=lo`` unless the caller set them (``UCX_TLS=tcp,cuda_copy``
where NVIDIA GPUs are present, since NIXL's UCX backend refuses ``tcp`` alone there).
"""

from __future__ import annotations

import argparse
import base64
import glob
import os
import secrets
import shlex
import socket
import sys
import tempfile
import time
from typing import Any

from .._units import MiB, size_label
from .child import Child, finish, report, serve, start
from .progress import Progress
from .stats import Stats
from .targets import OVERHEAD_TARGET_PCT, remote_verdict

__all__ = ["MEASUREMENTS", "LOCAL_MEASURES", "run", "bench"]

#: key -> what the column measures, in run order.
MEASUREMENTS = {"channel": "tcp:// channel", "nixl": "bare NIXL READ", "local": "local channel"}
#: What the local column is, as the table's note says it.
LOCAL_MEASURES = ("local: recv + release over an AF_UNIX channel on a host pool: zero-copy, no bytes move, so its "
                  "GB/s is the size over the channel's cost per message, not a transfer rate")
#: Version of the ``--json`` layout (2: per-read medians, spread_pct, overhead_uncertainty_pct, met).
JSON_SCHEMA = 2


def _pool(sizes: list[int]) -> Any:
    from ...channel import SharedPool

    chunk = max(sizes) + MiB
    return SharedPool(None, chunk_bytes=chunk, max_bytes=2 * chunk)


# --- the children ------------------------------------------------------------------------------

def _producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> None:
    """Lend one filled array ``count`` times per size over a channel at ``address``."""
    from ...channel import listen

    sizes, count = cfg["sizes"], cfg["count"]
    pool = _pool(sizes)
    with listen(cfg["address"], pool=pool) as listener:
        report(ctl, {"ready": True, "address": listener.address})
        ch = listener.accept(120)
        for size in sizes:
            a = pool.empty(size, "uint8")
            a[:] = 7
            leases = [ch.send(a, timeout=120) for _ in range(count)]
            for lease in leases:
                lease.wait(300)
            del a
        ch.close()
    pool.close()


def _nixl_agent(role: str) -> Any:
    from ...channel.remote import nixl_module

    nixl = nixl_module()
    return nixl.nixl_agent(f"bench-{role}-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))


def _bare_producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> None:
    """Register one host buffer, report its address and the agent's metadata, serve READs until told to stop."""
    import numpy as np

    from ...fdpass import recv_message

    agent = _nixl_agent("bare")
    buf = np.full(max(cfg["sizes"]), 7, np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    report(ctl, {"ready": True, "addr": buf.ctypes.data, "md": base64.b64encode(agent.get_agent_metadata()).decode()})
    # "stop": the reader is done; the parent waits at most --timeout per size for it, and kills us on a failure
    recv_message(ctl, cfg["timeout"] * (len(cfg["sizes"]) + 1), max_fds=0)
    agent.deregister_memory(reg)


def _timed(ctl: socket.socket, size: int, warmup: int, reps: int, once: Any) -> None:
    """Report the seconds of each of ``reps`` calls of ``once`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        once()
    seconds = []
    for _ in range(reps):
        t = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - t)
    report(ctl, {"cell": {"size": size, "seconds": seconds}})


def _reader(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> None:
    """Read ``sizes`` from the serving child (``measure``: ``channel``, ``local`` or ``nixl``), one
    ``cell`` report per size."""
    sizes, warmup, reps, timeout = cfg["sizes"], cfg["warmup"], cfg["reps"], cfg["timeout"]
    if cfg["measure"] != "nixl":
        from ...channel import connect

        pool = _pool(sizes) if cfg["measure"] == "channel" else None
        try:
            with connect(cfg["address"], timeout=60, pool=pool) as ch:
                for size in sizes:
                    _timed(ctl, size, warmup, reps, lambda: ch.recv(120).release())
        finally:
            if pool is not None:
                pool.close()
        return
    import numpy as np

    info = cfg["served"]
    agent = _nixl_agent("bare-reader")
    remote = agent.add_remote_agent(base64.b64decode(info["md"]))
    dst = np.zeros(max(sizes), np.uint8)
    reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    for size in sizes:
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM"),
                                  agent.get_xfer_descs([(info["addr"], size, 0)], "DRAM"), remote)

        def once() -> None:
            # The same wait as RemoteChannel's: spin, then yield the core to the serving side.
            deadline = time.monotonic() + timeout
            state, spins = agent.transfer(h), 0
            while state == "PROC" and time.monotonic() < deadline:
                spins += 1
                if spins > 50:
                    time.sleep(0.0002)
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL READ of {size} bytes ended in state {state}")

        _timed(ctl, size, warmup, reps, once)
        h.release()
    agent.deregister_memory(reg)


# --- the parent --------------------------------------------------------------------------------

class Skipped(Exception):
    """A child found NIXL missing or unsupported here."""


def _failed(res: dict[str, Any]) -> Exception:
    reason = res.get("reason") or "failed"
    return Skipped(reason) if res.get("status") in ("not installed", "unsupported") else RuntimeError(reason)


def ucx_env() -> dict[str, str]:
    """The variables the children run with: ``UCX_TLS`` and ``UCX_NET_DEVICES`` as the caller set them, else
    ``tcp`` (``tcp,cuda_copy`` where NVIDIA GPUs are present: NIXL refuses ``tcp`` alone there) and ``lo``,
    and a token for the tcp:// channel's handshake."""
    return {"UCX_TLS": os.environ.get("UCX_TLS") or ("tcp,cuda_copy" if glob.glob("/dev/nvidia[0-9]*") else "tcp"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES") or "lo",
            "DMABUF_INTEROP_TOKEN": os.environ.get("DMABUF_INTEROP_TOKEN") or secrets.token_hex(32)}


def _measure(key: str, cfg: dict[str, Any], env: dict[str, str], progress: Progress) -> dict[int, Stats]:
    """One column: the serving child, then the reading child; per size, the Stats of the reads' GB/s.

    Raises:
        Skipped: NIXL is missing or unsupported.
        RuntimeError: a child failed (its reason).
    """
    timeout = cfg["timeout"]
    children: list[Child] = []
    results: list[dict[str, Any]] = []
    out: dict[int, Stats] = {}
    try:
        server = start("remote", "bare" if key == "nixl" else "producer", cfg, env=env)
        children.append(server)
        ready = server.result(timeout)
        results.append(ready)
        if not ready.get("ready"):
            raise _failed(ready)
        served = {"served": ready} if key == "nixl" else {"address": ready["address"]}
        reader = start("remote", "reader", {**cfg, "measure": key, **served}, env=env)
        children.append(reader)
        results.append({})
        while True:
            res = results[1] = reader.result(timeout)
            if "cell" not in res:
                break
            size, seconds = res["cell"]["size"], res["cell"]["seconds"]
            stats = out[size] = Stats.of(size / s / 1e9 for s in seconds)
            progress.cell(f"{MEASUREMENTS[key]} {size_label(size)}: median {stats.median:.3g} GB/s, spread "
                          f"{stats.spread * 100:.0f}% ({stats.n} reads)")
        if res.get("status") != "ok":
            raise _failed(res)
        if key == "nixl":
            server.send({"stop": True})
        results[0] = server.result(timeout)
        if results[0].get("status") != "ok":
            raise _failed(results[0])
    finally:
        finish(children, timeout, results + [{}] * (len(children) - len(results)))
    return out


def run(sizes: list[int], warmup: int = 1, reps: int = 20, timeout: float = 300.0,
        progress: Progress | None = None) -> list[dict[str, Any]]:
    """One row per size: ``bytes``, ``reps``, the medians ``channel_gbs``, ``nixl_gbs``, ``local_gbs``,
    ``spread_pct`` (per column), ``overhead_pct``, ``overhead_uncertainty_pct`` and ``met``
    (:func:`.targets.remote_verdict`).

    Raises:
        Skipped: NIXL is not installed, or not supported here.
        RuntimeError: a child failed (its reason).
    """
    progress = progress or Progress(0)
    env = ucx_env()
    cfg = {"sizes": sizes, "warmup": max(1, warmup), "reps": reps, "count": max(1, warmup) + reps,
           "timeout": timeout}
    stats: dict[str, dict[int, Stats]] = {}
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-bench-") as d:
        addresses = {"channel": "tcp://127.0.0.1:0", "nixl": None, "local": os.path.join(d, "s")}
        for i, (key, what) in enumerate(MEASUREMENTS.items(), 1):
            progress.say(f"[{i}/{len(MEASUREMENTS)}] {what}: starting {'server' if key == 'nixl' else 'producer'} "
                         "and reader")
            stats[key] = _measure(key, {**cfg, "address": addresses[key]}, env, progress)
    rows = []
    for s in sizes:
        c, n, loc = stats["channel"][s], stats["nixl"][s], stats["local"][s]
        overhead, uncertainty, met = remote_verdict(c, n)
        rows.append({"bytes": s, "reps": reps, "channel_gbs": c.median, "nixl_gbs": n.median,
                     "overhead_pct": overhead, "local_gbs": loc.median,
                     "spread_pct": {k: round(v[s].spread * 100, 2) for k, v in stats.items()},
                     "overhead_uncertainty_pct": round(uncertainty, 2), "met": met})
    return rows


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "not met", None: "unclear: within the spread (more --reps)"}[met]


def bench(args: argparse.Namespace) -> int:
    """``dmabuf-interop bench --remote``: measure, print the table, write ``--json``; the exit status."""
    from .report import write_json

    env = ucx_env()
    tls, devices = env["UCX_TLS"], env["UCX_NET_DEVICES"]
    warmup = max(1, args.warmup)
    progress = Progress(len(MEASUREMENTS) * len(args.sizes))
    try:
        progress.say(f"--remote: sizes {','.join(size_label(s) for s in args.sizes)}, {args.reps} reps after "
                     f"{warmup} warm-up(s), UCX_TLS={tls} UCX_NET_DEVICES={devices}")
        rows = run(args.sizes, args.warmup, args.reps, args.timeout, progress)
    except Skipped as exc:
        print(f"bench --remote skipped: {exc}", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        print(f"dmabuf-interop: error: bench --remote: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(f"tcp:// channel vs bare NIXL READ vs local channel (host memory, UCX_TLS={tls} UCX_NET_DEVICES={devices}, "
          f"{args.reps} reps after {warmup} warm-up(s); GB/s = 1e9 B/s, the median of the reads, "
          "+- their spread)")
    print(f"{'size':>9} {'channel GB/s':>15} {'NIXL GB/s':>15} {'overhead':>17} {'local GB/s':>15}  "
          f"target (overhead <= {OVERHEAD_TARGET_PCT:g}%)")
    for r in rows:
        sp = r["spread_pct"]
        overhead = f"{r['overhead_pct']:.1f}% +-{r['overhead_uncertainty_pct']:.1f}"
        print(f"{size_label(r['bytes']):>9} {_cell(r['channel_gbs'], sp['channel']):>15} "
              f"{_cell(r['nixl_gbs'], sp['nixl']):>15} {overhead:>17} "
              f"{_cell(r['local_gbs'], sp['local']):>15}  {_verdict(r['met'])}")
    print("spread: the middle 80% of the reads (p10 to p90) as a share of their median; the overhead's +- is twice "
          "its standard error, and the verdict is unclear while the target lies within it")
    print(LOCAL_MEASURES)
    if args.json:
        write_json({"schema": JSON_SCHEMA, "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ucx_tls": tls, "ucx_net_devices": devices,
                    "overhead_target_pct": OVERHEAD_TARGET_PCT, "statistic": "median over the timed reads of "
                    "bytes / read time; spread_pct: (p90 - p10) / median", "local_measures": LOCAL_MEASURES,
                    "rows": rows}, args.json)
        progress.say(f"wrote {args.json}")
    return 0


def _cell(gbs: float, spread_pct: float) -> str:
    return f"{gbs:.2f} +-{spread_pct:.0f}%"


if __name__ == "__main__":
    sys.exit(serve({"producer": _producer, "bare": _bare_producer, "reader": _reader}))
