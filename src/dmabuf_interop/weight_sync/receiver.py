"""The engine's end of weight sync: :class:`WeightReceiver` and the versions it receives."""

from __future__ import annotations

import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from .._worker import DaemonWorker
from ..channel import as_tensors, connect, release_all
from ..errors import DmaBufError, IncompleteVersionError, InvalidArgumentError, ProtocolError
from ._protocol import RECV_STREAMS, _check_meta, _torch

__all__ = ["Batch", "ReceivedVersion", "WeightReceiver"]


@dataclass(slots=True)
class Batch:
    """One batch of a version: ``items`` ((name, tensor) in the trainer's order), on ``stream`` (the
    CUDA stream that waited for the trainer's writes; ``None`` on host pools)."""

    index: int
    items: list[tuple[str, Any]]
    stream: Any
    received: Any = field(default=None, repr=False)


class ReceivedVersion:
    """One version as it arrives: iterate :meth:`batches` (or the object itself for ``(name, tensor)``
    pairs), then :meth:`release` (or leave the ``with`` block) to give it back.

    A tensor is valid until released. When the trainer could not keep the whole version in its pool
    (``keep`` false), batch ``i-1`` is given back as batch ``i`` is taken, so hold on to nothing of a
    batch past the next one. A state dict sent again in the same blocks comes as the tensor objects of
    the last version read whole (Note [kept views]): change none in place (``t.unsqueeze_()``,
    ``t.data = ...``), or the next version comes with that change.

    With a ``prefetch`` worker (``WeightReceiver(prefetch=True)``), batch ``i+1`` is received and made
    into tensors in that thread while the caller uses batch ``i``: see Note [prefetch].

    A version collected unreleased (``for name, t in rx.receive(): ...``) is given back then, as a safety
    net (without a stream synchronisation: release it yourself once the reads queued on its streams are
    done).
    """

    def __init__(self, receiver: "WeightReceiver", timeout: float | None, streams: list[Any],
                 prefetch: DaemonWorker | None = None) -> None:
        self._rx = receiver
        self._timeout = timeout
        self._streams = streams
        self._prefetch = prefetch
        self._ahead: Future[Batch] | None = None  # the next batch, being received by the prefetch worker
        self._held: list[Batch] = []  # changed in place: the safety net below holds this list
        self.version: int | None = None
        self.batches_total: int | None = None
        self.applied = 0  # batches handed out so far
        self._taken = 0  # batches taken from the channel (handed out, or received ahead)
        self._first: dict[str, Any] | None = None
        self._done = False
        self._fresh: dict[str, tuple[Any, str | None, Any, Any]] = {}  # this version's views (Note [kept views])
        # The receiver's table keeps the views made for this version, and each view its item (and so the
        # item's hold): collected unreleased, the channel's own safety net would never give the version back.
        weakref.finalize(self, _abandon, self._held).atexit = False

    def _recv(self, index: int) -> Batch:
        torch = _torch()
        stream = self._streams[index % len(self._streams)] if self._streams else None
        while True:
            batch = self._rx._ch.recv_many(timeout=self._timeout, stream=stream)
            if not isinstance(batch, dict) or not batch:
                release_all(batch)
                raise ProtocolError("weight sync: a batch that is not a state dict")
            meta = _check_meta(next(iter(batch.values())).meta, self._first)
            if "abort" in meta:
                release_all(batch)
                if self._first is None and meta["version"] == self._rx.partial:
                    continue  # the end of a version this engine already stopped reading: skip it
                raise IncompleteVersionError(meta["version"], self.applied, self.batches_total or 0,
                                             f"the trainer aborted: {meta['abort']}")
            if self._first is None and meta["batch"] != 0:
                release_all(batch)  # the rest of a version this engine stopped reading part-way
                continue
            if meta["batch"] != index:
                release_all(batch)
                raise ProtocolError(f"weight sync: batch {meta['batch']} where {index} was due")
            break
        self._taken += 1
        if self._first is None:
            self._first = meta
            self.version, self.batches_total = meta["version"], meta["batches"]
        items = self._tensors(batch, meta.get("dtypes", {}))
        return Batch(index, items, stream, batch)

    def _tensors(self, batch: dict[str, Any], dtypes: dict[str, str]) -> list[tuple[str, Any]]:
        """``(name, tensor)`` for each item of ``batch``: the last version's tensor where the item lies
        where it lay then (Note [kept views]), else a new view, as the dtype ``dtypes`` names for it."""
        torch = _torch()
        kept, fresh = self._rx._views, self._fresh
        items: list[tuple[str, Any]] = []
        new: list[tuple[int, str, Any]] = []
        for name, r in batch.items():
            d = r.descriptor
            hit = kept.get(name)
            # (r._chunk: the mapped chunk the channel made r with; compared by identity, never used)
            if hit is not None and hit[1] == dtypes.get(name) and (
                    hit[0] is d or (hit[3] is r._chunk and hit[0].view_plan == d.view_plan)):
                fresh[name] = hit
                items.append((name, hit[2]))
            else:
                new.append((len(items), name, r))
                items.append((name, None))
        if not new:
            return items
        rs = [r for _, _, r in new]
        if rs[0].device < 0:  # host memory (a host pool), whatever the engine's device
            made = [torch.from_numpy(r.as_array()) for r in rs]
        else:
            with torch.no_grad():
                made = as_tensors(rs)
        for (i, name, r), t in zip(new, made):
            d = dtypes.get(name)
            if d is not None:
                want = getattr(torch, d)
                if want.itemsize != t.element_size():
                    release_all(batch)
                    raise ProtocolError(f"weight sync: {name} travels as {t.dtype}, which is no {d}")
                t = t.view(want) if t.dim() else t.reshape(1).view(want).reshape(())
            fresh[name] = (r.descriptor, d, t, r._chunk)
            items[i] = (name, t)
        return items

    # Note [kept views]
    # ~~~~~~~~~~~~~~~~~
    # A trainer that sends the same state dict every step places it in the same blocks (a kept pool, or
    # the two bucket blocks in turn), and the channel repeats the layout: the same descriptor objects
    # arrive again (the first of a batch is a copy: it carries the batch's meta). A tensor is a view of
    # where its descriptor says in its chunk, so last version's view for the same place (the same
    # descriptor, or an equal view_plan in the same mapped chunk object) is the view now: it is handed out
    # again instead of making one more (an as_strided and a dtype view: ~5 to 7 us a tensor, half of what
    # taking a batch cost; and a chunk's DLPack import per batch). The chunk is compared by identity: a
    # chunk id retired and announced again is another mapping, and a repeated layout names the very chunks
    # it was defined over (a repeat over one retired since is refused). The view keeps its chunk mapped
    # (ChunkRef) while kept. What is kept is what the last version used, no more: the table is replaced
    # when a version ends whole, and dropped with the receiver. The same tensor object then reaches the
    # loader every step; it is valid, as any tensor handed out, until its version is released. A kept view
    # holds the item it was made for (its DLPack owner), so the channel's safety net would never give back
    # a version collected unreleased whose views were made for it and kept: its own finalizer does (_abandon).

    def batches(self) -> Iterator[Batch]:
        """Each batch of the version as it arrives.

        Raises:
            IncompleteVersionError: the trainer aborted, the channel ended or a batch broke the protocol
                after a first batch was handed out (``applied`` says how many).
            ProtocolError, PeerClosedError, WaitTimeoutError: the same before any batch was handed out.
        """
        if self._done:
            raise InvalidArgumentError("this version was read already")
        index = 0
        try:
            while self.batches_total is None or index < self.batches_total:
                try:
                    b = self._next(index)
                except IncompleteVersionError:
                    raise
                except DmaBufError as exc:
                    if self.applied == 0:
                        raise
                    raise IncompleteVersionError(self.version or 0, self.applied, self.batches_total or 0,
                                                 f"{type(exc).__name__}: {exc}") from exc
                self._held.append(b)
                self.applied += 1
                if not self._first["keep"] and len(self._held) > 1:  # type: ignore[index]
                    # The trainer reuses its pool: batch i-1 goes back as batch i is taken (the caller asked
                    # for batch i, so it is done with i-1), before i+1 is asked for, which the trainer stages
                    # in i-1's place.
                    old = self._held.pop(0)
                    old.items = []
                    release_all(old.received)
                if self._prefetch is not None and index + 1 < (self.batches_total or 0):
                    self._ahead = self._prefetch.submit(self._recv, index + 1)
                yield b
                index += 1
        except IncompleteVersionError:
            self._rx.partial = self.version
            self.release()
            raise
        self._done = True
        self._rx._views = self._fresh
        self._rx.version, self._rx.partial = self.version, None

    # Note [prefetch]
    # ~~~~~~~~~~~~~~~
    # An engine's loader copies each tensor (vLLM's and SGLang's load_weights): about 10 us of launch a tensor
    # on an H200 host. With a prefetch worker, batch i+1 is taken in one thread while the caller loads batch
    # i. Both hold the GIL most of the time, and torch lets it go around every op, so the two threads hand it
    # back and forth. Measured on ws-8b (399 tensors, 9 batches, the vllm-backend path, one H200): while
    # taking a batch cost as much as loading it (~14 us a tensor), the overlap gained a little (1.2 to 1.4 ms
    # a batch instead of 1.4 to 1.6). Once taking a batch cost ~6 us a tensor (Note [kept views]), a step took
    # 11.2 ms with the worker and 10.4 ms without, in one run. So it is off by default. When on, the worker
    # never reads past the version's last batch (the next version's first batch stays in the channel), and
    # a batch it took is owned by this version: release() and drain() wait for it (within the timeout of a
    # batch) and give it back with the rest. Its stream wait (recv_many's stream=) may be queued before
    # batch i's copies on a shared stream: that only orders them after a write of the trainer that is
    # complete before batch i+1 was sent, never before one.

    @property
    def taken(self) -> int:
        """Batches of this version taken from the channel so far: handed out, or received ahead."""
        return self._taken

    def _next(self, index: int) -> Batch:
        """Batch ``index``: the one the prefetch worker took, else one taken now."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return self._recv(index)
        return ahead.result(self._wait())

    def _wait(self) -> float | None:
        # The worker's recv_many is bounded by the batch timeout itself; the margin covers making the tensors.
        return None if self._timeout is None else self._timeout + 30.0

    def _settle(self) -> None:
        """Wait for a batch the prefetch worker is taking, and hold it (to be given back with the rest)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            self._held.append(ahead.result(self._wait()))
        except Exception:  # noqa: BLE001 - the version is being given up; _recv released what it took
            pass

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for b in self.batches():
            yield from b.items

    def drain(self) -> None:
        """Take and give back the rest of this version without using it (after the engine's loader failed
        part-way), so that a trainer reusing its pool for the remaining buckets is not left waiting;
        stops at the version's last batch, an abort, anything else, or the timeout."""
        self.release()
        last = (self.batches_total or 0) - 1
        index = self._taken
        while self.version is not None and index <= last:
            try:
                batch = self._rx._ch.recv_many(timeout=self._timeout)
            except DmaBufError:
                return
            meta = next(iter(batch.values())).meta if isinstance(batch, dict) and batch else None
            release_all(batch)
            if (not isinstance(meta, dict) or meta.get("version") != self.version or "abort" in meta
                    or meta.get("batch") == last):
                return
            index += 1

    def release(self) -> None:
        """Give back every batch still held (one stream synchronisation per stream), then a batch the
        prefetch worker is taking (the trainer may be waiting for the first to send the second). A version
        given back before its last batch was read is skipped, rest and abort alike, by the next receive."""
        if not self._done and self.version is not None:
            self._rx.partial = self.version
        self._give_back_held()
        self._settle()
        self._give_back_held()

    def _give_back_held(self) -> None:
        held = self._held[:]
        self._held.clear()
        rec = []
        for b in held:
            b.items = []
            rec += b.received.values()
        if rec:
            release_all(rec)

    def __enter__(self) -> "ReceivedVersion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _abandon(held: list[Batch]) -> None:
    """A :class:`ReceivedVersion` collected with batches held: give them back as the channel's safety net
    does (its views live on in the receiver's table, and hold the items)."""
    for b in held:
        b.items = []
        for hold in {r._hold for r in b.received.values()}:
            hold.abandon()
    held.clear()


class WeightReceiver:
    """The engine's end: a channel to the trainer's :class:`WeightPublisher`.

    Args:
        address: the publisher's address.
        device: CUDA ordinal the engine's model is on (imports are mapped there); ``None`` for a host pool.
        timeout: seconds to connect, and the default wait for a version (``None``: no limit).
        wait: retry while nothing listens yet (an engine started before its trainer).
        allow_uids, allow_gids: trainers allowed besides this uid.
        streams: CUDA streams that batches are loaded on in turn (default: :data:`RECV_STREAMS` new ones on
            ``device``).
        prefetch: take the next batch in a worker thread while the caller loads one (Note [prefetch]: it
            costs more than it gains where taking a batch is cheap, so it is off by default).

    Raises:
        SyscallError, PeerRefusedError, WaitTimeoutError: as :func:`~dmabuf_interop.channel.connect`.
    """

    def __init__(self, address: str, *, device: int | None = None, timeout: float | None = 60.0,
                 wait: bool = False, allow_uids: Iterable[int] | None = None, allow_gids: Iterable[int] | None = None,
                 streams: list[Any] | None = None, prefetch: bool = False) -> None:
        self.host = device is None
        self.device = device
        self.timeout = timeout
        if streams is None and not self.host:
            torch = _torch()
            streams = [torch.cuda.Stream(device) for _ in range(RECV_STREAMS)]
        self._streams = list(streams or [])
        self._ch = connect(address, timeout=timeout, device=device, wait=wait, allow_uids=allow_uids,
                           allow_gids=allow_gids)
        self._prefetch = DaemonWorker("dmabuf-interop-prefetch") if prefetch else None
        #: The last version received whole, and a version stopped part-way after it (``None``: none).
        self.version: int | None = None
        self.partial: int | None = None
        #: name -> (descriptor, dtype asked, tensor, chunk) of the last version read whole (Note [kept views]).
        self._views: dict[str, tuple[Any, str | None, Any, Any]] = {}

    def receive(self, *, timeout: float | None = None) -> ReceivedVersion:
        """The next version, read batch by batch as it is iterated (``timeout`` per batch)."""
        return ReceivedVersion(self, self.timeout if timeout is None else timeout, self._streams, self._prefetch)

    def load(self, load_weights: Callable[[list[tuple[str, Any]]], Any], *, timeout: float | None = None) -> int:
        """Receive a version and hand each batch to ``load_weights`` (vLLM's and SGLang's
        ``model.load_weights``: it copies), on the batch's stream; give the version back once every
        copy is complete (a stream synchronisation). Returns the version.

        Raises:
            IncompleteVersionError: the version stopped part-way, or ``load_weights`` raised, after a first
                batch was applied (``applied`` says how many; the model then mixes two versions).
            ProtocolError: a batch broke the protocol before anything was applied (the peer's fault).
            PeerClosedError: the trainer went before anything was applied.
            WaitTimeoutError: no batch within ``timeout``.
        """
        torch = _torch()
        rv = self.receive(timeout=timeout)
        with rv:
            for b in rv.batches():
                try:
                    if b.stream is not None:
                        with torch.cuda.stream(b.stream), torch.no_grad():
                            load_weights(b.items)
                    else:
                        with torch.no_grad():
                            load_weights(b.items)
                except Exception as exc:
                    self.partial = rv.version
                    rv.drain()
                    reason = (f"load_weights raised {type(exc).__name__} on batch {b.index} (part of it may be "
                              f"applied): {exc}")
                    raise IncompleteVersionError(rv.version or 0, rv.applied - 1, rv.batches_total or 0,
                                                 reason) from exc
        return rv.version  # type: ignore[return-value]

    def load_into(self, module: Any, *, timeout: float | None = None, strict: bool = True) -> int:
        """Receive a version and copy it into ``module``'s parameters and buffers of the same names and
        shapes, in place. Returns the version.

        ``strict`` refuses a name the version has and the module lacks. Unlike ``torch``'s ``load_state_dict``, it
        does not refuse the converse: a name the module has and the version lacks keeps its value (a version may
        carry a subset, and a module's non-persistent buffers are in no state dict). Compare the version's names
        with the module's where a missing one must fail.

        Raises:
            IncompleteVersionError: a name the module lacks (``strict``), a shape that differs, or a version
                that stopped part-way; ``applied`` says how many batches were copied before.
        """
        own = dict(module.named_parameters())
        own.update(module.named_buffers())

        def copy(items: list[tuple[str, Any]]) -> None:
            for name, t in items:  # checked before any copy of the batch
                p = own.get(name)
                if p is None and strict:
                    raise InvalidArgumentError(f"the module has no {name}")
                if p is not None and tuple(p.shape) != tuple(t.shape):
                    raise InvalidArgumentError(f"{name}: shape {tuple(t.shape)} for {tuple(p.shape)}")
            for name, t in items:
                if name in own:
                    own[name].data.copy_(t, non_blocking=True)

        return self.load(copy, timeout=timeout)

    def close(self) -> None:
        """Close the channel (a version still held is given back by the channel) and the prefetch worker."""
        self._views = {}
        self._ch.close()
        if self._prefetch is not None:
            self._prefetch.shutdown(timeout=10.0)  # a recv_many of its ends with the channel, at once

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
