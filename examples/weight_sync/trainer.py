"""Weight sync, trainer side: parameters live in a shared pool; each step sends the whole state dict at once.

Start it and ``engine.py`` in two terminals with the same address, either first (the engine
waits up to 60 s for the trainer to listen):

    python examples/weight_sync/trainer.py --address /tmp/weights.sock            # GPU 0, torch
    python examples/weight_sync/trainer.py --address /tmp/weights.sock --host     # host memory, NumPy

Protocol: the engine holds version k until it gives it back (the lease completes);
only then does the trainer write version k+1 into the same memory and send it.
"""

from __future__ import annotations

import argparse

from dmabuf_interop.channel import SharedPool, listen

#: A toy model: (name, shape); bf16 on the GPU, uint16 bit patterns on the host.
SHAPES = [("embed.weight", (1024, 256)), ("layers.0.mlp.weight", (768, 256)),
          ("layers.0.norm.weight", (256,)), ("lm_head.weight", (1024, 256))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="/tmp/weights.sock", help="socket path, or @name (abstract)")
    ap.add_argument("--host", action="store_true", help="host pool and NumPy instead of a GPU and torch")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal of the trainer (default 0)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    with SharedPool(None if args.host else args.device, chunk_bytes=16 << 20, max_bytes=64 << 20) as pool, \
            listen(args.address, pool=pool) as listener:
        if args.host:
            state = {name: pool.empty(shape, "uint16") for name, shape in SHAPES}
        else:
            import torch

            # A pool block seen by torch: the parameters ARE the shared memory (no copy on send).
            state = {name: torch.from_dlpack(pool.empty(shape, "int16")).view(torch.bfloat16)
                     for name, shape in SHAPES}
        for p in state.values():
            p.fill(0) if args.host else p.zero_()
        print(f"trainer: waiting for an engine on {args.address}", flush=True)
        with listener.accept(timeout=300) as ch:
            lease = None
            for version in range(1, args.steps + 1):
                if lease is not None:
                    lease.wait(timeout=300)  # the engine gave version-1 back
                for p in state.values():  # "training": every element becomes `version`
                    p.fill(version) if args.host else p.fill_(version)
                # ONE message for the whole state dict; on a GPU an IPC event orders the engine after the fills.
                lease = ch.send_many(state, meta={"version": version})
                print(f"trainer: sent version {version}", flush=True)
            lease.wait(timeout=300)
    print("trainer: done", flush=True)


if __name__ == "__main__":
    import sys

    from dmabuf_interop.errors import DmaBufError, NoDriverError

    try:
        main()
    except (DmaBufError, ImportError) as exc:  # a peer that went, no listener yet, torch missing without --host
        hint = ""
        if isinstance(exc, (NoDriverError, ImportError)) and "--host" not in sys.argv:
            hint = " (without a GPU and torch, run with --host: host memory and NumPy)"
        raise SystemExit(f"trainer: {type(exc).__name__}: {exc}{hint}") from None
