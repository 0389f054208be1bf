"""Weight sync, engine side: receive each version of the state dict and load it through a weight-loading hook.

    python examples/weight_sync/engine.py --address /tmp/weights.sock             # GPU 0, torch
    python examples/weight_sync/engine.py --address /tmp/weights.sock --host      # host memory, NumPy

``load_weights`` has the shape of vLLM's and SGLang's hook: an iterable of
``(name, tensor)``. Here it copies into the engine's own parameters (the copy
variant); an engine that reads the trainer's tensors in place keeps the
``Received`` objects until it gives the version back instead.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterable


def load_weights(params: dict[str, Any], weights: Iterable[tuple[str, Any]], host: bool) -> None:
    """The engine's hook: copy each incoming tensor into the parameter of the same name."""
    for name, w in weights:
        if host:
            params[name][...] = w
        else:
            params[name].copy_(w, non_blocking=True)


def main() -> None:
    from dmabuf_interop.channel import as_tensors, connect, release_all

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="/tmp/weights.sock")
    ap.add_argument("--host", action="store_true", help="host memory and NumPy instead of a GPU and torch")
    ap.add_argument("--device", type=int, default=0, help="CUDA ordinal of the engine (default 0)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    stream = None
    params: dict[str, Any] = {}
    if not args.host:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("engine: torch sees no CUDA GPU here: run with --host (host memory, NumPy)")
        torch.cuda.set_device(args.device)
        stream = torch.cuda.Stream()
    # wait=True: the trainer may start later
    with connect(args.address, timeout=60, device=None if args.host else args.device, wait=True) as ch:
        for _ in range(args.steps):
            batch = ch.recv_many(timeout=300, stream=stream)  # the stream waits for the trainer's writes
            version = next(iter(batch.values())).meta["version"]
            if args.host:
                import numpy as np

                weights = [(n, r.as_array()) for n, r in batch.items()]
                if not params:
                    params = {n: np.empty_like(w) for n, w in weights}
                load_weights(params, weights, host=True)
                ok = all((p == version).all() for p in params.values())
            else:
                weights = list(as_tensors(batch).items())  # torch tensors over the trainer's blocks
                if not params:
                    params = {n: torch.empty_like(w) for n, w in weights}
                with torch.cuda.stream(stream):
                    load_weights(params, weights, host=False)
                    ok = all(bool((p == version).all()) for p in params.values())
            del weights
            release_all(batch.values())  # gives version back: the trainer may now write the next one
            print(f"engine: loaded version {version}: {'ok' if ok else 'WRONG VALUES'}", flush=True)
            if not ok:
                raise SystemExit(1)
    print("engine: done", flush=True)


if __name__ == "__main__":
    import sys

    from dmabuf_interop.errors import DmaBufError, NoDriverError

    try:
        main()
    except (DmaBufError, ImportError) as exc:  # a peer that went, no listener yet, torch missing without --host
        hint = ""
        if isinstance(exc, (NoDriverError, ImportError)) and "--host" not in sys.argv:
            hint = " (without a GPU and torch, run with --host: host memory and NumPy)"
        raise SystemExit(f"engine: {type(exc).__name__}: {exc}{hint}") from None
