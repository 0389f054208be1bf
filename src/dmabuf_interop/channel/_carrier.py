"""How a chunk crosses a connection: the carrier of an AF_UNIX channel (fds by ``SCM_RIGHTS``), and the
imported chunk with its reference count.

A carrier is the one part of a :class:`~.channel.Channel` that differs between transports
(:mod:`.remote.carrier` is the other: NIXL registrations and ``READ`` for ``tcp://``). It builds the
message that announces one of our chunks (the channel sends it), imports a chunk the peer announced
(:class:`~._state.ChunkAnnounced`), and turns a received message into :class:`~.received.Received`
objects. Carriers return messages and never send.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from .. import _driver as driver  # (at module level: an import in a function costs a send ~1.5 us)
from ..errors import DmaBufError, InvalidArgumentError, ProtocolError
from ..fd import OwnedFd
from ._state import ChunkAnnounced
from ._torch_views import bulk
from .protocol import ArrayDescriptor
from .received import Hold, Received

__all__ = ["FdCarrier", "ImportedChunk", "mechanism_for"]


def mechanism_for(chunk_device_uuid: str, importer_gpus: Sequence[str]) -> str:
    """The mechanism an importer uses for a chunk: ``memfd`` (host), ``posix-fd`` (device).

    dma-buf import (``cuImportExternalMemory`` of ``DMABUF_FD``) would be the
    hook for device pairs where it works; the drivers measured so far answer
    ``CUDA_ERROR_NOT_SUPPORTED``, so device chunks use POSIX-fd handles.
    """
    if not chunk_device_uuid:
        return "memfd"
    return "posix-fd"


class ImportedChunk:
    """An importer's mapping of one peer chunk; unmapped when retired and no Received uses it.

    Its references are a list, one item per holder (a queued arrival, a Received's hold, a view's
    :class:`.arrays.ChunkRef`): ``list.append`` and ``list.pop`` are each atomic, so taking and dropping one is a
    single call, not a hold of a lock (load-bearing: a hand-off takes two and drops two, a consumer's wake-up to
    ``recv``'s return pays for the first two, 0.1-0.2 us each with a lock). Whoever sees the chunk retired with
    no reference left closes it; :attr:`_close` is claimed once (``list.pop``), so retire and the last release,
    racing, close it once."""

    __slots__ = ("id", "size", "buf", "ptr", "read_only", "device", "mapping", "_holders", "retired", "_close")

    def __init__(self, chunk_id: int, size: int, buf: Any) -> None:
        self.id = chunk_id
        self.size = size
        self.buf = buf  # ImportedBuffer
        self.ptr: int = buf.ptr  # the mapping's address (read once: ``buf.ptr`` checks it is open, 3 calls)
        # A memfd the peer sealed against writing is mapped PROT_READ: its host views refuse writes.
        self.read_only: bool = getattr(buf, "read_only", False)
        self.device: int = buf.device  # -1: host
        # A host chunk's mmap, which a host view holds too (read once: two attribute hops a view), else None.
        mapping = getattr(buf, "_mapping", None)
        self.mapping: Any = None if mapping is None else mapping.map
        self._holders: list[None] = []
        self.retired = False
        self._close = [None]

    @property
    def is_host(self) -> bool:
        return self.device < 0

    @property
    def refs(self) -> int:
        """The references held."""
        return len(self._holders)

    def retain(self) -> None:
        self._holders.append(None)

    def release(self) -> None:
        holders = self._holders
        try:
            holders.pop()
        except IndexError:  # (a release with no reference taken: nothing to drop)
            return
        # (the pop before the look at ``retired``: a retire in between sees no reference left, or this sees it)
        if self.retired and not holders:
            self._close_once()

    def retire(self) -> None:
        self.retired = True
        if not self._holders:  # (after ``retired`` is set: a last release in between sees it, or this sees none)
            self._close_once()

    def _close_once(self) -> None:
        try:
            self._close.pop()
        except IndexError:  # closed already (the other of a racing retire and release)
            return
        self.buf.close()


class FdCarrier:
    """Chunks by fd (``SCM_RIGHTS``) on an AF_UNIX channel: a ``chunk`` message with one fd per part;
    imported as a memfd mapping (host) or POSIX-fd VMM handles (``cuMemImportFromShareableHandle``,
    device, mapped on ``device`` or on the chunk's own GPU found by UUID).

    Args:
        device: the CUDA ordinal device chunks are mapped on (``None``: the chunk's own GPU).
    """

    transport = "fd"
    #: Device arrays in torch's expandable segments may be lent in place (:mod:`.segments`).
    share_segments = True
    #: The Received of a batch lie where its layout says (runs of like items are cut from one view each).
    views_follow_layout = True
    #: The ordering every send uses whatever the caller asks (``None``: the caller's or the channel's).
    forced_ordering: str | None = None
    #: Whether the channel reads its socket in a background thread from the start.
    reader_at_start = False

    def __init__(self, device: int | None) -> None:
        self.device = device
        self._opened_events: dict[bytes, Any] = {}  # IPC event handle -> CUevent, opened once

    @contextlib.contextmanager
    def announce(self, block: Any) -> Iterator[tuple[dict[str, Any], list[int]]]:
        """The ``chunk`` message for ``block``'s chunk and its fds, one per part (owned by the chunk;
        open while the context lasts)."""
        with block.chunk.fds() as fds:
            yield block.chunk.describe(), fds

    def retire(self, chunk_id: int) -> None:
        """Our chunk ``chunk_id`` is going: nothing to undo here (the peer unmaps it on ``retire``)."""

    def import_chunk(self, event: ChunkAnnounced, fds: list[int]) -> ImportedChunk:
        """Map the chunk the peer announced; takes the fds over (``fds`` is emptied).

        Raises:
            ProtocolError: the fds are not what the message says (not a memfd, unsealed, smaller than
                announced, ...), or the chunk's GPU is not visible here.
            DmaBufError: the import failed here (no fd or address space left, a driver error).
        """
        msg = event.msg
        cid, size = msg["chunk"], msg["size"]
        owned = [OwnedFd(fd) for fd in fds]
        fds.clear()
        try:
            if msg["mechanism"] == "memfd":
                from ..mechanisms.memfd import import_memfd

                buf = import_memfd(owned[0], size)
            else:  # one part (a pool chunk) or pages mapped back to back (torch's expandable segments)
                from ..mechanisms.posix_fd import import_posix_fd_parts

                buf = import_posix_fd_parts(owned, msg["parts"], self._import_device(msg["device_uuid"]))
        except InvalidArgumentError as exc:  # not a memfd, unsealed, smaller than announced, ...
            raise ProtocolError(f"chunk {cid} rejected: {exc}") from exc
        finally:
            for fd in owned:
                fd.close()
        return ImportedChunk(cid, size, buf)

    def _import_device(self, uuid: str) -> int:
        if self.device is not None:
            return self.device
        from .protocol import visible_gpu_uuids

        gpus = visible_gpu_uuids(initialise=True)
        if uuid not in gpus:
            raise ProtocolError(f"chunk lives on GPU {uuid}, which this process cannot see; "
                                f"connect with device=N to map it on another GPU")
        return gpus.index(uuid)

    def make_received(self, channel: Any, lease_id: int, descs: list[ArrayDescriptor], stream: int,
                      ordering: str | None, chunks: dict[int, Any]) -> list[Received]:
        """The Received of one message. ``chunks``: the chunks the descriptors name, by id, retained while
        the message waited in the queue (so a ``retire``, or the end of the connection, that came after it
        leaves them mapped); the hold takes them over. With ordering ``event``, ``stream`` is made to wait
        on the producer's event (``cuIpcOpenEventHandle`` once per handle, ``cuStreamWaitEvent``)."""
        # The hold takes over the queue's references on the chunks.
        hold = Hold(channel, lease_id, list(chunks.values()), len(descs), stream, ordering, adopt=True)
        if len(descs) == 1:  # (one array: no context manager, no comprehension)
            d = descs[0]
            out = [Received(hold, d, chunks[d.chunk])]
        else:
            with bulk(len(descs)):
                out = [Received(hold, d, chunks[d.chunk]) for d in descs]
        # The item whose event the stream waits on (one covers every item of the message): a repeat's ordering is
        # every item's, else each item has its own (as Received.ordering says).
        if ordering is not None:
            r = out[0] if ordering == "event" else None
        else:
            r = next((x for x in out if x.descriptor.ordering == "event"), None)
        if r is not None:
            raw = r.descriptor.event_handle()
            driver.set_current(r.device)
            ev = self._opened_events.get(raw)
            if ev is None:
                ev = driver.ipc_open_event_handle(raw)
                self._opened_events[raw] = ev
            driver.stream_wait_event(stream, ev)
        return out

    def on_end(self) -> None:
        """The connection ended (the reader's thread): nothing to stop here."""

    def close(self) -> None:
        """Destroy the IPC events opened (``cuEventDestroy``)."""
        if self._opened_events:
            for ev in self._opened_events.values():
                try:
                    driver.event_destroy(ev)
                except DmaBufError:
                    pass
            self._opened_events.clear()
