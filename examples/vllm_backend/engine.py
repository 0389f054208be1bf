"""vLLM-shaped weight sync, engine side: the "dmabuf" backend's worker engine, driven as vLLM drives it.

    python examples/vllm_backend/engine.py --control /tmp/ctl.sock            # GPU 0, a toy model
    python examples/vllm_backend/engine.py --control /tmp/ctl.sock --host     # no GPU

How this maps onto vLLM: this process is a vLLM worker. ``WorkerEngine`` is what
``DmabufWeightTransferEngine`` (made by ``WeightTransferEngineFactory.create_engine`` when the server
runs with ``--weight-transfer-config '{"backend": "dmabuf"}'``) runs inside; ``serve`` answers the
trainer's four calls as vLLM's ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` and ``/finish_weight_update`` routes do; ``Model.load_weights`` stands for the
model's own ``load_weights`` (it copies each tensor into the parameter of its name). Nothing here
needs vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, Iterable

SHAPES = {"toy": [("model.embed_tokens.weight", (1024, 256)), ("model.layers.0.mlp.up_proj.weight", (768, 256)),
                  ("model.layers.0.input_layernorm.weight", (256,)), ("lm_head.weight", (1024, 256))]}


def shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    if name in SHAPES:
        return SHAPES[name]
    from dmabuf_interop.cli.bench.weight_sync import model_shapes  # ws-8b: Qwen3-8B's 399 tensors

    return model_shapes(name)


class Model:
    """A stand-in for a vLLM model: bf16 parameters by name, and ``load_weights`` copying into them."""

    def __init__(self, layout: list[tuple[str, tuple[int, ...]]], device: Any) -> None:
        import torch

        self.params = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in layout}

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            self.params[name].copy_(w, non_blocking=True)  # on the current stream: the batch's
            loaded.add(name)
        return loaded

    def holds(self, value: float) -> bool:
        return all(bool((p == value).all()) for p in self.params.values())


def main() -> int:
    import torch

    from dmabuf_interop.integrations.vllm import WorkerEngine, serve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", default="/tmp/dmabuf-interop-ctl.sock", help="the control socket to listen on")
    ap.add_argument("--host", action="store_true", help="CPU model and host pool (no GPU)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--shapes", default="toy", help="toy, ws-8b or ws-moe")
    ap.add_argument("--json", action="store_true", help="a last line of JSON: the versions loaded and checked")
    args = ap.parse_args()
    device = torch.device("cpu") if args.host else torch.device("cuda", args.device)
    if not args.host:
        torch.cuda.set_device(device)
    model = Model(shapes(args.shapes), device)
    worker = WorkerEngine(device, model)
    checked: list[dict[str, Any]] = []

    def after(method: str) -> None:  # the "rollout": read the version just loaded
        if method == "finish_weight_update":
            ok = model.holds(float(worker.version))
            checked.append({"version": worker.version, "ok": ok})
            if not args.json:
                print(f"engine: loaded version {worker.version}: {'ok' if ok else 'WRONG VALUES'}", flush=True)

    if os.path.exists(args.control):
        os.unlink(args.control)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as lst:
        lst.bind(args.control)
        os.chmod(args.control, 0o600)
        lst.listen(1)
        print(f"engine: waiting for a trainer on {args.control}", file=sys.stderr, flush=True)
        lst.settimeout(300)
        conn, _ = lst.accept()
        with conn:
            serve(conn, worker, timeout=600, after=after)
    os.unlink(args.control)
    if args.json:
        print(json.dumps({"checked": checked}), flush=True)
    return 0 if checked and all(c["ok"] for c in checked) else 1


if __name__ == "__main__":
    sys.exit(main())
