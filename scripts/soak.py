#!/usr/bin/env python3
"""Soak: N cycles of export, send, import, verify, close between two processes.

    PYTHONPATH=src python3 scripts/soak.py [--mechanism posix-fd|dmabuf|memfd ...]
        [--cycles 10000] [--size 16K] [--device 0] [--consumer-device D]
        [--memory device|host] [--timeout 60] [--json FILE]

For each mechanism this process (which never touches CUDA) forks a producer
and a consumer joined by an AF_UNIX socketpair. Each cycle the producer
exports a fresh buffer, writes the pattern ``base + i`` with a base that
changes every cycle, and sends the fd and its metadata
(:meth:`ExportedBuffer.send`, which synchronises first); the consumer imports,
verifies, closes its mapping and its fd, and answers with its mismatch count;
then the producer closes its buffer. ``dmabuf`` is "export and send": where
the driver cannot import a dma-buf (``CUDA_ERROR_NOT_SUPPORTED``, as on H200
with driver 580) the consumer still tries every cycle (so the failing path is
soaked too), and verifies the fd from user space (a dma-buf of the right size
per ``/proc/self/fdinfo``).

Reported per mechanism: cost per cycle (and per phase), open fds of both
processes at the start and at the end (``/proc/self/fd``), and free GPU memory
(``cuMemGetInfo``) at the start and at the end. The start is taken after
``--warmup`` cycles, so the driver's own lazily opened fds and pools are
already there. Exit status 0 when every mechanism ended with the fds and GPU
memory it started with (within ``--mem-tolerance``, default 2 MiB, one VMM
granule) and no mismatch or error, 1 otherwise; a mechanism whose export is
not supported at all is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dmabuf_interop.cli._units import word_size_argument  # noqa: E402
from dmabuf_interop.errors import DmaBufError, NotSupportedError  # noqa: E402
from dmabuf_interop.fd import OwnedFd, open_fds  # noqa: E402
from dmabuf_interop.fdpass import recv_message, send_message  # noqa: E402
from dmabuf_interop.procs import wait_child  # noqa: E402

MECHANISMS = ("posix-fd", "dmabuf", "memfd")


def _base(i: int) -> int:
    """The pattern base of cycle ``i``: different every cycle, so a stale buffer shows."""
    return 0x1000 + (i * 7919) % (1 << 24)


# --- per-mechanism steps -----------------------------------------------------------------

class _Steps:
    def __init__(self, mechanism: str, memory: str) -> None:
        self.mechanism = mechanism
        self.memory = memory
        self.cuda = mechanism != "memfd"

    def setup(self, device: int) -> None:
        if self.cuda:
            from dmabuf_interop import _driver as driver
            from dmabuf_interop.kernels import _kernels

            driver.set_current(device)
            _kernels(device)  # compile or load once, outside the timed cycles

    def export(self, size: int, device: int) -> Any:
        if self.mechanism == "posix-fd":
            from dmabuf_interop.mechanisms.posix_fd import export_posix_fd

            return export_posix_fd(size, device)
        if self.mechanism == "dmabuf":
            from dmabuf_interop.mechanisms.dmabuf import export_device, export_host

            return (export_device if self.memory == "device" else export_host)(size, device)
        from dmabuf_interop.mechanisms.memfd import export_memfd

        return export_memfd(size)

    def write(self, exp: Any, base: int) -> None:
        if self.cuda:
            from dmabuf_interop.kernels import write_pattern

            write_pattern(exp.ptr, exp.size, exp.device, base=base, sync=False)  # send() synchronises
        else:
            from dmabuf_interop.mechanisms.memfd import write_pattern_host

            write_pattern_host(exp, base)

    def import_(self, fd: int, meta: dict[str, Any], device: int) -> Any:
        from dmabuf_interop import import_shared

        return import_shared(fd, meta, device)  # validates the descriptor, dispatches on its mechanism

    def verify(self, imp: Any, base: int) -> int:
        if self.cuda:
            from dmabuf_interop.kernels import count_mismatches

            return count_mismatches(imp.ptr, imp.size, imp.device, base=base)
        from dmabuf_interop.mechanisms.memfd import count_mismatches_host

        return count_mismatches_host(imp, base)

    def free_memory(self) -> int | None:
        if not self.cuda:
            return None
        from dmabuf_interop import _driver as driver

        return driver.mem_get_info()[0]


# --- the two processes ------------------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str, timed: bool) -> None:
        now = time.perf_counter()
        if timed:
            self.sums[name] = self.sums.get(name, 0.0) + (now - self.t)
        self.t = now


def _producer(sock: socket.socket, steps: _Steps, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": [], "mismatches": 0}
    try:
        steps.setup(a.device)
    except NotSupportedError as exc:  # no driver, or no such capability
        out["skipped"] = str(exc)
        try:
            send_message(sock, {"stop": True, "reason": str(exc)})
        except DmaBufError:
            pass
        return out
    clock = _Clock()
    t0 = None
    done = 0
    for i in range(a.warmup + a.cycles):
        timed = i >= a.warmup
        if i == a.warmup:
            out["fds_start"] = len(open_fds())
            out["free_start"] = steps.free_memory()
            t0 = time.perf_counter()
            clock.t = t0
        try:
            exp = steps.export(a.size, a.device)
        except NotSupportedError as exc:
            out["skipped"] = str(exc)
            send_message(sock, {"stop": True, "reason": str(exc)})
            return out
        try:
            clock.lap("export", timed)
            steps.write(exp, _base(i))
            clock.lap("write", timed)
            exp.send(sock)
            reply, _ = recv_message(sock, a.timeout, max_fds=0)
            clock.lap("send_to_reply", timed)
        finally:
            exp.close()
        clock.lap("close", timed)
        out["mismatches"] += int(reply.get("mismatches", 0))
        if reply.get("error"):
            out["errors"].append(reply["error"])
            if len(out["errors"]) >= 10:
                break
        done += 1
    t1 = time.perf_counter()
    send_message(sock, {"stop": True})
    recv_message(sock, a.timeout, max_fds=0)  # the consumer has measured its end
    out["fds_end"] = len(open_fds())
    out["free_end"] = steps.free_memory()
    out["cycles"] = max(0, done - a.warmup)
    out["seconds"] = (t1 - t0) if t0 is not None else 0.0
    out["phase_us"] = {k: v / max(1, out["cycles"]) * 1e6 for k, v in clock.sums.items()}
    return out


def _consumer(sock: socket.socket, steps: _Steps, a: argparse.Namespace) -> dict[str, Any]:
    from dmabuf_interop.linux_dmabuf import dmabuf_info, is_dmabuf

    out: dict[str, Any] = {"imports": 0, "import_refusals": 0, "import_refusal": None}
    try:
        steps.setup(a.consumer_device)
    except NotSupportedError as exc:
        out["skipped"] = str(exc)
        return out
    clock = _Clock()
    i = 0
    while True:
        if i == a.warmup:
            out["fds_start"] = len(open_fds())
        timed = i >= a.warmup
        clock.t = time.perf_counter()
        msg, fds = recv_message(sock, a.timeout, max_fds=1)
        if msg.get("stop"):
            for fd in fds:
                os.close(fd)
            out["fds_end"] = len(open_fds())
            send_message(sock, {"ok": True})
            return out
        clock.lap("wait", timed)
        reply: dict[str, Any] = {"mismatches": 0}
        with OwnedFd(fds[0]) as fd:
            try:
                if steps.mechanism == "dmabuf" and (not is_dmabuf(fd.fd) or
                                                    dmabuf_info(fd.fd).size != int(msg["export_size"])):
                    raise DmaBufError(f"received fd is not a dma-buf of {msg['export_size']} bytes")
                try:
                    imp = steps.import_(fd.fd, msg, a.consumer_device)
                except NotSupportedError as exc:
                    if steps.mechanism != "dmabuf":
                        raise
                    out["import_refusals"] += 1
                    out["import_refusal"] = str(exc)
                    imp = None
                clock.lap("import", timed)
                if imp is not None:
                    with imp:
                        out["imports"] += 1
                        reply["mismatches"] = steps.verify(imp, _base(i))
                        clock.lap("verify", timed)
            except DmaBufError as exc:
                reply["error"] = f"cycle {i}: {exc}"
        clock.lap("close", timed)
        send_message(sock, reply)
        i += 1


def _fork(role: str, data: socket.socket, report: socket.socket, others: list[socket.socket],
          steps: _Steps, a: argparse.Namespace) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        for s in others:
            s.close()
        fn = _producer if role == "producer" else _consumer
        try:
            result = fn(data, steps, a)
            status = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised into it
            result = {"crash": f"{type(exc).__name__}: {exc}"}
        send_message(report, result)
    finally:
        os._exit(status)


def soak(mechanism: str, a: argparse.Namespace) -> dict[str, Any]:
    steps = _Steps(mechanism, a.memory)
    p_data, c_data = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    p_rep, p_rep_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c_rep, c_rep_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    everything = [p_data, c_data, p_rep, p_rep_child, c_rep, c_rep_child]
    cpid = _fork("consumer", c_data, c_rep_child, [s for s in everything if s not in (c_data, c_rep_child)],
                 steps, a)
    ppid = _fork("producer", p_data, p_rep_child, [s for s in everything if s not in (p_data, p_rep_child)],
                 steps, a)
    for s in (p_data, c_data, p_rep_child, c_rep_child):
        s.close()
    result: dict[str, Any] = {"mechanism": mechanism, "size": a.size}
    try:
        for role, rep in (("producer", p_rep), ("consumer", c_rep)):
            try:
                result[role] = recv_message(rep, a.max_seconds, max_fds=0)[0]
            except DmaBufError as exc:
                result[role] = {"crash": f"no report: {exc}"}
    finally:
        p_rep.close()
        c_rep.close()
        result["producer_exit"] = wait_child(ppid, a.timeout).describe()
        result["consumer_exit"] = wait_child(cpid, a.timeout).describe()
    return _judge(result, a)


def _judge(r: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    p, c = r.get("producer", {}), r.get("consumer", {})
    problems = []
    if "skipped" in p or "skipped" in c:
        p.setdefault("skipped", c.get("skipped"))
        r["status"] = "skipped"
        r["problems"] = []
        return r
    for role, d in (("producer", p), ("consumer", c)):
        if "crash" in d:
            problems.append(f"{role} crashed: {d['crash']}")
    if not problems:
        if p["cycles"] != a.cycles:
            problems.append(f"ran {p['cycles']} of {a.cycles} cycles")
        if p["mismatches"]:
            problems.append(f"{p['mismatches']} mismatches")
        if p["errors"]:
            problems.append(f"{len(p['errors'])} errors, first: {p['errors'][0]}")
        for role, d in (("producer", p), ("consumer", c)):
            if d["fds_start"] != d["fds_end"]:
                problems.append(f"{role} open fds {d['fds_start']} -> {d['fds_end']}")
        if p.get("free_start") is not None:
            delta = p["free_end"] - p["free_start"]
            r["free_delta"] = delta
            if abs(delta) > a.mem_tolerance:
                problems.append(f"free GPU memory changed by {delta} bytes")
        r["us_per_cycle"] = p["seconds"] / max(1, p["cycles"]) * 1e6
    r["status"] = "fail" if problems else "pass"
    r["problems"] = problems
    return r


def _print(r: dict[str, Any], a: argparse.Namespace) -> None:
    p, c = r.get("producer", {}), r.get("consumer", {})
    print(f"{r['mechanism']}: {a.cycles} cycles x {r['size']} bytes, producer device {a.device}, "
          f"consumer device {a.consumer_device}" if r["mechanism"] != "memfd" else
          f"{r['mechanism']}: {a.cycles} cycles x {r['size']} bytes (host shared memory)")
    if r["status"] == "skipped":
        print(f"  skipped: {p['skipped']}")
        return
    if "us_per_cycle" in r:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in p["phase_us"].items())
        print(f"  cost per cycle: {r['us_per_cycle']:.1f} us ({phases} us in the producer)")
        print(f"  open fds: producer {p['fds_start']} -> {p['fds_end']}, consumer {c['fds_start']} -> {c['fds_end']}")
        if p.get("free_start") is not None:
            print(f"  free GPU memory (cuMemGetInfo): {p['free_start']} -> {p['free_end']} bytes "
                  f"(delta {r['free_delta']:+d})")
        print(f"  mismatches {p['mismatches']}, errors {len(p['errors'])}, imports {c.get('imports')}")
        if c.get("import_refusals"):
            print(f"  import refused {c['import_refusals']} times: {c['import_refusal']}")
    print(f"  {r['status'].upper()}" + (": " + "; ".join(r["problems"]) if r["problems"] else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mechanism", action="append", choices=MECHANISMS,
                    help="repeatable; default: all three")
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=3, help="untimed cycles before the start is measured")
    ap.add_argument("--size", type=word_size_argument, default=16384,
                    help="bytes per buffer, a positive multiple of 4 (4096, 0x1000, 16K, 1M)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--consumer-device", type=int, default=None, help="default: --device")
    ap.add_argument("--memory", choices=("device", "host"), default="device", help="dmabuf allocator")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="seconds a whole mechanism may take")
    ap.add_argument("--mem-tolerance", type=int, default=2 << 20, help="bytes of cuMemGetInfo drift allowed")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    if a.consumer_device is None:
        a.consumer_device = a.device
    if a.cycles < 1:
        ap.error("--cycles must be >= 1")
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    results = []
    for mech in a.mechanism or MECHANISMS:
        r = soak(mech, a)
        _print(r, a)
        results.append(r)
    ok = all(r["status"] != "fail" for r in results)
    if a.json:
        Path(a.json).write_text(json.dumps({"ok": ok, "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
