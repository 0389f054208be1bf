"""Channel producer: lends arrays from a shared pool to every consumer that connects.

    python examples/producer.py --address /tmp/dmabuf-interop.sock [--device N] [--count 5]

Run examples/consumer.py with the same address in another terminal. Host pool
(memfd) by default; ``--device N`` uses a CUDA VMM pool on GPU N.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dmabuf_interop.channel import SharedPool, listen
from dmabuf_interop.errors import DmaBufError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="/tmp/dmabuf-interop.sock")
    ap.add_argument("--device", type=int, default=None, help="CUDA ordinal (default: host pool)")
    ap.add_argument("--count", type=int, default=5, help="arrays per consumer")
    ap.add_argument("--consumers", type=int, default=1, help="consumers to serve before exiting")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    try:
        with SharedPool(args.device, chunk_bytes=1 << 21, max_bytes=64 << 20) as pool, \
                listen(args.address, pool=pool) as listener:
            print(f"producer: listening on {args.address}", flush=True)
            for _ in range(args.consumers):
                with listener.accept(args.timeout) as ch:
                    print(f"producer: consumer pid {ch.peer.pid} connected", flush=True)
                    leases = []
                    for i in range(args.count):
                        host = np.arange(1024, dtype=np.int32) + 1000 * i
                        if args.device is None:
                            arr = pool.empty(1024, "int32")  # zero-copy: write straight into the pool
                            arr[:] = host
                        else:
                            import torch

                            arr = torch.from_numpy(host).to(f"cuda:{args.device}")  # copied into the pool
                        leases.append(ch.send(arr, meta={"index": i}))
                    for lease in leases:
                        lease.wait(args.timeout)
                    gone = sum(lease.reason == "disconnected" for lease in leases)
                    print(f"producer: {args.count - gone} arrays released"
                          + (f", {gone} given back because the consumer left" if gone else ""), flush=True)
    except (DmaBufError, ImportError) as exc:  # ImportError: --device needs torch
        print(f"producer: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
