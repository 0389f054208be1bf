"""The weight-sync workload's ``vllm-backend`` path: the "dmabuf" vLLM backend, driven in vLLM's order.

Two fresh interpreters, as the other paths: the trainer runs
:class:`~dmabuf_interop.integrations.vllm.TrainerEngine` (``send_weights``: ``start_weight_update``,
``update_weights`` while the state dict goes over the channel, ``finish_weight_update``) through a
:class:`~dmabuf_interop.integrations.vllm.SocketClient` on a socket pair, standing for vLLM's HTTP
client; the engine answers with :func:`~dmabuf_interop.integrations.vllm.serve` and a
:class:`~dmabuf_interop.integrations.vllm.WorkerEngine` whose model's ``load_weights`` copies each tensor
into its own parameter (``Tensor.copy_`` on the batch's stream). The trainer's parameters live in the
backend's pool (moved there after ``trainer_init``), so nothing is staged. The checksums travel as one
more tensor of the state dict.

Timed per step: the trainer calls ``send_weights`` (its step's GPU work synchronised first) -> the
engine's ``receive_weights`` returns (every copy complete: the weights are in the model). The checksum
check runs after that, before the engine answers ``finish_weight_update``, every step.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from .weight_sync_backends import _steps, settle_gc

#: The path's name in ``--paths`` and in the table.
PATH = "vllm-backend"
SUMS = "__checksums__"


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class _Backend:
    """torch on the trainer's or engine's device (CPU for ``--host``): the steps of :mod:`.weight_sync_backends`."""

    def __init__(self, cfg: dict[str, Any], role: int) -> None:
        import torch

        from .weight_sync_backends import _Torch

        self.torch = torch
        self.host = cfg["host"]
        self.gpu = None if self.host else _Torch(cfg["devices"][role])
        self.device = torch.device("cpu") if self.host else torch.device("cuda", cfg["devices"][role])

    def sums(self, params: list[Any]) -> Any:
        from .weight_sync_backends import _stride

        t = self.torch
        return t.stack([p.view(t.int16).reshape(-1)[::_stride(p.numel())].sum(dtype=t.int64) for p in params])

    def sync(self) -> None:
        if not self.host:
            self.torch.cuda.synchronize(self.device)

    def memory(self) -> int | None:
        return None if self.host else self.gpu.memory()  # type: ignore[union-attr]


class _Source:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def iter_full(self) -> Any:
        return iter(self.state.items())


def trainer(cfg: dict[str, Any], fd: int) -> dict[str, Any]:
    """The trainer's side over the control socket ``fd`` (owned from now on)."""
    import socket

    from ...integrations.vllm import SocketClient, TrainerEngine, TrainerOptions

    be = _Backend(cfg, 0)
    torch = be.torch
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]
    total = sum(2 * math.prod(s) for _, s in shapes) + 8 * len(shapes) + 256 * (len(shapes) + 1)
    options = TrainerOptions(address=cfg["address"] + ".vllm", device=None if be.host else cfg["devices"][0],
                             max_bytes=total + (1 << 30), timeout=cfg["timeout"])
    ctl = socket.socket(fileno=fd)
    state: dict[str, Any] = {}
    engine = TrainerEngine.trainer_init(options, client=SocketClient(ctl, timeout=cfg["timeout"] * 4),
                                        source=_Source(state))
    try:
        pool = engine.publisher.pool  # type: ignore[union-attr]

        def block(shape: tuple[int, ...], dtype: str) -> Any:
            a = pool.empty(shape, dtype, timeout=cfg["timeout"])
            return torch.from_numpy(a) if be.host else torch.from_dlpack(a)

        params = [block(s, "int16").view(torch.bfloat16) for _, s in shapes]  # lent from the pool: not staged
        with torch.no_grad():
            for i, p in enumerate(params):
                p.view(torch.int16).fill_(i % 1000)
        sums = block((len(shapes),), "int64")
        state.update({n: p for (n, _), p in zip(shapes, params)})
        state[SUMS] = sums
        t0s: list[int] = []
        mem: dict[str, Any] = {}
        cpu0 = 0.0
        settle_gc()
        for _, k, timed in _steps({**cfg, "variants": [PATH]}):
            if k == cfg["warmup"]:
                mem = {"free_before": be.memory(), "fds_before": _fd_count()}
                cpu0 = time.process_time()
            with torch.no_grad():
                torch._foreach_add_([p.view(torch.int16) for p in params], 1)
                sums.copy_(be.sums(params))
            be.sync()
            t0 = time.monotonic_ns()
            engine.send_weights()  # returns once the engine answered finish_weight_update (leases back)
            if timed:
                t0s.append(t0)
        mem.update(free_after=be.memory(), fds_after=_fd_count(),
                   cpu_ms_per_step=round((time.process_time() - cpu0) * 1e3 / cfg["reps"], 3))
        report = engine.report
        SocketClient(ctl, timeout=cfg["timeout"]).shutdown_weight_transfer_engine()
    finally:
        engine.shutdown()
        ctl.close()
    return {"t0": t0s, "memory": mem, "staged_bytes": report.staged_bytes if report else None,
            "batches": report.batches if report else None}


def engine(cfg: dict[str, Any], fd: int) -> dict[str, Any]:
    """The engine's side: a model whose ``load_weights`` copies, behind :func:`serve`."""
    import socket

    from ...integrations.vllm import WorkerEngine, serve

    be = _Backend(cfg, 1)
    torch = be.torch
    shapes = [(n, tuple(s)) for n, s in cfg["shapes"]]

    class Model:
        def __init__(self) -> None:
            self.params = {n: torch.empty(s, dtype=torch.bfloat16, device=be.device) for n, s in shapes}
            self.sums: Any = None

        def load_weights(self, weights: Any) -> None:
            params = self.params
            for name, w in weights:
                if name == SUMS:
                    self.sums = w.clone()
                else:
                    params[name].copy_(w, non_blocking=True)

    model = Model()
    worker = WorkerEngine(be.device, model)
    out: dict[str, Any] = {"t1": [], "bad_checksums": 0, "memory": {}}
    steps = iter(_steps({**cfg, "variants": [PATH]}))
    state = {"step": None, "cpu0": 0.0}
    settle_gc()

    def after(method: str) -> None:
        if method == "start_weight_update":
            _, k, timed = state["step"] = next(steps)
            if k == cfg["warmup"]:
                out["memory"] = {"free_before": be.memory(), "fds_before": _fd_count()}
                state["cpu0"] = time.process_time()
        elif method == "update_weights":
            t1 = time.monotonic_ns()  # receive_weights returned: every copy complete
            if state["step"][2]:
                out["t1"].append(t1)
        elif method == "finish_weight_update":
            held = [model.params[n] for n, _ in shapes]
            if not torch.equal(be.sums(held), model.sums.to(be.device)):
                out["bad_checksums"] += 1
            if state["step"][1] == cfg["warmup"] + cfg["reps"] - 1:
                out["memory"].update(free_after=be.memory(), fds_after=_fd_count(),
                                     cpu_ms_per_step=round((time.process_time() - state["cpu0"]) * 1e3
                                                           / cfg["reps"], 3))

    ctl = socket.socket(fileno=fd)
    try:
        serve(ctl, worker, timeout=cfg["timeout"] * 4, after=after)
    finally:
        ctl.close()
    return out
