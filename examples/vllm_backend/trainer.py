"""vLLM-shaped weight sync, trainer side: the "dmabuf" backend's trainer engine, as an RL trainer drives it.

    python examples/vllm_backend/trainer.py --control /tmp/ctl.sock --address /tmp/w.sock            # GPU 0
    python examples/vllm_backend/trainer.py --control /tmp/ctl.sock --address /tmp/w.sock --host     # no GPU

Start ``engine.py`` first (it listens on ``--control``). How this maps onto vLLM: ``SocketClient``
stands for vLLM's ``HTTPVLLMWeightSyncClient`` (or ``RayVLLMWeightSyncClient``); ``TrainerEngine``
is what ``DmabufTrainerWeightTransferEngine`` runs inside, and
``TrainerEngine.trainer_init(TrainerOptions(...), client=..., source=...)`` is
``WeightTransferTrainerFactory.trainer_init(DmabufTrainerInitInfo(..., rank=0), client=..., source=...)``;
``Source`` stands for vLLM's ``ModuleSource(model)``. Each step fills every parameter with the step
number and calls ``send_weights()``: ``start_weight_update``, ``update_weights({"version": k})`` while the
state dict goes over the channel, ``finish_weight_update``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any, Iterator

from engine import shapes  # the same layouts as the engine


class Source:
    """A stand-in for vLLM's ``WeightSource``: ``iter_full()`` yields (name, tensor) in order."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        yield from self.params.items()


def main() -> int:
    import torch

    from dmabuf_interop.integrations.vllm import SocketClient, TrainerEngine, TrainerOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", default="/tmp/dmabuf-interop-ctl.sock", help="the engine's control socket")
    ap.add_argument("--address", default="/tmp/dmabuf-interop-weights.sock", help="the weights' socket to listen on")
    ap.add_argument("--host", action="store_true", help="CPU tensors and a host pool (no GPU)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--shapes", default="toy", help="toy, ws-8b or ws-moe (as the engine)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-bytes", type=int, default=None, help="the pool's size (default: the model's, plus 1 GiB)")
    ap.add_argument("--in-pool", action="store_true", help="move the parameters into the pool: lent, not copied")
    ap.add_argument("--json", action="store_true", help="a last line of JSON: ms per send_weights")
    args = ap.parse_args()
    device = torch.device("cpu") if args.host else torch.device("cuda", args.device)
    if not args.host:
        torch.cuda.set_device(device)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes(args.shapes)}
    total = sum(p.numel() * 2 for p in params.values())
    options = TrainerOptions(address=args.address, device=None if args.host else args.device,
                             max_bytes=args.max_bytes or total + (1 << 30), timeout=300)
    source = Source(params)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ctl:
        ctl.settimeout(60)
        try:
            ctl.connect(args.control)
        except OSError as exc:
            print(f"trainer: no engine at {args.control} ({exc.strerror or exc}): start engine.py first",
                  file=sys.stderr)
            return 1
        client = SocketClient(ctl, timeout=600)
        engine = TrainerEngine.trainer_init(options, client=client, source=source)  # the engine connects
        if args.in_pool:  # the parameters become pool blocks: sent in place from now on
            for n, p in params.items():
                block = engine.publisher.pool.empty(tuple(p.shape), "int16", timeout=60)
                q = (torch.from_numpy(block) if args.host else torch.from_dlpack(block)).view(torch.bfloat16)
                params[n] = q
        times = []
        for k in range(1, args.steps + 1):
            for p in params.values():  # "training": every element becomes k
                p.fill_(k)
            if not args.host:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            engine.send_weights()  # start, update (the channel), finish; the engine checks the values
            times.append((time.perf_counter() - t0) * 1e3)
            if not args.json:
                print(f"trainer: sent version {k} in {times[-1]:.2f} ms", flush=True)
        client.shutdown_weight_transfer_engine()
        engine.shutdown()
    if args.json:
        print(json.dumps({"send_ms": times, "tensors": len(params), "bytes": total}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
