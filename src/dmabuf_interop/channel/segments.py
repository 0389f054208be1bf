"""Lending CUDA memory that is already shareable in place: the pages of torch's expandable segments.

Under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` torch's caching
allocator maps each segment page by page, each page a ``cuMemCreate``
allocation that requests ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``
(measured on H200 with torch 2.x: 2 MiB pages for small blocks, 20 MiB for
large ones). Such a tensor can be lent without a copy: ``cuMemGetAddressRange``
gives the bounds of the page holding an address, ``cuMemRetainAllocationHandle``
the physical allocation behind it, and ``cuMemExportToShareableHandle`` its fd
(CUDA Driver API, "Virtual Memory Management"). The pages a tensor covers form
one *segment chunk*; the importer maps its parts back to back in one
reservation (:func:`..mechanisms.posix_fd.import_posix_fd_parts`).

Cached, per process and device: each segment chunk, by the pages it spans,
with a retained handle per page. Sending from a known chunk again costs one
``cuMemRetainAllocationHandle`` per page (about 1.4 us on H200), to check that
torch still maps the same memory there, and no export. A chunk's fds are
exported when it is announced on a connection (about 0.6 ms per page) and
closed once sent, so that a model of a thousand pages does not hold a thousand
fds.

Lifetime: a lease holds the sent tensor, so torch cannot reuse its memory while
the peer reads it. The retained handles keep pages alive after torch unmaps
them (``torch.cuda.empty_cache``): a chunk whose addresses torch has mapped
with other memory since is retired (on every channel) the next time a send
meets it; :func:`release_segments` retires them all.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
import weakref
from typing import Any, Iterable, Iterator

from .. import _driver as driver
from ..errors import CudaError, InvalidArgumentError
from ..fd import OwnedFd
from ..mechanisms.posix_fd import vmm_pages
from .events import EventPool
from .pool import chunk_ids
from .protocol import MAX_PARTS

__all__ = ["release_segments", "MAX_SEGMENT_CHUNKS"]

#: Most segment chunks a device keeps lendable (the oldest idle ones are retired beyond it): well
#: under what a peer maps from one channel (``channel.MAX_CHUNKS``).
MAX_SEGMENT_CHUNKS = 1024


class SegmentChunk:
    """Pages mapped back to back in this process: ``parts[i]`` bytes each from ``ptr``, one retained handle each."""

    mechanism = "posix-fd"

    def __init__(self, device: int, ptr: int, parts: list[int], handles: list[Any]) -> None:
        self.id = next(chunk_ids)
        self.device = device
        self.device_uuid = driver.device_uuid(device)
        self.ptr = ptr
        self.parts = parts
        self.starts = list(itertools.accumulate([ptr] + parts[:-1]))  # each page's address
        self.size = sum(parts)
        self.handles = handles  # ours (cuMemRetainAllocationHandle): released by release()
        self.refs = 0  # blocks lent from it and not yet given back
        self.stale = False  # torch maps other memory at some of its pages now: lend no more, retire when idle

    def pages(self, ptr: int, end: int) -> range:
        """Indices of the pages that ``[ptr, end)`` touches."""
        return range(bisect.bisect_right(self.starts, ptr) - 1, bisect.bisect_left(self.starts, end))

    def describe(self) -> dict[str, Any]:
        """The ``chunk`` message; one fd per part rides along (:meth:`fds`)."""
        return {"kind": "chunk", "chunk": self.id, "size": self.size, "mechanism": self.mechanism,
                "device_uuid": self.device_uuid, "parts": list(self.parts)}

    @contextlib.contextmanager
    def fds(self) -> Iterator[list[int]]:
        """Each page exported (``cuMemExportToShareableHandle``), closed when the message has gone."""
        owned: list[OwnedFd] = []
        try:
            driver.set_current(self.device)
            for h in self.handles:
                owned.append(OwnedFd(driver.vmm_export_posix_fd(h)))
            yield [fd.fd for fd in owned]
        finally:
            for fd in owned:
                fd.close()

    def release(self) -> None:
        driver.set_current(self.device)
        handles, self.handles = self.handles, []
        for h in handles:
            driver.vmm_release(h)


class SegmentBlock:
    """A tensor lent from a segment chunk: the whole chunk as its block, and the tensor held until the
    lease ends."""

    __slots__ = ("pool", "chunk", "offset", "size", "keep")

    def __init__(self, segments: "Segments", chunk: SegmentChunk, keep: Any) -> None:
        self.pool = segments
        self.chunk = chunk
        self.offset = 0
        self.size = chunk.size
        self.keep = keep
        chunk.refs += 1

    @property
    def ptr(self) -> int:
        return self.chunk.ptr


class Segments:
    """The segment chunks of one device in this process (see the module docstring); plays a pool's part
    for leases: ``is_host``, ``device``, ``events``, ``_unref``, ``_unref_many``, ``_register_channel``."""

    is_host = False

    def __init__(self, device: int) -> None:
        self.device = device
        self.events = EventPool(device)
        self._lock = threading.Lock()
        self._chunks: list[SegmentChunk] = []  # sorted by ptr
        self._known: dict[tuple[int, int], SegmentChunk] = {}  # (ptr, span) sent before -> its chunk
        self._channels: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._idle_stale: list[SegmentChunk] = []

    def __len__(self) -> int:
        """Segment chunks that new sends may lend from."""
        with self._lock:
            return len(self._chunks)

    def _unref(self, block: SegmentBlock) -> None:
        self._unref_many((block,))

    def _unref_many(self, blocks: Iterable[SegmentBlock]) -> None:
        """The leases are over: torch may reuse the tensors' memory; a stale chunk retires once idle, in a
        thread of its own (this runs in a channel's reader, which must not wait on other channels)."""
        idle_stale: list[SegmentChunk] = []
        with self._lock:
            for block in blocks:
                block.keep = None
                chunk = block.chunk
                chunk.refs -= 1
                if chunk.stale and chunk.refs == 0:
                    idle_stale.append(chunk)
        if idle_stale:
            threading.Thread(target=self._retire, args=(idle_stale,), name="dmabuf-interop-segment-retire",
                             daemon=True).start()

    def give_back(self, blocks: Iterable[SegmentBlock]) -> None:
        """End blocks that :meth:`find_many` lent outside a channel (as a lease's end does)."""
        self._unref_many(blocks)

    def _register_channel(self, channel: Any) -> None:
        with self._lock:
            self._channels.add(channel)

    def find_many(self, requests: list[tuple[int, int, Any]]) -> list[SegmentBlock | None]:
        """For each ``(ptr, span, keep)`` the block that lends ``[ptr, ptr+span)`` in place, or ``None``
        where that memory is not pages this library can export (not ``cuMemCreate`` memory, not
        POSIX-fd exportable, on another device, a hole): the caller copies those.

        A range sent before costs one ``cuMemRetainAllocationHandle`` per page to check that torch
        still maps the same memory there; new ranges are grouped into chunks of pages that are
        contiguous in the address space (at most :data:`~.protocol.MAX_PARTS` pages each), so a
        state dict in one expandable segment travels as a few chunks.

        Raises:
            CudaError: a driver call failed other than by saying the memory is not ``cuMemCreate``'s.
        """
        out: list[SegmentBlock | None] = [None] * len(requests)
        idle: list[SegmentChunk] = []
        try:
            with self._lock:
                try:
                    todo = self._reuse(requests, out)
                    if todo:
                        self._lend_new(requests, todo, out)
                    self._trim()
                except BaseException:
                    for b in out:  # nothing lent: give back what was
                        if b is not None:
                            b.chunk.refs -= 1
                    raise
                finally:
                    idle, self._idle_stale = self._idle_stale, []
        finally:  # stale chunks found on the way are retired even when this call fails
            self._retire(idle)
        return out

    def _reuse(self, requests: list[tuple[int, int, Any]], out: list[SegmentBlock | None]) -> list[int]:
        """Lend from known chunks whose pages are still the same; returns the indices left to do."""
        todo, hits, bad = [], [], set()
        checked: dict[tuple[int, int], bool] = {}  # (chunk id, page) -> same memory there
        for i, (ptr, span, _) in enumerate(requests):
            chunk = self._known.get((ptr, span))
            if chunk is None or chunk.stale:
                todo.append(i)
                continue
            for k in chunk.pages(ptr, ptr + span):
                same = checked.get((chunk.id, k))
                if same is None:
                    same = checked[(chunk.id, k)] = self._same_page(chunk, k)
                if not same:
                    bad.add(chunk)
                    break
            hits.append((i, chunk))
        for chunk in bad:
            self._mark_stale(chunk)
        for i, chunk in hits:
            if chunk.stale:
                todo.append(i)
            else:
                out[i] = SegmentBlock(self, chunk, requests[i][2])
        return sorted(todo)

    @staticmethod
    def _same_page(chunk: SegmentChunk, k: int) -> bool:
        """Whether page ``k`` is still the chunk's allocation (one torch unmapped and mapped again is
        another: our retained handle keeps the old one alive, so its value cannot come back)."""
        try:
            now = driver.vmm_retain_handle(chunk.starts[k])
        except CudaError:
            return False
        driver.vmm_release(now)
        return int(now) == int(chunk.handles[k])

    def _covering(self, ptr: int, end: int, out_stale: set[SegmentChunk]) -> SegmentChunk | None:
        """A live chunk holding all of ``[ptr, end)`` with the same memory there, if any; chunks that
        overlap the range with other memory now go into ``out_stale``."""
        found = None
        i = bisect.bisect_right(self._chunks, ptr, key=lambda c: c.ptr)
        for c in reversed(self._chunks[:i]):  # chunks starting at or before ptr that reach into the range
            if c.ptr + c.size <= ptr:
                continue
            pages = c.pages(ptr, min(end, c.ptr + c.size))
            if not all(self._same_page(c, k) for k in pages):
                out_stale.add(c)
            elif found is None and end <= c.ptr + c.size:
                found = c
        return found

    def _lend_new(self, requests: list[tuple[int, int, Any]], todo: list[int],
                  out: list[SegmentBlock | None]) -> None:
        driver.set_current(self.device)
        walked: dict[int, list[tuple[int, int]]] = {}  # request index -> its pages
        stale: set[SegmentChunk] = set()
        for i in todo:
            ptr, span, keep = requests[i]
            chunk = self._covering(ptr, ptr + span, stale)
            if chunk is not None and chunk not in stale:  # pages already lent under another range
                out[i] = SegmentBlock(self, chunk, keep)
                self._known[(ptr, span)] = chunk
                continue
            pages = self._walk(ptr, ptr + span)
            if pages is not None and len(pages) <= MAX_PARTS:  # longer ones are copied
                walked[i] = pages
        for chunk in stale:  # blocks already lent from one keep it until they come back
            self._mark_stale(chunk)
        for pages, items in group_runs(walked):
            chunk = self._new_chunk(pages)
            if chunk is not None:
                for j in items:
                    out[j] = SegmentBlock(self, chunk, requests[j][2])
                    self._known[requests[j][:2]] = chunk
        if len(self._known) > 1 << 16:  # a cache, not a record: forget it rather than grow without bound
            self._known.clear()

    @staticmethod
    def _walk(ptr: int, end: int) -> list[tuple[int, int]] | None:
        """The ``cuMemCreate`` pages covering ``[ptr, end)``, or ``None`` for memory that is not
        ``cuMemCreate``'s or has a hole (:func:`..mechanisms.posix_fd.vmm_pages`)."""
        try:
            return vmm_pages(ptr, end)
        except (CudaError, InvalidArgumentError):
            return None

    def _new_chunk(self, pages: list[tuple[int, int]]) -> SegmentChunk | None:
        handles: list[Any] = []
        chunk = None
        try:
            for at, _ in pages:
                handles.append(driver.vmm_retain_handle(at))
                prop = driver.vmm_allocation_properties(handles[-1])
                if prop["device"] != self.device or not prop["posix_fd"]:
                    return None
            chunk = SegmentChunk(self.device, pages[0][0], [n for _, n in pages], handles)
        except CudaError:
            return None
        finally:
            if chunk is None:
                for h in handles:
                    driver.vmm_release(h)
        bisect.insort(self._chunks, chunk, key=lambda c: c.ptr)
        return chunk

    def _trim(self) -> None:
        """Keep at most :data:`MAX_SEGMENT_CHUNKS` chunks: retire the oldest idle ones beyond it."""
        excess = len(self._chunks) - MAX_SEGMENT_CHUNKS
        if excess > 0:
            for c in sorted((c for c in self._chunks if c.refs == 0), key=lambda c: c.id)[:excess]:
                self._mark_stale(c)

    def _mark_stale(self, chunk: SegmentChunk) -> None:
        """Lend no more from ``chunk``; retire it now if idle, else when its last block comes back."""
        chunk.stale = True
        self._chunks.remove(chunk)
        self._known = {k: c for k, c in self._known.items() if c is not chunk}
        if chunk.refs == 0:
            self._idle_stale.append(chunk)  # retired once the lock is let go

    def _retire(self, chunks: list[SegmentChunk]) -> None:
        with self._lock:
            channels = list(self._channels)
        for chunk in chunks:
            for ch in channels:
                ch._retire_chunk(chunk.id)
            chunk.release()

    def release(self) -> int:
        """Retire every chunk on every channel now (those with blocks still lent: once given back) and
        release its pages; returns how many."""
        with self._lock:
            chunks = list(self._chunks)
            idle = [c for c in chunks if c.refs == 0]
            for c in chunks:
                c.stale = True
            self._chunks.clear()
            self._known.clear()
        self._retire(idle)
        return len(chunks)


def group_runs(requests: dict[Any, list[tuple[int, int]]], max_parts: int = MAX_PARTS
               ) -> list[tuple[list[tuple[int, int]], list[Any]]]:
    """Group requests whose pages touch into runs of at most ``max_parts`` pages.

    Args:
        requests: key -> the pages ``(address, size)`` one request covers, contiguous and in
            address order, at most ``max_parts`` of them.

    Returns:
        ``(pages, keys)`` per run: the run's distinct pages in address order, contiguous, and the
        keys of the requests that lie wholly inside it. A request overlapping or adjacent to the run
        so far joins it unless that would pass ``max_parts`` pages; then a new run starts at its first
        page (so runs may share a page).
    """
    out: list[tuple[list[tuple[int, int]], list[Any]]] = []
    run: dict[int, int] = {}  # page address -> size
    keys: list[Any] = []
    end = 0
    for key, pages in sorted(requests.items(), key=lambda kv: (kv[1][0][0], kv[1][-1][0])):
        first = pages[0][0]
        new = [(b, n) for b, n in pages if b >= end]
        if run and (first > end or len(run) + len(new) > max_parts):
            out.append((sorted(run.items()), keys))
            run, keys, new = {}, [], pages
        run.update(new)
        keys.append(key)
        end = max(end, pages[-1][0] + pages[-1][1])
    if run:
        out.append((sorted(run.items()), keys))
    return out


_SEGMENTS: dict[int, Segments] = {}
_SEGMENTS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child forgets the parent's segment chunks (their retained handles are the parent's, and
    CUDA is unusable after fork); the lock is new, in case a thread of the parent held it."""
    global _SEGMENTS_LOCK
    _SEGMENTS.clear()
    _SEGMENTS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def segments_for(device: int) -> Segments:
    """This process's :class:`Segments` for ``device`` (made once)."""
    seg = _SEGMENTS.get(device)
    if seg is None:
        with _SEGMENTS_LOCK:
            seg = _SEGMENTS.setdefault(device, Segments(device))
    return seg


def release_segments() -> int:
    """Forget every torch page this process has lent in place: each segment chunk is retired on every
    channel that has it (the peer unmaps it once it holds no array in it) and its retained handles
    are released, so pages torch has given back (``torch.cuda.empty_cache``) are freed.

    Returns:
        how many segment chunks were retired.

    Raises:
        CudaError: ``cuMemRelease`` failed.
    """
    with _SEGMENTS_LOCK:
        segs = list(_SEGMENTS.values())
    return sum(seg.release() for seg in segs)
