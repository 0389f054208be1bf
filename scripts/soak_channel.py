#!/usr/bin/env python3
"""Channel soak: one producer serving many consumers that connect, receive and die by SIGKILL at random.

    PYTHONPATH=src python3 scripts/soak_channel.py [--seconds 600] [--consumers 50] [--device N]
        [--warmup 2] [--lifetime 0.1,4] [--size 16384] [--seed S] [--json FILE]

This process is the producer: a :class:`SharedPool` (host memfds, or with ``--device N`` CUDA VMM chunks on
GPU N), one :func:`listen` address, an accept loop, and per accepted channel a thread that lends arrays
(``pool.empty`` blocks, each filled with a pattern that its ``meta`` names) and keeps at most four leases out.
The consumers are forked by a zygote process, started before this process makes a thread or touches CUDA, so
a consumer costs one ``fork``: each ``connect(..., wait=True)``, receives, checks every array against its
pattern, holds up to three at once, and is killed with ``SIGKILL`` when its random lifetime (``--lifetime``,
seconds) is up; another takes its place, so ``--consumers`` are alive throughout. Some die before they
connect, some in the handshake, most while holding leases.

After ``--warmup`` seconds of the same traffic (the driver's and the pool's lazily made fds and threads are
there by then), every consumer is killed and the producer settles; then the start is measured: open fds
(``/proc/self/fd``, by kind), threads (``threading.enumerate`` and ``/proc/self/task``) and the pool (bytes in
use, and chunks after ``SharedPool.trim``). The same is measured at the end, after the last consumer is
killed and the serving threads have ended. Reported as JSON (one object on standard output, and in
``--json``): the counts of consumers, channels, arrays, errors by kind, and start and end. Exit status 0
when fds, threads and the pool are back to their start and no consumer saw a wrong array or an error (a
consumer that is killed is not counted); 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402

from dmabuf_interop.channel import SharedPool, connect, listen  # noqa: E402
from dmabuf_interop.errors import DmaBufError, PeerClosedError, WaitTimeoutError  # noqa: E402

#: Exit codes of a consumer that was not killed: 0 the producer ended the channel, 2 a wrong array, 3 an error.
WRONG, FAILED = 2, 3


def _pattern(seq: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7 + seq).astype(np.int32)


# --- consumers (in the zygote's children) ----------------------------------------------------------------


def _consume(address: str, device: int | None) -> int:
    try:
        ch = connect(address, timeout=30, wait=True)
    except DmaBufError as exc:
        print(f"consumer {os.getpid()}: connect: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return FAILED
    held: collections.deque[Any] = collections.deque()
    keep = random.Random(os.getpid()).randint(0, 3)
    torch = sys.modules.get("torch") if device is not None else None  # (the zygote imported it)
    try:
        while True:
            r = ch.recv(timeout=30)
            seq, n = r.meta["seq"], r.meta["n"]
            if r.device < 0:
                ok = np.array_equal(r.as_array(), _pattern(seq, n))
            elif torch is not None:
                ok = bool(torch.equal(r.as_tensor().cpu(), torch.from_numpy(_pattern(seq, n))))
            else:
                ok = True
            if not ok:
                print(f"consumer {os.getpid()}: array {seq} is wrong", file=sys.stderr, flush=True)
                return WRONG
            held.append(r)
            while len(held) > keep:
                held.popleft().release()
    except PeerClosedError:
        return 0
    except DmaBufError as exc:
        print(f"consumer {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return FAILED


def _zygote(cmd_r: int, out_w: int, address: str, device: int | None) -> None:
    """Fork consumers on request (``s``: answer the pid), kill one of them (``k PID``), or kill them all,
    reap them and write the counts (``q``). Only its own live children are ever signalled."""
    live: set[int] = set()
    stats: collections.Counter[str] = collections.Counter()
    buf = b""
    if device is not None:
        try:
            import torch  # noqa: F401 - imported once here (no CUDA call), not in every consumer
        except ImportError:
            pass

    def reap(block: bool = False) -> None:
        while live:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                live.clear()
                return
            if pid == 0:
                return
            live.discard(pid)
            if os.WIFSIGNALED(status):
                stats[f"killed by {signal.Signals(os.WTERMSIG(status)).name}"] += 1
            else:
                stats[f"exited {os.WEXITSTATUS(status)}"] += 1

    while True:
        ready, _, _ = select.select([cmd_r], [], [], 0.02)
        reap()
        if not ready:
            continue
        data = os.read(cmd_r, 4096)
        if not data:
            data = b"q\n"
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"s":
                pid = os.fork()
                if pid == 0:
                    os.close(cmd_r)
                    os.close(out_w)
                    code = FAILED
                    try:
                        code = _consume(address, device)
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                live.add(pid)
                stats["spawned"] += 1
                os.write(out_w, b"%d\n" % pid)
            elif line.startswith(b"k "):
                pid = int(line[2:])
                if pid in live:
                    os.kill(pid, signal.SIGKILL)
            elif line == b"q":
                for pid in list(live):
                    os.kill(pid, signal.SIGKILL)
                reap(block=True)
                os.write(out_w, (json.dumps(dict(stats)) + "\n").encode())
                os._exit(0)


class Zygote:
    def __init__(self, address: str, device: int | None) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._cmd_w)
            os.close(self._out_r)
            try:
                _zygote(cmd_r, out_w, address, device)
            finally:
                os._exit(1)
        os.close(cmd_r)
        os.close(out_w)
        self._out = os.fdopen(self._out_r, "rb")

    def spawn(self) -> int:
        os.write(self._cmd_w, b"s\n")
        return int(self._out.readline())

    def kill(self, pid: int) -> None:
        os.write(self._cmd_w, b"k %d\n" % pid)

    def finish(self) -> dict[str, int]:
        os.write(self._cmd_w, b"q\n")
        stats = json.loads(self._out.readline())
        os.waitpid(self.pid, 0)
        os.close(self._cmd_w)
        self._out.close()
        return stats


# --- the producer ---------------------------------------------------------------------------------------


class Producer:
    def __init__(self, pool: SharedPool, address: str, size: int, device: int | None) -> None:
        self.pool = pool
        self.listener = listen(address, pool=pool)
        self.n = size // 4
        self.device = device
        self.stop = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.seq = 0
        self.servers: list[threading.Thread] = []
        self.acceptor: threading.Thread | None = None
        self._torch: Any = None
        if device is not None:
            import torch

            self._torch = torch

    def _note(self, what: str, exc: BaseException | None = None) -> None:
        with self.lock:
            if exc is None:
                self.counts[what] += 1
            else:
                self.errors[f"{what}: {type(exc).__name__}: {str(exc)[:160]}"] += 1

    def start(self) -> None:
        self.stop.clear()
        self.acceptor = threading.Thread(target=self._accept_loop, name="soak-accept")
        self.acceptor.start()

    def halt(self) -> None:
        self.stop.set()
        if self.acceptor is not None:
            self.acceptor.join(30)
        for t in self.servers:
            t.join(30)
        self.servers = [t for t in self.servers if t.is_alive()]
        # Handshakes run ahead of accept(): consumers that completed theirs after the loop stopped wait in
        # the listener's queue. Take and close them, as a server that stops serving does.
        while True:
            try:
                ch = self.listener.accept(timeout=0.5)
            except DmaBufError:
                break
            ch.close()

    def _accept_loop(self) -> None:
        while not self.stop.is_set():
            try:
                ch = self.listener.accept(timeout=1.0)
            except WaitTimeoutError:
                continue  # an idle wait: handshakes run on in the listener, none is cut off by it
            except DmaBufError as exc:
                self._note("accept", exc)
                continue
            self._note("channels")
            t = threading.Thread(target=self._serve, args=(ch,), name="soak-serve")
            self.servers = [s for s in self.servers if s.is_alive()]
            self.servers.append(t)
            t.start()

    def _fill(self, seq: int) -> Any:
        a = self.pool.empty(self.n, "int32", timeout=5)
        if self.device is None:
            a[...] = _pattern(seq, self.n)
        else:
            torch = self._torch
            torch.from_dlpack(a).copy_(torch.from_numpy(_pattern(seq, self.n)))
            torch.cuda.synchronize(self.device)
        return a

    def _serve(self, ch: Any) -> None:
        leases: collections.deque[Any] = collections.deque()
        try:
            while not self.stop.is_set():
                with self.lock:
                    self.seq += 1
                    seq = self.seq
                a = self._fill(seq)
                leases.append(ch.send(a, meta={"seq": seq, "n": self.n}))
                del a
                self._note("arrays")
                while len(leases) > 4:
                    lease = leases.popleft()
                    lease.wait(timeout=10)
                    self._note(f"leases {lease.reason}")
                time.sleep(0.002)
        except PeerClosedError:
            self._note("channels ended by the peer")
        except DmaBufError as exc:
            self._note("serve", exc)
        finally:
            ch.close()
            for lease in leases:
                try:
                    lease.wait(timeout=10)
                    self._note(f"leases {lease.reason}")
                except DmaBufError as exc:
                    self._note("lease", exc)


# --- measuring ------------------------------------------------------------------------------------------


#: The soak's own fds (its pipes to the zygote), left out of what is compared.
HARNESS_FDS: set[int] = set()


def _fd_kinds() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        if int(name) in HARNESS_FDS:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the fd listdir used
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else target
        out[name] = kind
    return out


def _snapshot(pool: SharedPool) -> dict[str, Any]:
    gc.collect()
    fds = _fd_kinds()
    return {"fds": len(fds), "fd_kinds": dict(collections.Counter(fds.values())), "fd_list": sorted(map(int, fds)),
            "threads": sorted(t.name for t in threading.enumerate()), "tasks": len(os.listdir("/proc/self/task")),
            "pool_used_bytes": pool.used_bytes, "pool_capacity": pool.capacity}


def _settle(pool: SharedPool, start: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """Wait (at most ``seconds``) until the producer is quiet: no block in use and, for the end, the
    threads of the start (threads end and leases complete shortly after the last consumer dies);
    then retire the idle chunks (:meth:`SharedPool.trim`) and measure. ``used_before_trim`` and
    ``chunks_retired_by_trim`` say what the trim found."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        used = pool.used_bytes
        threads = sorted(t.name for t in threading.enumerate())
        if (used == 0 and (start is None or threads == start["threads"])) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    retired = pool.trim()
    snap = _snapshot(pool)
    if start is not None and snap["fd_list"] != start["fd_list"]:  # a last close in flight: one more look
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        snap = _snapshot(pool)
    snap["used_before_trim"] = used
    snap["chunks_retired_by_trim"] = retired
    return snap


def _run_phase(z: Zygote, p: Producer, seconds: float, consumers: int, life: tuple[float, float],
               rng: random.Random) -> None:
    live: dict[int, float] = {}
    end = time.monotonic() + seconds
    p.start()
    while time.monotonic() < end:
        now = time.monotonic()
        for pid, dies in list(live.items()):
            if dies <= now:
                z.kill(pid)
                del live[pid]
        while len(live) < consumers:
            live[z.spawn()] = time.monotonic() + rng.uniform(*life)
        time.sleep(0.02)
    for pid in live:
        z.kill(pid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--consumers", type=int, default=50)
    ap.add_argument("--device", type=int, default=None, help="a CUDA pool on this GPU (default: a host pool)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of traffic before the start is measured")
    ap.add_argument("--lifetime", default="0.1,4", help="a consumer lives a uniform random MIN,MAX seconds")
    ap.add_argument("--size", type=int, default=16384, help="bytes per array, a multiple of 4")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--settle", type=float, default=15.0, help="seconds the producer may take to become quiet")
    ap.add_argument("--json", help="also write the report to this file")
    a = ap.parse_args(argv)
    try:
        life = tuple(float(x) for x in a.lifetime.split(","))
    except ValueError:
        life = ()
    if len(life) != 2 or not 0 < life[0] <= life[1]:
        ap.error("--lifetime must be MIN,MAX seconds with 0 < MIN <= MAX")
    if a.consumers < 1 or a.seconds <= 0 or a.warmup < 0 or a.settle <= 0 or a.size <= 0 or a.size % 4:
        ap.error("--consumers must be at least 1, --seconds and --settle above 0, --warmup at least 0, and --size a "
                 "positive multiple of 4")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"--json {a.json}: no such folder")
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    random.seed(seed)
    tmp = tempfile.mkdtemp(prefix="soak-channel-")
    address = os.path.join(tmp, "producer.sock")
    z = Zygote(address, a.device)  # before any thread or CUDA call here
    HARNESS_FDS.update((z._cmd_w, z._out_r))
    pool = SharedPool(a.device, chunk_bytes=1 << 20, max_bytes=256 << 20)
    p = Producer(pool, address, a.size, a.device)
    t0 = time.monotonic()
    try:
        _run_phase(z, p, a.warmup, a.consumers, life, rng)
        time.sleep(0.5)
        p.halt()
        start = _settle(pool, None, a.settle)
        p.counts.clear()
        p.errors.clear()
        _run_phase(z, p, a.seconds, a.consumers, life, rng)
        stats = z.finish()
        p.halt()
        end = _settle(pool, start, a.settle)
    except KeyboardInterrupt:  # (Ctrl-C reaches the zygote and its consumers too: they end with it)
        p.stop.set()  # the accept loop and the serving threads end within a second or a lease's wait
        p.listener.close()
        shutil.rmtree(tmp, ignore_errors=True)
        print("soak_channel: interrupted", file=sys.stderr)
        return 130
    back = {
        "fds": end["fd_list"] == start["fd_list"] and end["fd_kinds"] == start["fd_kinds"],
        "threads": end["threads"] == start["threads"] and end["tasks"] == start["tasks"],
        "pool": end["used_before_trim"] == 0 and end["pool_used_bytes"] == 0 and end["pool_capacity"] == 0,
    }
    wrong = stats.get(f"exited {WRONG}", 0)
    failed = stats.get(f"exited {FAILED}", 0)
    report = {
        "seconds": a.seconds, "consumers": a.consumers, "device": a.device, "seed": seed, "lifetime": life,
        "wall_s": round(time.monotonic() - t0, 1), "consumer_exits": stats, "producer": dict(p.counts),
        "errors": dict(p.errors), "start": start, "end": end, "back_to_start": back,
        "passed": all(back.values()) and wrong == 0 and failed == 0,
    }
    for snap in (start, end):
        snap.pop("fd_list")
        snap["threads"] = dict(collections.Counter(snap["threads"]))
    p.listener.close()
    pool.close()
    try:
        os.rmdir(tmp)
    except OSError:
        pass
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
