"""``dmabuf-interop bench``: what it costs to hand a buffer from one process to another.

For each mechanism and size the parent starts a producer and a consumer
(fresh interpreters, :mod:`.bench_peers`; CUDA does not survive ``fork()``),
both create their CUDA context and load their kernels before anything is
timed, then hand a buffer over ``--warmup`` + ``--reps`` times. Per
repetition, from ``CLOCK_MONOTONIC`` timestamps taken in both processes:

=============  ===========================================================
export         producer: make the shareable handle (producer side)
transport      producer's send -> consumer's receive (JSON + SCM_RIGHTS)
import_map     consumer: import and map until a device pointer exists
first_access   consumer: a 1-thread kernel reads 4 bytes, stream synchronised
total          producer starts sharing -> consumer has read (the hand-off)
=============  ===========================================================

plus ``export_transport`` (producer starts -> consumer has the message),
which is what a mechanism with no import here (dma-buf on H200) can show.
Medians and 90th percentiles in microseconds.

Then, with a GPU: a read kernel over a POSIX-fd import against the same
kernel over native ``cuMemAlloc`` memory (the ratio), the import read from
another GPU against ``cuMemcpyPeer`` of the same bytes, and the library's
Python overhead against the same driver calls made in a tight loop.

Output: progress on stderr, a table on stdout, ``--json`` (every number,
the environment, the command) and ``--plot`` (log-log hand-off latency
against size; matplotlib is optional). Exit status: 0 when the benchmark ran
(mechanisms that are not installed or not supported are reported, not
failures), 1 when a mechanism failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import select
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "MECHANISMS", "parse_sizes", "size_label", "PHASES"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = (4 * KiB, 1 * MiB, 64 * MiB, 1 * GiB)
PHASES = ("export", "transport", "import_map", "first_access", "total", "export_transport")
JSON_SCHEMA = 1

#: name -> (kind, module that must be importable or None, what is measured)
MECHANISMS: dict[str, tuple[str, str | None, str]] = {
    "posix-fd": ("ours", None,
                 "naive: every hand-off exports a fresh cuMemCreate allocation (vmm.export_posix_fd: create, "
                 "reserve, map, set access, export the fd; the allocation is part of the export) and the "
                 "consumer imports it (vmm.import_posix_fd: import, reserve, map, set access), reads, unmaps"),
    "posix-fd-cached": ("ours", None,
                        "cached: the producer hands off buffers from a ring of 2 exported POSIX-fd allocations per "
                        "size; the fd crosses once per allocation and the consumer keeps its import (handle, "
                        "reservation, mapping, access) keyed by the producer's allocation id, so a hand-off is a "
                        "JSON message naming the allocation; the first share of each allocation (in the warm-ups) "
                        "costs what posix-fd costs"),
    "dmabuf": ("ours", None,
               "dma-buf of an existing cuMemAlloc buffer (exporter.export_range) sent over SCM_RIGHTS; the "
               "consumer imports it (importer.import_dmabuf) where the driver supports it, otherwise only export "
               "and transport are timed"),
    "memfd": ("ours", None,
              "host shared memory, no GPU: a fresh memfd per hand-off (memfd.export_memfd), mmap in the consumer "
              "(memfd.import_memfd), first access is a CPU read"),
    "torch-ipc": ("peer", "torch",
                  "torch.multiprocessing CUDA tensor sharing as Queue.put/get do it: ForkingPickler.dumps of a "
                  "tensor allocated before t0 (cudaIpcGetMemHandle, IPC event, ref counter), "
                  "Connection.send_bytes, ForkingPickler.loads in the consumer (cudaIpcOpenMemHandle)"),
    "cuda-core-ipc": ("peer", "cuda.core",
                      "cuda.core IPC-enabled DeviceMemoryResource, pool shared once before timing; per hand-off "
                      "Buffer.ipc_descriptor of a buffer allocated before t0, sent as JSON, "
                      "Buffer.from_ipc_descriptor in the consumer"),
    "cupy-ipc": ("peer", "cupy",
                 "cupy.cuda.runtime.ipcGetMemHandle of a CuPy array allocated before t0, the 64-byte handle sent "
                 "as JSON, ipcOpenMemHandle / ipcCloseMemHandle in the consumer"),
}
CUDA_FREE = {"memfd"}
#: Mechanisms whose consumer ends up with a usable CUDA device pointer (candidates for "our fastest").
GPU_HANDOFF_OURS = ("posix-fd", "posix-fd-cached", "dmabuf")


def _say(line: str) -> None:
    print(f"bench: {line}", file=sys.stderr, flush=True)


# --- arguments ---------------------------------------------------------------------------

_SIZE_RE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB}


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M,64M,1G"`` -> bytes (binary units; ``4KiB``, ``4k``, ``4096`` also work).

    Raises:
        argparse.ArgumentTypeError: an empty list, a malformed entry, or a size
            that is not a positive multiple of 4 bytes up to 64 GiB.
    """
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = _SIZE_RE.fullmatch(part)
        if not m:
            raise argparse.ArgumentTypeError(
                f"invalid size {part!r}: use bytes or a K/M/G suffix, e.g. --sizes 4K,1M,64M,1G")
        n = int(m.group(1)) * _UNITS[m.group(2).upper()]
        if n <= 0 or n % 4 or n > 64 * GiB:
            raise argparse.ArgumentTypeError(f"invalid size {part!r}: must be a positive multiple of 4 bytes, "
                                             f"at most 64G")
        if n not in out:
            out.append(n)
    return out


def _mechanisms(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(MECHANISMS)
    bad = [n for n in names if n not in MECHANISMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mechanism {', '.join(bad) or text!r}: choose from "
                                         f"{', '.join(MECHANISMS)} (comma-separated) or all")
    return list(dict.fromkeys(names))


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid count {value}: must be >= {minimum}")
        return value
    return parse


def _devices(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid --devices {text!r}: expected PRODUCER,CONSUMER ordinals, e.g. 0,1")
    return int(m.group(1)), int(m.group(2))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: expected seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: must be a positive number of seconds")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                   help="comma-separated buffer sizes, binary units (default 4K,1M,64M,1G)")
    p.add_argument("--reps", type=_count(1), default=20, help="timed repetitions per size (default 20)")
    p.add_argument("--warmup", type=_count(0), default=3, help="untimed repetitions first (default 3)")
    p.add_argument("--mechanisms", type=_mechanisms, default=list(MECHANISMS),
                   help=f"comma-separated, default all: {','.join(MECHANISMS)}")
    p.add_argument("--devices", type=_devices, default=(0, 0), metavar="P,C",
                   help="CUDA ordinals of the producer and the consumer (default 0,0)")
    p.add_argument("--json", metavar="PATH", help="write every number and the environment as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="log-log plot of median hand-off latency vs size "
                                                     "(needs matplotlib: pip install 'dmabuf-interop[plot]')")
    p.add_argument("--timeout", type=_seconds, default=300.0,
                   help="seconds to wait for the next record from a benchmark process; a record comes after all "
                        "repetitions of one size, so allow for --reps (default 300)")
    __import__(f"{__package__}.weight_sync", fromlist=["_"]).add_arguments(p)


# --- statistics and formatting -----------------------------------------------------------

def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stat(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(percentile(values, 50), 3), "p90": round(percentile(values, 90), 3)}


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def _cell_stats(size: int, prod: list[dict[str, Any]], cons: list[dict[str, Any]],
                info: dict[str, Any]) -> dict[str, Any]:
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    for p, c in zip(prod, cons):
        t0, t_exp, t_send = p["t"]
        t_recv, t_imp, t_read = c["t"]
        samples["export"].append((t_exp - t0) / 1e3)
        samples["transport"].append((t_recv - t_send) / 1e3)
        samples["export_transport"].append((t_recv - t0) / 1e3)
        if t_imp is not None and t_read is not None:
            samples["import_map"].append((t_imp - t_recv) / 1e3)
            samples["first_access"].append((t_read - t_imp) / 1e3)
            samples["total"].append((t_read - t0) / 1e3)
    cell: dict[str, Any] = {
        "size": size, "label": size_label(size), "reps": len(samples["export"]),
        "phases_us": {k: _stat(v) for k, v in samples.items()},
        "samples_us": {k: [round(x, 2) for x in v] for k, v in samples.items() if v},
    }
    breakdown = {}
    for side, recs, phase in (("producer_export", prod, "export"), ("consumer_import_map", cons, "import_map")):
        steps = [r.get("steps") for r in recs]
        if not any(steps) or not samples[phase]:
            continue
        names = sorted({k for s in steps if s for k in s})
        per = {n: _stat([(s or {}).get(n, 0) / 1e3 for s in steps]) for n in names}
        other = [ph - sum((s or {}).values()) / 1e3 for ph, s in zip(samples[phase], steps)]
        per["other (Python, fd, bookkeeping)"] = _stat(other)
        breakdown[side] = per
    if breakdown:
        cell["breakdown_us"] = breakdown
    firsts = sum(1 for c in cons if c.get("first_share"))
    if any("first_share" in c for c in cons):
        cell["first_share_reps"] = firsts
    if "import" in info:
        cell["import"] = info["import"]
    return cell


# --- environment -------------------------------------------------------------------------

def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cupy_version() -> str | None:
    from importlib import metadata

    if importlib.util.find_spec("cupy") is None:
        return None
    for dist in metadata.packages_distributions().get("cupy", []):
        try:
            return f"{metadata.version(dist)} ({dist})"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment() -> dict[str, Any]:
    """Host, GPUs, driver and package versions (asks the driver; creates no CUDA context)."""
    from ... import _driver as driver, capabilities

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "clock": f"time.monotonic_ns ({time.get_clock_info('monotonic').implementation})",
        "packages": {
            "dmabuf-interop": _dist_version("dmabuf-interop") or _package_version(),
            "cuda-bindings": _dist_version("cuda-bindings", "cuda-python"),
            "cuda-core": _dist_version("cuda-core", "cuda_core"),
            "numpy": _dist_version("numpy"),
            "torch": _dist_version("torch") if _installed("torch") else None,
            "cupy": _cupy_version(),
            "matplotlib": _dist_version("matplotlib") if _installed("matplotlib") else None,
        },
    }
    try:
        with open("/proc/cpuinfo") as fh:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
    except OSError:
        env["cpu"] = None
    try:
        with open("/proc/driver/nvidia/version") as fh:
            env["nvidia_driver"] = fh.readline().strip()
    except OSError:
        env["nvidia_driver"] = None
    env["source"] = _git_revision()
    ok, reason = capabilities.driver_status()
    env["cuda"] = {"available": ok, "reason": reason or None}
    if ok:
        env["cuda"]["driver_api_version"] = driver.driver_version()
        env["gpus"] = [{"ordinal": i, "name": driver.device_name(i), "pci_bus_id": driver.device_pci_bus_id(i)}
                       for i in range(driver.device_count())]
    else:
        env["gpus"] = []
    return env


def _git_revision() -> dict[str, Any] | None:
    """The commit of the source tree this ran from, and whether it had local changes (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "src_modified": bool(dirty.stdout.strip())}


def _package_version() -> str:
    from ... import __version__

    return f"{__version__} (source tree)"


# --- one producer/consumer pair ----------------------------------------------------------

def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if src not in parts:
        env["PYTHONPATH"] = os.pathsep.join([src, *parts])
    return env


def _spawn(role: str, fds: list[int]) -> subprocess.Popen[bytes]:
    try:
        out: Any = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        out = None
    cmd = [sys.executable, "-m", "dmabuf_interop.cli.bench.peers", role, *map(str, fds)]
    return subprocess.Popen(cmd, pass_fds=fds, env=_child_env(), stdin=subprocess.DEVNULL, stdout=out)


class _Role:
    def __init__(self) -> None:
        self.hello: dict[str, Any] | None = None
        self.recs: list[dict[str, Any]] = []
        self.cells: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
        self.ended = False
        self.done = False
        self.error: str | None = None


def run_pair(name: str, cfg: dict[str, Any], progress: Any = _say) -> dict[str, Any]:
    """Run one mechanism (or ``"_bandwidth"``) in a fresh producer/consumer pair.

    Returns ``{"status", "reason", "versions", "cells", "bandwidth", "overhead"}``.
    """
    from ...errors import DmaBufError, PeerClosedError
    from ...fdpass import recv_message, send_message
    from ...procs import wait_child

    timeout = float(cfg["timeout"])
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(4)]
    (ctl_p, ctl_p_child), (ctl_c, ctl_c_child), (pc_p, pc_c), (aux_p, aux_c) = pairs
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["producer"] = _spawn("producer", [ctl_p_child.fileno(), pc_p.fileno(), aux_p.fileno()])
        procs["consumer"] = _spawn("consumer", [ctl_c_child.fileno(), pc_c.fileno(), aux_c.fileno()])
    finally:
        for s in (ctl_p_child, ctl_c_child, pc_p, pc_c, aux_p, aux_c):
            s.close()  # the children hold them; EOF must reach a peer when the other dies
    socks = {"producer": ctl_p, "consumer": ctl_c}
    roles = {"producer": _Role(), "consumer": _Role()}
    out: dict[str, Any] = {"cells": [], "bandwidth": [], "overhead": None, "versions": {}}
    timed_out = False
    try:
        for s in socks.values():
            send_message(s, {**cfg, "mechanism": name})
        while not all(r.ended for r in roles.values()):
            live = {socks[k]: k for k, r in roles.items() if not r.ended}
            ready, _, _ = select.select(list(live), [], [], timeout)
            if not ready:
                timed_out = True
                for r in roles.values():
                    if not r.ended:
                        r.error = r.error or f"no message for {timeout:g} s (--timeout)"
                        r.ended = True
                break
            for sock in ready:
                role = live[sock]
                st = roles[role]
                try:
                    msg, _fds = recv_message(sock, timeout, max_fds=0)
                except PeerClosedError:
                    st.ended = True
                    if not st.done and st.error is None and (st.hello is None or st.hello.get("status") == "ok"):
                        st.error = f"{role} exited without reporting (see its stderr above)"
                    continue
                except DmaBufError as exc:
                    st.ended = True
                    st.error = f"{role}: {exc}"
                    continue
                _dispatch(name, role, msg, roles, out, progress)
    finally:
        for s in socks.values():
            s.close()
        for role, proc in procs.items():
            ended = wait_child(proc.pid, 0 if timed_out else min(timeout, 60.0))
            proc.returncode = ended.exitcode if ended.exitcode is not None else -(ended.signal or 9)
    hellos = [r.hello for r in roles.values() if r.hello]
    for h in hellos:
        out["versions"].update(h.get("versions") or {})
    not_ok = [h for h in hellos if h.get("status") != "ok"]
    errors = [f"{r.error}" for r in roles.values() if r.error]
    if not_ok:
        first = sorted(not_ok, key=lambda h: ("not installed", "unsupported", "error").index(h["status"]))[0]
        out["status"], out["reason"] = first["status"], first.get("reason")
    elif any(r.error and r.error.startswith("unsupported:") for r in roles.values()):
        out["status"] = "unsupported"
        out["reason"] = next(r.error for r in roles.values() if r.error and r.error.startswith("unsupported:"))
    elif errors:
        out["status"], out["reason"] = "error", "; ".join(errors)
    else:
        out["status"], out["reason"] = "ok", None
    return out


def _dispatch(name: str, role: str, msg: dict[str, Any], roles: dict[str, _Role], out: dict[str, Any],
              progress: Any) -> None:
    st = roles[role]
    if "hello" in msg:
        st.hello = msg
        if msg.get("status") != "ok":
            progress(f"{name}: {role}: {msg.get('status')}: {msg.get('reason')}")
    elif "rec" in msg:
        st.recs.append(msg["rec"])
    elif "cell" in msg:
        size = int(msg["cell"])
        st.cells[size] = (st.recs, msg)
        st.recs = []
        other = roles["consumer" if role == "producer" else "producer"]
        if size in other.cells:
            prod = roles["producer"].cells.pop(size)
            cons = roles["consumer"].cells.pop(size)
            cell = _cell_stats(size, prod[0], cons[0], {**prod[1], **cons[1]})
            out["cells"].append(cell)
            total = cell["phases_us"]["total"] or cell["phases_us"]["export_transport"]
            what = "total" if cell["phases_us"]["total"] else "export+transport (no import)"
            progress(f"{name} {cell['label']}: {what} median {_fmt(total['median'])} us, "
                     f"p90 {_fmt(total['p90'])} us ({cell['reps']} reps)")
    elif "bw" in msg:
        bw = msg["bw"]
        out["bandwidth"].append(bw)
        ratio = _ratio(bw.get("import"), bw.get("native"))
        line = f"bandwidth {size_label(bw['size'])}: import/native {ratio:.3f}" if ratio else \
            f"bandwidth {size_label(bw['size'])}"
        if bw.get("cross_import") and bw.get("memcpy_peer"):
            line += f", GPU{bw['peer_device']} reading GPU{bw['device']} through the import " \
                    f"{bw['cross_import']['gbps']:.0f} GB/s vs cuMemcpyPeer {bw['memcpy_peer']['gbps']:.0f} GB/s"
        progress(line)
    elif "overhead" in msg:
        out["overhead"] = msg["overhead"]
        progress("Python overhead measured")
    elif "done" in msg:
        st.done = True
    elif "error" in msg:
        st.error = str(msg["error"])
        progress(f"{name}: {st.error}")


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not a.get("gbps") or not b.get("gbps"):
        return None
    return a["gbps"] / b["gbps"]


# --- targets, table, plot ----------------------------------------------------------------

def _median(cell: dict[str, Any], phase: str = "total") -> float | None:
    st = cell["phases_us"].get(phase)
    return st["median"] if st else None


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Where each target of issue 5 stands against this run."""
    mechs = results["mechanisms"]
    out: dict[str, Any] = {}
    # 1. latency: our fastest GPU hand-off <= 0.5 x torch-ipc at every size
    lat: dict[str, Any] = {"target": "our fastest hand-off (producer starts -> consumer has read) <= 0.5 x "
                                     "torch-ipc's, at every size", "per_size": []}
    torch = mechs.get("torch-ipc", {})
    if torch.get("status") != "ok":
        lat["met"] = None
        lat["note"] = f"not evaluated: torch-ipc {torch.get('status', 'not run')}"
    else:
        tcells = {c["size"]: c for c in torch["cells"]}
        met = True
        for size in results["config"]["sizes"]:
            t = _median(tcells[size]) if size in tcells else None
            best = None
            for name in GPU_HANDOFF_OURS:
                m = mechs.get(name, {})
                for c in m.get("cells", []):
                    v = _median(c)
                    if c["size"] == size and v is not None and (best is None or v < best[1]):
                        best = (name, v)
            if t is None or best is None:
                lat["per_size"].append({"size": size, "label": size_label(size), "ratio": None})
                met = False
                continue
            r = best[1] / t
            met = met and r <= 0.5
            lat["per_size"].append({"size": size, "label": size_label(size), "ours": best[0],
                                    "ours_us": best[1], "torch_us": t, "ratio": round(r, 4)})
        lat["met"] = met
    out["latency"] = lat
    # 2. bandwidth through the import >= 0.95 x native
    bws = [b for b in results.get("bandwidth", {}).get("sizes", []) if _ratio(b.get("import"), b.get("native"))]
    bw: dict[str, Any] = {"target": "read kernel over the import >= 0.95 x the same kernel over native memory"}
    if bws:
        big = max(bws, key=lambda b: b["size"])
        bw["at_largest_size"] = {"size": big["size"], "label": size_label(big["size"]),
                                 "ratio": round(_ratio(big["import"], big["native"]) or 0, 4)}
        bw["min_ratio_from_1MiB"] = min((round(_ratio(b["import"], b["native"]) or 0, 4) for b in bws
                                         if b["size"] >= MiB), default=None)
        bw["met"] = bw["at_largest_size"]["ratio"] >= 0.95
    else:
        bw["met"] = None
        bw["note"] = "not measured"
    out["bandwidth"] = bw
    # 3. Python overhead <= 10 %
    ov = results.get("python_overhead") or {}
    cyc = ov.get("posix_fd_cycle")
    po: dict[str, Any] = {"target": "library at most 10% slower than the same driver calls in a tight loop "
                                    "(POSIX-fd export + import + release)"}
    if cyc:
        po["overhead"] = round(cyc["overhead"], 4)
        po["met"] = cyc["overhead"] <= 0.10
    else:
        po["met"] = None
        po["note"] = "not measured"
    out["python_overhead"] = po
    return out


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("MET" if met else "NOT MET")


def print_table(results: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    cfg = results["config"]
    env = results["environment"]
    p, c = cfg["devices"]
    gpu = {g["ordinal"]: g["name"] for g in env.get("gpus", [])}
    where = (f"producer GPU {p} ({gpu.get(p, '?')}), consumer GPU {c} ({gpu.get(c, '?')})"
             if env.get("gpus") else "no CUDA GPU")
    w = file.write
    w(f"dmabuf-interop bench: {where}; {cfg['reps']} reps after {cfg['warmup']} warm-ups; "
      f"median/p90 in microseconds\n\n")
    cols = ("export", "transport", "import_map", "first_access", "total")
    heads = ("export", "transport", "import+map", "1st access", "total")
    w(f"{'mechanism':<16}{'size':>8}  " + "".join(f"{h:>15}" for h in heads) + "\n")
    for name, m in results["mechanisms"].items():
        if m["status"] != "ok" and not m.get("cells"):
            w(f"{name:<16}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
            continue
        for cell in m["cells"]:
            row = f"{name:<16}{cell['label']:>8}  "
            for col in cols:
                st = cell["phases_us"].get(col)
                if st is None and col in ("import_map", "first_access"):
                    row += f"{'unsupported' if 'unsupported' in cell.get('import', '') else '-':>15}"
                elif st is None and col == "total":
                    et = cell["phases_us"]["export_transport"]
                    row += f"{'(' + _fmt(et['median']) + '/' + _fmt(et['p90']) + ')':>15}"
                else:
                    row += f"{_fmt(st['median']) + '/' + _fmt(st['p90']):>15}" if st else f"{'-':>15}"
            w(row.rstrip() + "\n")
        if m["status"] != "ok":
            w(f"{name:<16}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
        notes = sorted({c["import"] for c in m["cells"] if c.get("import") and c["import"] != "ok"})
        for note in notes:
            w(f"{'':<16}{'':>8}  import {note}; total in parentheses is export+transport only\n")
    bw = results.get("bandwidth") or {}
    if bw.get("sizes"):
        first = bw["sizes"][0]
        d, x = first["device"], first.get("peer_device")
        w(f"\nread kernel bandwidth, GB/s (median of {max(3, cfg['reps'])}):\n")
        head = f"{'size':>8}  {'import GPU' + str(d):>14}{'native GPU' + str(d):>14}{'ratio':>8}"
        if x is not None:
            head += f"{'GPU' + str(x) + ' import':>16}{'cuMemcpyPeer':>14}{'ratio':>8}"
            w(f"(GPU{x} import: a kernel on GPU{x} reads GPU{d}'s memory through the import; cuMemcpyPeer: "
              f"GPU{d} -> GPU{x}, peer access enabled, best source)\n")
        w(head + "\n")
        for b in bw["sizes"]:
            r = _ratio(b.get("import"), b.get("native"))
            line = (f"{size_label(b['size']):>8}  {b['import']['gbps']:>14.1f}{b['native']['gbps']:>14.1f}"
                    f"{r:>8.3f}")
            if b.get("cross_import") and b.get("memcpy_peer"):
                line += (f"{b['cross_import']['gbps']:>16.1f}{b['memcpy_peer']['gbps']:>14.1f}"
                         f"{_ratio(b['cross_import'], b['memcpy_peer']):>8.3f}")
            w(line + ("" if b.get("verified", True) else "  (pattern NOT verified)") + "\n")
    elif bw.get("status") and bw["status"] != "ok":
        w(f"\nbandwidth: {bw['status']}: {bw.get('reason') or ''}\n")
    ov = results.get("python_overhead") or {}
    if ov.get("posix_fd_cycle"):
        w(f"\nPython overhead (median of {ov['iterations']}, {size_label(ov['bytes'])}):\n")
        for key, what in (("posix_fd_cycle", "POSIX-fd export+import+release"), ("dmabuf_export", "dma-buf export+close")):
            o = ov.get(key) or {}
            if "overhead" in o:
                w(f"  {what}: library {_fmt(o['library_median_us'])} us, same driver calls in a loop "
                  f"{_fmt(o['raw_median_us'])} us: {o['overhead'] * 100:+.1f}% "
                  f"({sum(o['library_driver_calls'].values())} checked driver calls vs {o['raw_driver_calls']})\n")
                pw = o.get("pairwise_overhead")
                if pw:
                    w(f"    per-iteration pairs: p10 {pw['p10'] * 100:+.1f}%, median {pw['median'] * 100:+.1f}%, "
                      f"p90 {pw['p90'] * 100:+.1f}%\n")
                sp, sr = o.get("library_split_us"), o.get("raw_split_us")
                if sp:
                    w(f"    library, instrumented: checked driver calls {_fmt(sp['driver_calls'])} us, set_current "
                      f"{_fmt(sp['set_current'])} us, close(fd) {_fmt(sp.get('fd_close'))} us, "
                      f"other Python {_fmt(sp['python'])} us\n")
                if sr:
                    w(f"    loop, instrumented: close(fd) {_fmt(sr['fd_close'])} us, "
                      f"driver calls + loop {_fmt(sr['python'])} us\n")
            elif o:
                w(f"  {what}: {o.get('status')}\n")
    t = results["targets"]
    w("\ntargets:\n")
    lat = t["latency"]
    detail = ", ".join(f"{x['label']} {x['ratio']:.2f}x ({x['ours']})" for x in lat.get("per_size", [])
                       if x.get("ratio") is not None) or lat.get("note", "")
    w(f"  latency <= 0.5 x torch-ipc at every size: {_verdict(lat['met'])}  {detail}\n")
    b = t["bandwidth"]
    detail = (f"{b['at_largest_size']['ratio']:.3f} at {b['at_largest_size']['label']}"
              + (f" (lowest from 1 MiB up: {b['min_ratio_from_1MiB']:.3f})"
                 if b.get("min_ratio_from_1MiB") is not None else "")
              if "at_largest_size" in b else b.get("note", ""))
    w(f"  bandwidth through the import >= 0.95 x native: {_verdict(b['met'])}  {detail}\n")
    po = t["python_overhead"]
    detail = f"{po['overhead'] * 100:+.1f}%" if "overhead" in po else po.get("note", "")
    w(f"  Python overhead <= 10%: {_verdict(po['met'])}  {detail}\n")


def plot(results: dict[str, Any], path: str) -> str | None:
    """Write the log-log plot; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dmabuf-interop[plot]')"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, m in results["mechanisms"].items():
        pts = [(c["size"], _median(c)) for c in m.get("cells", []) if _median(c) is not None]
        label, style = name, "-"
        if not pts:
            pts = [(c["size"], _median(c, "export_transport")) for c in m.get("cells", [])]
            label, style = f"{name} (export+transport only: import unsupported)", "--"
        if not pts:
            continue
        kind = MECHANISMS[name][0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o" if kind == "ours" else "s",
                label=f"{label} [{kind}]")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("median hand-off latency (µs)")
    gpus = results["environment"].get("gpus") or []
    ax.set_title("Producer starts sharing -> consumer has read 4 bytes"
                 + (f" ({gpus[0]['name']})" if gpus else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --- entry point -------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed ``bench`` options; returns the exit status."""
    if getattr(args, "workload", None):
        return __import__(f"{__package__}.weight_sync", fromlist=["_"]).main(args)
    sizes: list[int] = args.sizes
    names: list[str] = args.mechanisms
    producer, consumer = args.devices
    env = environment()
    cuda_ok = env["cuda"]["available"]
    ndev = len(env["gpus"])
    needs_cuda = any(n not in CUDA_FREE for n in names)
    if cuda_ok and needs_cuda and (producer >= ndev or consumer >= ndev):
        print(f"dmabuf-interop: error: --devices {producer},{consumer} out of range: this machine has "
              f"{ndev} CUDA device(s)", file=sys.stderr)
        return 2
    cfg = {"sizes": sizes, "reps": args.reps, "warmup": args.warmup, "devices": [producer, consumer],
           "timeout": args.timeout}
    results: dict[str, Any] = {
        "schema": JSON_SCHEMA,
        "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
        "argv": list(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": env,
        "config": {**cfg, "mechanisms": names,
                   "size_labels": [size_label(s) for s in sizes]},
        "mechanisms": {},
        "plot": None,
    }
    _say(f"{len(names)} mechanism(s), sizes {','.join(size_label(s) for s in sizes)}, {args.reps} reps after "
         f"{args.warmup} warm-ups" + (f", producer GPU {producer}, consumer GPU {consumer}" if cuda_ok else ""))
    failed = False
    for i, name in enumerate(names, 1):
        kind, module, what = MECHANISMS[name]
        entry: dict[str, Any] = {"kind": kind, "description": what, "cells": []}
        if not _installed(module):
            entry.update(status="not installed", reason=f"{module} is not installed")
            _say(f"[{i}/{len(names)}] {name}: not installed ({module})")
        elif name not in CUDA_FREE and not cuda_ok:
            entry.update(status="skipped", reason=env["cuda"]["reason"])
            _say(f"[{i}/{len(names)}] {name}: skipped: {env['cuda']['reason']}")
        else:
            _say(f"[{i}/{len(names)}] {name}: starting producer and consumer")
            t = time.monotonic()
            res = run_pair(name, cfg)
            entry.update(status=res["status"], reason=res["reason"], cells=res["cells"], versions=res["versions"],
                         seconds=round(time.monotonic() - t, 1))
            if name not in CUDA_FREE:
                entry["devices"] = {"producer": producer, "consumer": consumer}
            imports = sorted({c["import"] for c in res["cells"] if "import" in c})
            if imports:
                entry["import"] = imports[-1] if len(imports) == 1 else "; ".join(imports)
            failed = failed or res["status"] == "error"
        results["mechanisms"][name] = entry
    if cuda_ok and ("posix-fd" in names or "posix-fd-cached" in names):
        _say("bandwidth and Python overhead: starting producer and consumer")
        res = run_pair("_bandwidth", cfg)
        results["bandwidth"] = {"status": res["status"], "reason": res["reason"], "sizes": res["bandwidth"],
                                "kernel": "read_all: grid-stride 16-byte loads, XOR-reduced, "
                                          "timed with CUDA events; GB/s = 1e9 bytes/s"}
        results["python_overhead"] = res["overhead"]
        failed = failed or res["status"] == "error"
    else:
        why = "no CUDA driver" if not cuda_ok else "measured with posix-fd or posix-fd-cached in --mechanisms"
        results["bandwidth"] = {"status": "skipped", "reason": why, "sizes": []}
        results["python_overhead"] = None
    results["targets"] = targets(results)
    print_table(results)
    if args.plot:
        why = plot(results, args.plot)
        results["plot"] = {"path": None, "skipped": why} if why else {"path": args.plot}
        _say(f"plot skipped: {why}" if why else f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
            fh.write("\n")
        _say(f"wrote {args.json}")
    return 1 if failed else 0
