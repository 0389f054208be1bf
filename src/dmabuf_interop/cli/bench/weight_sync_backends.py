"""The weight-sync workload's array back ends (NumPy host pools, torch device pools) and its step
schedule, shared by the channel's trainer and engine and by the peer paths."""

from __future__ import annotations

from typing import Any, Iterator

#: Most elements summed per tensor for its checksum (a strided sample).
SAMPLE = 4096
#: Streams the engine's copies are dealt over (:meth:`_Torch.copy_all`).
COPY_STREAMS = 4


def _stride(n: int) -> int:
    return max(1, n // SAMPLE)


# --- array backends: torch on a GPU, NumPy on the host ------------------------------------

class _Numpy:
    """Host pools: uint16 arrays holding bf16 bit patterns."""

    def __init__(self) -> None:
        import numpy as np

        self.np = np

    def from_pool(self, pool: Any, shape: tuple[int, ...]) -> Any:
        return pool.empty(shape, "uint16")

    def fill(self, params: list[Any]) -> None:
        for i, a in enumerate(params):
            a.fill(i % 1000)

    def bump(self, params: list[Any]) -> None:
        for a in params:
            self.np.add(a, 1, out=a)  # uint16 wraps: a cheap "training step"

    def checksums(self, params: list[Any], out: Any) -> None:
        for i, a in enumerate(params):
            flat = a.reshape(-1)
            out[i] = int(flat[::_stride(flat.size)].sum(dtype=self.np.int64))

    def view(self, r: Any) -> Any:
        return r.as_array()

    def views(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {n: r.as_array() for n, r in batch.items()}

    def synchronize(self) -> None:
        pass

    def empty_like_shapes(self, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
        return {n: self.np.empty(s, self.np.uint16) for n, s in shapes}

    def copy_all(self, dsts: list[Any], srcs: list[Any]) -> None:
        for dst, src in zip(dsts, srcs):
            self.np.copyto(dst, src)

    def equal_sums(self, params: list[Any], sums: Any) -> bool:
        mine = self.np.empty(len(params), self.np.int64)
        self.checksums(params, mine)
        return bool((mine == sums).all())

    def memory(self) -> int | None:
        return None


class _Torch:
    """Device pools: bf16 tensors; the step bump and checksums run on the int16 view."""

    def __init__(self, device: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        torch.cuda.set_device(device)
        self.stream = torch.cuda.Stream(device)
        # copy_all's streams, the receiving one first
        self.streams = [self.stream] + [torch.cuda.Stream(device) for _ in range(COPY_STREAMS - 1)]

    def from_pool(self, pool: Any, shape: tuple[int, ...]) -> Any:
        if pool is None:  # torch's own allocator (the expandable-segments variant)
            return self.torch.empty(shape, dtype=self.torch.bfloat16, device=self.device)
        return self.torch.from_dlpack(pool.empty(shape, "int16")).view(self.torch.bfloat16)

    def fill(self, params: list[Any]) -> None:
        with self.torch.cuda.stream(self.stream):
            for i, t in enumerate(params):
                t.view(self.torch.int16).fill_(i % 1000)

    def bump(self, params: list[Any]) -> None:
        with self.torch.cuda.stream(self.stream):
            self.torch._foreach_add_([t.view(self.torch.int16) for t in params], 1)

    def _sums(self, params: list[Any]) -> Any:
        t = self.torch
        return t.stack([p.view(t.int16).reshape(-1)[::_stride(p.numel())].sum(dtype=t.int64) for p in params])

    def checksums(self, params: list[Any], out: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            out.copy_(self._sums(params))

    def view(self, r: Any) -> Any:
        return r.as_tensor()

    def views(self, batch: dict[str, Any]) -> dict[str, Any]:
        from ...channel import as_tensors

        with self.torch.no_grad():  # as an engine loads weights (as_tensors then cuts runs of like tensors)
            return as_tensors(batch)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def empty_like_shapes(self, shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
        return {n: self.torch.empty(s, dtype=self.torch.bfloat16, device=self.device) for n, s in shapes}

    def copy_all(self, dsts: list[Any], srcs: list[Any]) -> None:
        """The copies dealt round-robin over :data:`COPY_STREAMS` streams, so that one copy's start
        overlaps another's transfer (ws-8b on one H200: 8.0 to 8.3 ms on four streams, 8.9 to 9.0 ms on
        one, 7.7 ms for one copy of the same bytes); the receiving stream then waits for the others,
        so the synchronise of ``release_all`` covers every copy."""
        torch = self.torch
        k = min(len(self.streams), len(dsts))
        for other in self.streams[1:k]:
            other.wait_stream(self.stream)  # recv_many made self.stream wait for the trainer's writes
        for i, stream in enumerate(self.streams[:k]):
            with torch.cuda.stream(stream):  # entered once per stream: it costs more than a copy_ launch
                for dst, src in zip(dsts[i::k], srcs[i::k]):
                    dst.copy_(src, non_blocking=True)
        for other in self.streams[1:k]:
            self.stream.wait_stream(other)

    def equal_sums(self, params: list[Any], sums: Any) -> bool:
        with self.torch.cuda.stream(self.stream):
            ok = bool(self.torch.equal(self._sums(params), sums.to(self.device)))
        return ok

    def memory(self) -> int | None:
        return int(self.torch.cuda.mem_get_info(self.device)[0])  # free bytes (cudaMemGetInfo)


def settle_gc() -> None:
    """Collect once, then freeze every object alive so far (``gc.freeze``), as latency-sensitive
    Python services do before serving: a full collection walks torch's several hundred thousand
    objects and would stall whichever step it lands in by about 0.1 s. Every process of the
    workload (ours and the peers') calls it once its model is built, and every latency peer
    (:mod:`.peers`) once it is set up."""
    import gc

    gc.collect()
    gc.freeze()


def _steps(cfg: dict[str, Any]) -> Iterator[tuple[str, int, bool]]:
    """(variant, step, timed) in the order both ends run them."""
    for variant in cfg["variants"]:
        for k in range(cfg["warmup"] + cfg["reps"]):
            yield variant, k, k >= cfg["warmup"]
