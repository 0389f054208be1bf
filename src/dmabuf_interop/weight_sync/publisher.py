"""The trainer's end of weight sync: :class:`WeightPublisher`."""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

from ..channel import SharedPool, listen
from ..errors import DmaBufError, IncompleteVersionError, InvalidArgumentError, PoolExhaustedError, WaitTimeoutError
from ._protocol import ABORT_ITEM, DTYPES, MAX_BATCH_ITEMS, PROTOCOL, _aligned, _carrier, _chunk_for, _dtype_name, \
    _segments_asked, _torch

__all__ = ["PublishReport", "WeightPublisher"]

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class PublishReport:
    """What :meth:`WeightPublisher.publish` sent: ``bytes`` in all, ``staged_bytes`` of them copied into
    the pool, ``batches`` per engine, ``engines`` that received it, ``kept`` whether the staging was kept
    (the version fitted in the pool)."""

    version: int
    tensors: int
    bytes: int
    staged_bytes: int
    batches: int
    engines: int
    kept: bool


@dataclass(slots=True)
class _Item:
    name: str
    src: Any  # the caller's tensor
    nbytes: int
    dtype: str
    staged: bool
    send: Any = None  # what goes on the channel (the tensor, its staging copy, or a carrier view of either)


@dataclass(slots=True)
class _Last:
    """The last version's items and batches, used again while the caller hands over the same tensors
    (the same objects, alive, with the same data pointer, shape, strides and dtype): checking that costs well
    under a microsecond a tensor, working the items out again several (a load-bearing speed trick: 3.3 ms of
    the trainer's 399-tensor update went there before the first batch left). Between versions nothing here
    holds the caller's memory: the tensors are referred to weakly and each item's ``src`` is dropped."""

    sig: list[tuple[str, Any, int, Any, Any, Any]]  # (name, weakref to the caller's tensor, data_ptr, shape,
    items: list[_Item]                              #  strides, dtype)
    batches: list[list[_Item]] | None = None  # the plan, when the version's staging was kept


class WeightPublisher:
    """The trainer's end: a pool, a listener, and one channel per engine that connected.

    Args:
        address: a socket path, or ``"@name"`` (abstract), as :func:`~dmabuf_interop.channel.listen`.
        device: CUDA ordinal of the pool, ``None`` for a host pool.
        max_bytes: most bytes the pool exports (a version larger than it goes in buckets).
        chunk_bytes: bytes per pool chunk (default: an eighth of ``max_bytes`` in whole 2 MiB, at least 2 MiB).
        pool: a pool to use instead of a new one (the trainer's parameters may live in it).
        allow_uids, allow_gids: engines allowed besides this uid (``SO_PEERCRED``).
        timeout: seconds any wait on an engine may take (``None``: no limit).
        stream_batches: a version is cut into about this many batches after a first of a sixteenth of its
            bytes, so an engine loads one batch while the next is handed over (1: one batch where it fits).
        lend_segments: hand CUDA tensors outside the pool to the channel, which lends torch's
            expandable-segment pages in place (default: when ``PYTORCH_CUDA_ALLOC_CONF`` asks for them).

    Raises:
        InvalidArgumentError: bad sizes or address; SyscallError: the socket could not be made;
        NoDriverError: a device pool where CUDA is unavailable.
    """

    def __init__(self, address: str, *, device: int | None = None, max_bytes: int = 1 << 30,
                 chunk_bytes: int | None = None, pool: SharedPool | None = None, allow_uids: Iterable[int] | None = None,
                 allow_gids: Iterable[int] | None = None, timeout: float | None = 60.0, stream_batches: int = 8,
                 lend_segments: bool | None = None) -> None:
        if isinstance(stream_batches, bool) or not isinstance(stream_batches, int) or stream_batches < 1:
            raise InvalidArgumentError(f"stream_batches must be an int >= 1, got {stream_batches!r}")
        if chunk_bytes is not None and pool is None and -(-chunk_bytes // 256) * 256 > max_bytes:
            raise InvalidArgumentError(f"chunk_bytes {chunk_bytes}, rounded up to 256 bytes, exceeds max_bytes "
                                       f"{max_bytes}: no chunk would fit")
        self._own_pool = pool is None
        self.pool = pool if pool is not None else SharedPool(
            device, max_bytes=max_bytes, chunk_bytes=chunk_bytes or _chunk_for(max_bytes))
        try:
            self._listener = listen(address, pool=self.pool, allow_uids=allow_uids, allow_gids=allow_gids)
        except BaseException:
            if self._own_pool:
                self.pool.close()
            raise
        self.address = address
        self.timeout = timeout
        self.stream_batches = stream_batches
        self.lend_segments = _segments_asked() if lend_segments is None else bool(lend_segments)
        self._channels: list[Any] = []
        self._leases: list[Any] = []
        self._kept: dict[str, Any] = {}  # name -> staging tensor, while a version fits in the pool
        self._kept_key: tuple[Any, ...] | None = None
        self._last: _Last | None = None
        # A bucketed version's staging: two blocks that take the batches in turn (see _buckets).
        self._bucket: list[Any] | None = None  # the two as flat uint8 tensors, kept from version to version
        self._bucket_key: tuple[Any, ...] | None = None  # the layout that went in buckets
        self._lock = threading.Lock()

    # --- engines ---------------------------------------------------------------------------

    @property
    def engines(self) -> int:
        """Engines connected now (a channel whose connection ended is not counted)."""
        return sum(not ch.closed for ch in self._channels)

    def _drop(self, ch: Any) -> None:
        """Close an engine's channel at once and forget it (the other engines go on)."""
        ch.close(timeout=0)
        self._channels.remove(ch)

    def _prune(self) -> None:
        """Drop the channels whose connection ended (an engine that went, even by SIGKILL): their leases
        completed as ``"disconnected"``."""
        for ch in [ch for ch in self._channels if ch.closed]:
            self._drop(ch)

    def accept(self, timeout: float | None = 60.0) -> None:
        """Take the next engine's connection (its peer checked; :meth:`Listener.accept`'s errors)."""
        ch = self._listener.accept(timeout=timeout)
        with self._lock:
            self._channels.append(ch)

    def accept_while(self, call: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run ``call`` in a thread and take every engine that connects until it returns, then its result.

        For a control plane that tells engines to connect and returns once they have (vLLM's
        ``init_weight_transfer_engine``). An engine's ``connect`` returns once it has sent its hello, so
        handshakes still running here when ``call`` returns are waited for (within ``timeout``).

        Raises:
            WaitTimeoutError: ``call`` still running after ``timeout``; whatever ``call`` raised.
        """
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                out["error"] = exc

        worker = threading.Thread(target=run, name="dmabuf-interop-accept-while", daemon=True)
        worker.start()
        from .._time import deadline_after, remaining

        deadline = deadline_after(timeout)
        while worker.is_alive():
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise WaitTimeoutError(f"the control-plane call did not return within {timeout} s")
            try:
                self.accept(timeout=0.05 if left is None else min(0.05, left))
            except WaitTimeoutError:
                pass
        # The engines' connect() returns once they have sent their hello, before this side has checked it:
        # take the connections queued as the call returned and those whose handshake is still running.
        while True:
            left = remaining(deadline)
            pending = self._listener.handshaking > 0 and (left is None or left > 0)
            try:
                self.accept(timeout=(0.05 if left is None else min(0.05, left)) if pending else 0)
            except WaitTimeoutError:
                if not pending:
                    break
        if "error" in out:
            raise out["error"]
        return out.get("value")  # type: ignore[return-value]

    # --- versions ------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every engine gave the last version back (then its memory may be written).

        Raises:
            WaitTimeoutError: not within ``timeout`` (default: the publisher's).
        """
        t = self.timeout if timeout is None else timeout
        for lease in self._leases:
            lease.wait(t)
        self._leases = []

    @staticmethod
    def _pairs(state: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[Any]:
        return list(state.items() if isinstance(state, Mapping) else state)

    def _again(self, pairs: list[Any]) -> _Last | None:
        """The last version's :class:`_Last` if ``pairs`` hands over the very same tensors, unchanged."""
        last = self._last
        if last is None or len(pairs) != len(last.sig):
            return None
        for pair, (name, ref, ptr, shape, strides, dtype) in zip(pairs, last.sig):
            t = ref()
            if (t is None or type(pair) is not tuple or len(pair) != 2 or pair[0] != name or pair[1] is not t
                    or t.data_ptr() != ptr or t.shape != shape or t.stride() != strides or t.dtype != dtype):
                return None
        return last

    def _items(self, pairs: list[Any]) -> list[_Item]:
        torch = _torch()
        host = self.pool.is_host
        items: list[_Item] = []
        seen: set[str] = set()
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidArgumentError(f"a state dict is name -> tensor, or (name, tensor) pairs; got {pair!r}")
            name, t = pair
            if not isinstance(name, str) or not name or len(name) > 4096 or name == ABORT_ITEM or name in seen:
                raise InvalidArgumentError(f"tensor names must be distinct non-empty str of at most 4096 "
                                           f"characters, got {name!r}")
            seen.add(name)
            if not isinstance(t, torch.Tensor) or hasattr(t, "device_mesh"):
                raise InvalidArgumentError(f"{name}: a torch.Tensor is needed (a DTensor materialised with "
                                           f"full_tensor()), got {type(t).__name__}")
            if t.is_meta:
                raise InvalidArgumentError(f"{name}: a meta tensor has no data to send")
            if t.is_nested or t.layout is not torch.strided:  # (no one strided storage to copy or lend)
                kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
                raise InvalidArgumentError(f"{name}: a {kind} tensor cannot be sent: only strided (dense) tensors "
                                           f"can (tensor.to_dense())")
            dtype = _dtype_name(t.dtype)
            if dtype not in DTYPES:
                raise InvalidArgumentError(f"{name}: dtype {dtype} cannot be sent (choose from {', '.join(DTYPES)})")
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            on_pool_device = (t.device.type == "cpu") if host else (t.device.type == "cuda"
                                                                    and t.device.index == self.pool.device)
            in_pool = (on_pool_device and t.is_contiguous() and nbytes > 0
                       and self.pool.find(t.data_ptr(), nbytes) is not None)
            lent = (not host and t.device.type == "cuda" and self.lend_segments and t.is_contiguous())
            items.append(_Item(name, t, nbytes, dtype, staged=not (in_pool or lent)))
        if not items:
            raise InvalidArgumentError("an empty state dict: nothing to publish")
        self._last = _Last([(n, weakref.ref(t), t.data_ptr(), t.shape, t.stride(), t.dtype) for n, t in pairs], items)
        return items

    def _wire(self, torch: Any, item: _Item, t: Any) -> Any:
        carrier = _carrier(torch, item.dtype, self.pool.is_host)
        if carrier is not None:
            t = t.view(carrier) if t.dim() else t.reshape(1).view(carrier).reshape(())
        return t.numpy() if self.pool.is_host else t  # a host pool's channel reads NumPy arrays

    def _block(self, torch: Any, nbytes: int, timeout: float | None) -> Any:
        """A pool block of ``nbytes`` bytes as a flat uint8 tensor (``timeout=0``: only if there is room now)."""
        flat = self.pool.empty((nbytes,), "uint8", timeout=timeout)
        return torch.from_numpy(flat) if self.pool.is_host else torch.from_dlpack(flat)

    @staticmethod
    def _shaped(buf: Any, item: _Item) -> Any:
        """The start of the flat uint8 tensor ``buf`` viewed as ``item.src`` is shaped."""
        return buf[:item.nbytes].view(item.src.dtype).view(item.src.shape)

    def _stage(self, torch: Any, item: _Item, timeout: float | None) -> Any:
        """A pool block shaped like ``item.src`` (``timeout=0``: only if there is room now)."""
        return self._shaped(self._block(torch, max(item.nbytes, 1), timeout), item)

    def _room(self) -> int:
        """Bytes a bucketed version may stage per batch: half of the pool's free bytes (this publisher's
        bucket staging counted as free), rounded down to 256 bytes, and to the chunk granularity of a device
        pool from one granule up."""
        own = 0 if self._bucket is None else sum(int(b.numel()) for b in self._bucket)
        return self._rounded((self.pool.max_bytes - self.pool.used_bytes + own) // 2)

    def _plan(self, items: list[_Item], half: int | None) -> list[list[_Item]]:
        """Batches in order: a first of 1/16 of the bytes, then ``stream_batches`` of about equal bytes,
        none over :data:`MAX_BATCH_ITEMS`, and (``half``: staging not kept) none staging more than ``half``."""
        total = sum(i.nbytes for i in items)
        n = self.stream_batches
        first = total / 16 if n > 1 else total
        each = (total - first) / n if n > 1 else total
        out: list[list[_Item]] = [[]]
        filled = staged = 0
        for it in items:
            cut = len(out[-1]) >= MAX_BATCH_ITEMS or (out[-1] and filled >= first + each * (len(out) - 1))
            if half is not None and out[-1] and staged + _aligned(it.nbytes) > half:
                cut = True
            if cut:
                out.append([])
                staged = 0
            out[-1].append(it)
            filled += it.nbytes
            if it.staged:
                staged += _aligned(it.nbytes)
        return out

    def _keep(self, torch: Any, items: list[_Item]) -> bool:
        """Staging for every staged item, kept from version to version while the layout is the same;
        ``False`` where it does not all fit in the pool now (the version then goes in buckets)."""
        key = tuple((i.name, i.dtype, tuple(i.src.shape), i.staged) for i in items)
        if key == self._kept_key:
            return True
        if key == self._bucket_key:
            return False  # it did not fit before: trying again each version would cost as much as it saves
        self._kept, self._kept_key = {}, None
        self._bucket, self._bucket_key = None, None
        if any(it.staged and it.nbytes > self.pool.max_bytes for it in items):
            self._bucket_key = key  # one never fits: the bucket path says which, and what the pool would need
            return False
        kept: dict[str, Any] = {}
        try:
            for it in items:
                if it.staged:
                    kept[it.name] = self._stage(torch, it, timeout=0)
        except PoolExhaustedError:
            self._bucket_key = key
            return False
        self._kept, self._kept_key = kept, key
        return True

    def _buckets(self, torch: Any, items: list[_Item]) -> tuple[list[Any], int]:
        """The bucket staging: two blocks of ``size`` bytes, kept while they hold the largest item, that take
        the batches in turn (batch ``b`` in block ``b % 2``, once the engines gave batch ``b - 2`` back), with ``size``
        the largest of half the room (:meth:`_room`), its halvings and ``floor`` (the largest staged item) for which
        the pool has them now: one block of twice the size cut in two, or two blocks. Returns the two and ``size``.
        Two blocks for the whole version, not one per item: items of a batch spread over several chunks
        could leave no hole for the next batch's largest item in any of them, though half the pool was
        free (ws-8b's 1.2 GB lm_head waited for room that never came in a 4 GiB pool).

        Raises:
            InvalidArgumentError: the largest staged item is larger than half the room (it could never go).
            PoolExhaustedError: not even two blocks of ``floor`` fit now.
        """
        half = self._room()
        big = max((i for i in items if i.staged), key=lambda i: i.nbytes, default=None)
        floor = 256 if big is None else _aligned(big.nbytes)
        if big is not None and floor > half:  # it could never go: nothing is sent
            raise InvalidArgumentError(
                f"{big.name} ({big.nbytes} bytes) needs a pool of at least twice its size: "
                f"{half * 2} bytes are free of max_bytes {self.pool.max_bytes}")
        if self._bucket is not None and int(self._bucket[0].numel()) >= floor:
            return self._bucket, int(self._bucket[0].numel())  # kept: no new chunk, no new export
        self._bucket = None  # (the only reference: its blocks are free for the tries below)
        size = half
        while size >= floor:
            halves = self._two_blocks(torch, size)
            if halves is not None:
                self._bucket = halves
                return halves, size
            if size == floor:
                break
            size = max(floor, self._rounded(size // 2))
        raise PoolExhaustedError(
            f"no room to stage a bucketed version: it needs two free blocks of at least {floor} bytes "
            f"(its largest staged tensor), and the pool has none now ({self.pool.used_bytes} of "
            f"max_bytes {self.pool.max_bytes} in use)")

    def _two_blocks(self, torch: Any, size: int) -> list[Any] | None:
        try:
            both = self._block(torch, 2 * size, 0)
            return [both[:size], both[size:]]
        except (PoolExhaustedError, InvalidArgumentError):  # no hole or chunk that large: two apart
            pass
        try:
            return [self._block(torch, size, 0), self._block(torch, size, 0)]
        except (PoolExhaustedError, InvalidArgumentError):
            return None

    def _rounded(self, n: int) -> int:
        """``n`` rounded down to 256 bytes, and to the chunk granularity of a device pool from one granule up."""
        n = n // 256 * 256
        if not self.pool.is_host:
            from ..mechanisms.posix_fd import granularity

            g = granularity(self.pool.device)
            n = n // g * g if n >= g else n
        return n

    def publish(self, state: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int, *,
                stream: Any = None, timeout: float | None = None) -> PublishReport:
        """Send ``state`` (name -> tensor, or (name, tensor) pairs; an iterator is consumed first) as
        ``version`` to every connected engine.

        Waits first for the previous version to be given back. Copies into the pool run on ``stream``
        (default: torch's current stream of the pool's GPU); the engines' streams wait for them.

        Raises:
            InvalidArgumentError: not tensors (or meta, sparse or nested tensors), unsupported dtypes, duplicate
                names, no engine connected, a staged tensor larger than half the pool (nothing was sent).
            IncompleteVersionError: sending stopped after a first batch went out (engines were told).
            WaitTimeoutError: an engine did not give a version back in time (before anything of this version
                was sent).
            PoolExhaustedError: a version that goes in buckets found no two free blocks of its largest staged
                tensor's size (nothing was sent).
            PeerClosedError: the last engine went (before anything of this version was sent). An engine that
                goes while others stay is dropped, and the version goes on to the others
                (:attr:`PublishReport.engines`).
        """
        torch = _torch()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"version must be an int >= 0, got {version!r}")
        self._prune()
        if not self._channels:
            raise InvalidArgumentError("no engine is connected: accept() first")
        t = self.timeout if timeout is None else timeout
        pairs = self._pairs(state)
        last = self._again(pairs)
        self._last = None  # set again below once this version's items and plan are made
        if last is not None:
            items = last.items
            for it, pair in zip(items, pairs):
                it.src = pair[1]  # detached batch by batch, below
        else:
            items = self._items(pairs)
        try:
            self.wait(t)
            host = self.pool.is_host
            if stream is None and not host:
                stream = torch.cuda.current_stream(self.pool.device)
            # The same items as last time with their staging kept: the kept key and the plan stand.
            keep = (last is not None and last.batches is not None) or self._keep(torch, items)
            half = bucket = None
            if not keep:
                bucket, half = self._buckets(torch, items)
            batches = last.batches if last is not None and last.batches is not None else self._plan(items, half)
            sent_leases: list[list[Any]] = []  # per batch, one lease per engine
            self._last = last or self._last
            if self._last is not None:
                self._last.batches = batches if keep else None
            sent = 0
            began = False  # an engine has a batch of this version: a failure from here on is told to them all
            try:
                ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                for b, batch in enumerate(batches):
                    off = 0
                    if bucket is not None and b >= 2:  # batch b-2 had this block: the engines gave it back
                        for lease in sent_leases[b - 2]:
                            lease.wait(t)
                    with ctx:
                        for it in batch:
                            src = it.src
                            if src.requires_grad:
                                # Detached here, batch by batch (load-bearing: 0.4 to 0.7 us a tensor, so
                                # the first batch leaves before the others are detached, not after).
                                src = src.detach()
                            if it.staged:
                                if keep:
                                    dst = self._kept[it.name]
                                else:
                                    dst = self._shaped(bucket[b % 2][off:], it)
                                    off += _aligned(it.nbytes)
                                dst.copy_(src, non_blocking=not host)
                                src = dst
                            it.send = self._wire(torch, it, src)
                    meta = {"weight_sync": PROTOCOL, "version": version, "batch": b, "batches": len(batches),
                            "keep": keep, "tensors": len(items) if b == 0 else len(batch)}
                    dtypes = {it.name: it.dtype for it in batch if _carrier(torch, it.dtype, host) is not None}
                    if dtypes:
                        meta["dtypes"] = dtypes
                    payload = {it.name: it.send for it in batch}
                    for it in batch:
                        it.send = None  # the leases hold the blocks
                    leases = []
                    for ch in list(self._channels):
                        try:
                            lease = ch.send_many(payload, stream=stream, meta=meta, timeout=t)
                        except DmaBufError:
                            if not ch.closed or len(self._channels) == 1:
                                raise
                            self._drop(ch)  # that engine went: the others go on
                            continue
                        self._leases.append(lease)
                        leases.append(lease)
                        began = True
                    sent_leases.append(leases)
                    payload = {}
                    sent = b + 1
            except BaseException as exc:
                if not began:
                    raise
                reason = f"the trainer stopped sending: {type(exc).__name__}: {exc}"
                self.abort(version, reason)
                raise IncompleteVersionError(version, sent, len(batches), reason) from exc
        finally:
            for it in items:
                it.src = it.send = None  # nothing of the caller's is held past the call (_Last)
        return PublishReport(version, len(items), sum(i.nbytes for i in items),
                             sum(i.nbytes for i in items if i.staged), len(batches), len(self._channels), keep)

    def abort(self, version: int, reason: str) -> None:
        """Tell every engine that ``version`` stops here: an engine waiting for it, or part-way through
        it, raises :class:`~dmabuf_interop.errors.IncompleteVersionError` with ``reason``. :meth:`publish`
        does this itself when it fails after a first batch went out; a caller whose engines wait for a
        version that :meth:`publish` refused calls it. Best effort: an engine that cannot be told (no room
        in the pool, or it went) has its channel closed, which it sees as the end of the version."""
        try:
            token = self.pool.empty((1,), "uint8", timeout=0)
        except DmaBufError:
            token = self._spare_byte()
        for ch in list(self._channels):
            try:
                if token is None:  # no room for the token: ending the channel reports it as well
                    raise PoolExhaustedError("no room for an abort batch")
                ch.send_many({ABORT_ITEM: token}, meta={"weight_sync": PROTOCOL, "version": version,
                                                        "abort": reason[:1000]}, timeout=1.0)
            except DmaBufError:
                self._drop(ch)

    def _spare_byte(self) -> Any:
        """A byte of this publisher's own staging, for an abort batch when the pool has no room (a bucketed
        version's staging takes what the pool has free): lent once more, never read; ``None`` if none."""
        torch = _torch()
        held = self._bucket[0] if self._bucket is not None else next(iter(self._kept.values()), None)
        if held is None:
            return None
        b = held.reshape(-1).view(torch.uint8)[:1]
        return b.numpy() if self.pool.is_host else b

    def close(self) -> None:
        """Close every engine's channel, the listener, and the pool if the publisher made it."""
        self._kept, self._kept_key, self._leases, self._last = {}, None, [], None
        self._bucket = self._bucket_key = None
        for ch in self._channels:
            ch.close()
        self._channels = []
        self._listener.close()
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
