"""Channel consumer: connects to examples/producer.py and checks every array it receives.

    python examples/consumer.py --address /tmp/dmabuf-interop.sock [--count 5]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dmabuf_interop.channel import connect
from dmabuf_interop.errors import DmaBufError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="/tmp/dmabuf-interop.sock")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    try:
        with connect(args.address, timeout=args.timeout, wait=True) as ch:  # the producer may start later
            bad = 0
            for _ in range(args.count):
                with ch.recv(args.timeout) as r:
                    i = r.meta["index"]
                    got = r.as_tensor().cpu().numpy() if r.device >= 0 else r.as_array()
                    ok = np.array_equal(got, np.arange(1024, dtype=np.int32) + 1000 * i)
                    bad += not ok
                    print(f"consumer: array {i} {r.dtype}{list(r.shape)} {'ok' if ok else 'MISMATCH'}", flush=True)
    except DmaBufError as exc:
        print(f"consumer: {exc}", file=sys.stderr)
        return 1
    print("consumer: done" if not bad else f"consumer: {bad} mismatches", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
