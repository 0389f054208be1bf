"""Peer processes for the tcp:// (NIXL) channel tests, started as unrelated subprocesses.

    python -m tests.helpers.remote_peer producer ADDR N DEVICE   lend N mixed arrays, wait for every lease
    python -m tests.helpers.remote_peer consumer ADDR N DEVICE   receive N arrays, verify each against its sha256
    python -m tests.helpers.remote_peer producer-stream ADDR     lend arrays until killed
    python -m tests.helpers.remote_peer consumer-into ADDR N       recv_into the caller's arrays (the first of a wrong shape)
    python -m tests.helpers.remote_peer consumer-survive ADDR K  hold K arrays, read on until the producer goes
    python -m tests.helpers.remote_peer consumer-hold ADDR K     hold K arrays, then wait to be killed
    python -m tests.helpers.remote_peer producer-watch ADDR K    lend K arrays, report when the consumer's leases end

ADDR ``tcp://127.0.0.1:0`` makes a producer pick a port; it prints ``listening tcp://...`` first.
DEVICE is ``host`` or a CUDA ordinal (the pool's). The token comes from ``$DMABUF_INTEROP_TOKEN``.
Each mode prints one JSON line (``{"...": ...}``) as its result.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time

import numpy as np

from dmabuf_interop.channel import SharedPool, connect, listen

DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]


def make_array(i: int) -> np.ndarray:
    """Array ``i`` of a fixed sequence: mixed dtypes, 0 to 3 dimensions, up to ~256 KiB, some of them empty."""
    rng = np.random.default_rng(i)
    ndim = i % 4
    shape = tuple(int(x) for x in rng.integers(0 if i % 97 == 0 else 1, 48, size=ndim))
    dt = np.dtype(DTYPES[i % len(DTYPES)])
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _pool(device: str) -> SharedPool:
    return SharedPool(None if device == "host" else int(device), chunk_bytes=8 << 20, max_bytes=64 << 20)


def _to_device(a: np.ndarray, pool: SharedPool):
    """A copy of ``a`` in a block of ``pool`` (host: NumPy; device: cuMemcpy through the pool)."""
    if pool.is_host:
        out = pool.empty(a.shape, a.dtype)
        out[...] = a
        return out
    from dmabuf_interop import _driver as driver

    out = pool.empty(a.shape, a.dtype)
    if a.nbytes:
        src = np.ascontiguousarray(a)
        driver.set_current(pool.device)
        driver.memcpy_async(int(out.ptr), src.ctypes.data, a.nbytes, 0)
        driver.stream_synchronize(0)
    return out


def _as_numpy(r) -> np.ndarray:
    if r.device < 0:
        return r.as_array()
    from dmabuf_interop import _driver as driver

    d = r.descriptor
    out = np.empty(r.shape, dtype=d.dtype)  # C-contiguous, as every block read into
    if out.nbytes:
        driver.set_current(r.device)
        driver.memcpy_async(out.ctypes.data, int(r.as_array().ptr), out.nbytes, 0)
        driver.stream_synchronize(0)
    return out


def main() -> int:
    mode, addr = sys.argv[1], sys.argv[2]
    fds0 = open_fds()
    if mode in ("producer", "producer-stream", "producer-watch"):
        device = sys.argv[4] if mode == "producer" else "host"
        pool = _pool(device)
        listener = listen(addr, pool=pool)
        print(f"listening {listener.address}", flush=True)
        ch = listener.accept(60, raise_refused=True)  # (a wrong token ends the producer: a test looks for it)
        if mode == "producer":
            n = int(sys.argv[3])
            leases = []
            for i in range(n):
                a = make_array(i)
                leases.append(ch.send(_to_device(a, pool), meta={"i": i, "sha256": digest(a)}, timeout=60))
            for lease in leases:
                lease.wait(60)
            reasons = sorted({lease.reason for lease in leases})
            ch.close()
            registered = len(ch._nixl.agent.registered)
        elif mode == "producer-stream":
            i = 0
            while True:
                a = make_array(i)
                ch.send(a, meta={"i": i, "sha256": digest(a)}, timeout=60)
                i += 1
        else:
            k = int(sys.argv[3])
            leases = [ch.send(np.full(1000, i, dtype=np.int64)) for i in range(k)]
            print("sent", flush=True)
            for lease in leases:
                lease.wait(60)
            done_at = time.time()
            reasons = sorted({lease.reason for lease in leases})
            registered = len(ch._nixl.agent.registered)
            print(json.dumps({"done_at": done_at, "reasons": reasons, "registered": registered}), flush=True)
            ch.close()
            return 0
        listener.close()
        pool.close()
        del ch, listener, pool, leases
        gc.collect()
        print(json.dumps({"reasons": reasons, "registered": registered, "fds_leaked": open_fds() - fds0}),
              flush=True)
        return 0
    if mode == "consumer":
        n, device = int(sys.argv[3]), sys.argv[4]
        pool = _pool(device)
        ch = connect(addr, timeout=60, pool=pool)
        good = 0
        steady = 0
        for i in range(n):
            if i == min(10, n - 1):
                # after the first READs: CUDA's and UCX's own fds are open by now
                steady, chunks = open_fds(), len(pool._chunks)
            with ch.recv(60) as r:
                a = _as_numpy(r)
                want = make_array(r.meta["i"])
                good += bool(digest(a) == r.meta["sha256"] == digest(want) and a.dtype == want.dtype
                             and a.shape == want.shape)
        transport = dict(ch.transport)
        grew = open_fds() - steady - (len(pool._chunks) - chunks)  # a new pool chunk holds its exported fd
        ch.close()
        registered = len(ch._nixl.agent.registered)
        pool.close()
        del ch, pool, r, a
        gc.collect()
        print(json.dumps({"good": good, "n": n, "transport": transport, "registered": registered,
                          "fds_leaked": open_fds() - fds0, "fds_grew": grew}), flush=True)
        return 0
    if mode == "consumer-into":
        from dmabuf_interop.errors import InvalidArgumentError

        n = int(sys.argv[3])
        ch = connect(addr, timeout=60)
        good = refused = 0
        for i in range(n):
            want = make_array(i)
            out = np.empty(want.shape + (2,) if i == 0 else want.shape, want.dtype)
            try:
                meta = ch.recv_into(out, 60)
            except InvalidArgumentError:
                refused += 1
                continue
            good += meta == {"i": i, "sha256": digest(want)} and digest(out) == digest(want)
        ch.close()
        registered = len(ch._nixl.agent.registered)
        del ch
        gc.collect()
        print(json.dumps({"good": good, "refused": refused, "n": n, "registered": registered,
                          "fds_leaked": open_fds() - fds0}), flush=True)
        return 0
    if mode in ("consumer-survive", "consumer-hold"):
        k = int(sys.argv[3])
        ch = connect(addr, timeout=60)
        held = [ch.recv(60) for _ in range(k)]
        time.sleep(0.05)  # the releases of what was READ go out within RELEASE_DELAY (2 ms)
        print(f"held {k}", flush=True)
        if mode == "consumer-hold":
            time.sleep(600)
            return 0
        error = None
        extra = 0
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 60:
                with ch.recv(30) as r:
                    extra += digest(r.as_array()) == r.meta["sha256"]
        except Exception as exc:  # noqa: BLE001 - the test checks which error it was
            error = type(exc).__name__
        ok = sum(digest(r.as_array()) == r.meta["sha256"] for r in held)
        print(json.dumps({"held_ok": ok, "extra_ok": extra, "error": error, "seconds": time.monotonic() - t0}),
              flush=True)
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
