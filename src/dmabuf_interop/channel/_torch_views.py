"""torch tensors for a batch of Received: one DLPack import per chunk and dtype, each item a view of it,
runs of like items cut from one view; and the pause of the garbage collector while a large batch makes
its objects. Both are measured speed tricks (see each docstring for the measurement)."""

from __future__ import annotations

import contextlib
import gc
import operator
import threading
import weakref
from typing import Any, Iterator

from .arrays import ChunkRef, torch_dtype

__all__ = ["BatchViews", "LayoutViews", "stack_runs", "bulk", "STACK_MIN", "BULK_ITEMS"]

_VIEW_PLAN = operator.attrgetter("descriptor.view_plan")


class _Keep:
    """The DLPack owner of a batch's chunk tensors: it keeps alive every Received whose tensor
    is a view of them, so that no safety-net release happens while such a view lives."""

    __slots__ = ("members", "__weakref__")

    def __init__(self) -> None:
        self.members: list[Any] = []  # Received


class BatchViews:
    """Tensors for the items of one ``recv_many`` batch on a device: one DLPack import
    (``torch.from_dlpack``) per chunk and dtype, and each item an ``as_strided`` view of it,
    instead of one DLPack import per item; for a batch of a layout taken outside grad mode, runs of
    like items (:func:`stack_runs`) are cut from one view each (``unbind``). Held by each Received of the
    batch; it refers to the :class:`_Keep` and the chunk tensors only weakly, so no reference cycle
    delays a release."""

    __slots__ = ("keep", "bases", "layout")

    def __init__(self, layout: "LayoutViews | None" = None) -> None:
        self.keep: Any = None  # weakref.ref to the live _Keep, if any
        self.bases: dict[tuple[int, Any], Any] = {}  # (chunk id, torch dtype) -> weakref.ref to the chunk tensor
        self.layout = layout  # the batch's layout, when it has one: its runs are worked out once

    def _keep(self) -> _Keep:
        keep = self.keep() if self.keep is not None else None
        if keep is None:  # every earlier chunk tensor is gone (they held it)
            keep = _Keep()
            self.keep = weakref.ref(keep)
        return keep

    def _base(self, chunk: Any, torch: Any, dtype: Any, keep: _Keep) -> Any:
        """The whole chunk as one tensor of ``dtype`` (one ``torch.from_dlpack`` per chunk and dtype)."""
        ref = self.bases.get((chunk.id, dtype))
        base = ref() if ref is not None else None
        if base is None:
            import numpy as np
            from cuda.core.utils import StridedMemoryView

            from ..buffers import mapped_buffer

            owner = (keep, ChunkRef(chunk))
            raw = StridedMemoryView.from_buffer(mapped_buffer(chunk.buf.ptr, chunk.size, chunk.device, owner),
                                                (chunk.size,), (1,), dtype=np.dtype("uint8"))
            base = torch.from_dlpack(raw).view(dtype)
            self.bases[(chunk.id, dtype)] = weakref.ref(base)
        return base

    def tensor(self, r: Any, torch: Any, dtype: Any) -> Any:
        keep = self._keep()
        keep.members.append(r)
        return self._base(r._chunk, torch, dtype, keep).as_strided(*r.descriptor.elements)

    def tensors(self, items: list[Any], torch: Any) -> list[Any]:
        """:meth:`tensor` of each of ``items`` (unreleased items of this batch), the lookups done once."""
        keep = self._keep()
        keep.members.extend(items)
        bases: dict[tuple[int, str], Any] = {}
        with bulk(len(items)):
            plans = list(map(_VIEW_PLAN, items))  # each ((chunk id, dtype), (shape, strides, offset)), in elements
            found = None
            # Not in grad mode: unbind's outputs (a multi-output view) may not then be written in place
            # with an operand that requires grad, where as_strided's may.
            if self.layout is not None and len(items) >= STACK_MIN and not torch.is_grad_enabled():
                found = self.layout.runs(plans)
            runs, singles = found if found is not None else ((), range(len(items)))  # no runs: every item alone
            out: list[Any] = [None] * len(items)
            for key, shape, strides, first, delta, idx in runs:
                base = bases.get(key)
                if base is None:
                    base = bases[key] = self._base(items[idx[0]]._chunk, torch, torch_dtype(torch, key[1]), keep)
                # One view over the whole run, cut into its items: the same tensors as one as_strided each.
                for i, t in zip(idx, base.as_strided((len(idx), *shape), (delta, *strides), first).unbind(0)):
                    out[i] = t
            for i in singles:
                key, args = plans[i]
                base = bases.get(key)
                if base is None:
                    base = bases[key] = self._base(items[i]._chunk, torch, torch_dtype(torch, key[1]), keep)
                out[i] = base.as_strided(*args)
        return out


#: Items of one batch that :func:`stack_runs` joins into one view (then ``unbind``) when this many or more.
STACK_MIN = 8


def stack_runs(plans: list[Any], min_run: int = STACK_MIN) -> tuple[list[Any], list[int]]:
    """Runs of a batch's items that one strided view of their chunk tensor holds, one item per index of
    its first dimension: items of the same chunk, dtype, shape and strides whose element offsets step by
    the same positive ``delta``, taken in batch order, every ``p``-th of them, for the ``p`` in 1..4 that
    puts the most items in runs (a state dict of experts lays out a few shapes in turn).

    Args:
        plans: each item's ``view_plan``: ``((chunk id, dtype), (shape, strides, offset))``, in elements.
        min_run: the fewest items in a run (at least 2).

    Returns:
        ``(runs, singles)``: each run ``(key, shape, strides, first offset, delta, indices)``, and the
        indices of the items in no run.
    """
    min_run = max(min_run, 2)
    by_sig: dict[Any, list[int]] = {}
    for i, (key, (shape, strides, _)) in enumerate(plans):
        by_sig.setdefault((key, shape, strides), []).append(i)
    runs: list[Any] = []
    singles: list[int] = []
    for (key, shape, strides), idx in by_sig.items():
        best: tuple[int, list[Any], list[int]] = (0, [], idx)
        for p in range(1, 5):
            if len(idx) < p * min_run:
                break
            found: list[Any] = []
            left: list[int] = []
            covered = 0
            for j in range(p):
                sub = idx[j::p]
                offs = [plans[i][1][2] for i in sub]
                s = 0
                while s < len(sub):
                    e = s + 1
                    delta = offs[e] - offs[s] if e < len(sub) else 0
                    if delta > 0:
                        while e < len(sub) and offs[e] - offs[e - 1] == delta:
                            e += 1
                    if e - s >= min_run:
                        found.append((key, shape, strides, offs[s], delta, sub[s:e]))
                        covered += e - s
                        s = e
                    else:
                        left.append(sub[s])
                        s += 1
            if covered > best[0]:
                best = (covered, found, left)
        runs += best[1]
        singles += best[2]
    return runs, singles


class LayoutViews:
    """What the tensors of a layout's batches share across messages: its :func:`stack_runs`, worked
    out the second time the same items are taken together (a layout sent once pays nothing for it),
    and kept for later batches that take the same."""

    __slots__ = ("cached",)

    def __init__(self) -> None:
        self.cached: tuple[list[Any], tuple[list[Any], list[int]] | None] | None = None

    def runs(self, plans: list[Any]) -> tuple[list[Any], list[int]] | None:
        """The runs of ``plans`` (:func:`stack_runs`), or ``None`` (one ``as_strided`` per item): on their
        first sight, and for items other than the first seen (a part of the batch, another order)."""
        cached = self.cached  # one read and at most one write of the pair: threads may share a layout
        if cached is None:
            self.cached = (plans, None)
            return None
        if cached[0] != plans:
            return None
        if cached[1] is None:
            cached = self.cached = (plans, stack_runs(plans))
        return cached[1]



#: Batches of at least this many items pause the garbage collector while they make their objects (:func:`bulk`).
BULK_ITEMS = 1024


class _GcPause:
    """The cyclic garbage collector paused while any thread is inside a large batch (:func:`bulk`):
    off when the first enters, on again when the last leaves, and only if it was on before."""

    lock = threading.Lock()
    depth = 0
    was_on = False


def bulk(items: int) -> contextlib.AbstractContextManager[None]:
    """Pause the cyclic garbage collector (``gc.disable``) while a batch of ``items`` makes an object or
    more per item, all of which it keeps: a collection in between would only walk them (measured on a
    19,000-item batch: a fifth to a third of its time). Collections resume with the next allocations.
    Below :data:`BULK_ITEMS`, a shared no-op context: a single array pays no generator per message."""
    return _NO_PAUSE if items < BULK_ITEMS else _gc_paused()


_NO_PAUSE = contextlib.nullcontext()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    with _GcPause.lock:
        if _GcPause.depth == 0:
            _GcPause.was_on = gc.isenabled()
            gc.disable()
        _GcPause.depth += 1
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.depth -= 1
            if _GcPause.depth == 0 and _GcPause.was_on:
                gc.enable()
