"""Peer processes for the channel tests, started as unrelated subprocesses.

    python peer.py consumer-verify ADDR N     receive N arrays, check each against its meta's sha256, print a summary
    python peer.py consumer-hold ADDR         receive one array, print its sum, then wait to be killed
    python peer.py producer-hold ADDR         lend one array (1024 int32 = i), then wait to be killed
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from dmabuf_interop.channel import SharedPool, connect, listen


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def main() -> int:
    mode, addr = sys.argv[1], sys.argv[2]
    if mode == "consumer-verify":
        n = int(sys.argv[3])
        good = 0
        shapes = []
        with connect(addr, timeout=30) as ch:
            for _ in range(n):
                with ch.recv(30) as r:
                    a = r.as_array()
                    ok = (digest(a) == r.meta["sha256"] and list(a.shape) == r.meta["shape"]
                          and a.dtype.name == r.meta["dtype"])
                    good += ok
                    shapes.append(list(a.shape))
        print(json.dumps({"good": good, "n": n, "shapes": shapes}), flush=True)
        return 0
    if mode == "consumer-hold":
        ch = connect(addr, timeout=30)
        r = ch.recv(30)
        print(f"held {int(r.as_array().sum())}", flush=True)
        time.sleep(600)
        return 0
    if mode == "producer-hold":
        pool = SharedPool(chunk_bytes=1 << 20, max_bytes=1 << 20)
        listener = listen(addr, pool=pool)
        print("listening", flush=True)
        ch = listener.accept(30)
        a = pool.empty(1024, "int32")
        a[:] = np.arange(1024, dtype=np.int32)
        ch.send(a)
        print("sent", flush=True)
        time.sleep(600)
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
