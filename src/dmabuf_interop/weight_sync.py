"""Weight sync: a trainer publishes versions of a named state dict; inference engines receive them.

Engine-agnostic core under the vLLM backend and the SGLang loader
(:mod:`dmabuf_interop.integrations`), built on the channel's public API
(:mod:`dmabuf_interop.channel`)::

    # trainer
    with WeightPublisher("/run/user/1000/w.sock", device=0, max_bytes=8 << 30) as pub:
        pub.accept(timeout=60)                       # one per engine (GPU, TP rank)
        pub.publish(model.state_dict(), version=1)   # every engine gets version 1

    # engine, another process
    with WeightReceiver("/run/user/1000/w.sock", device=0) as rx:
        rx.load(model.load_weights)                  # or rx.load_into(model); or `with rx.receive() as v`

A version goes as one or more ``send_many`` batches on every engine's channel,
each batch's first item carrying ``meta`` (JSON, checked on arrival):
``{"weight_sync": 1, "version": v, "batch": i, "batches": n, "keep": bool,
"dtypes": {name: torch dtype}}``. A trainer tensor in the publisher's pool is
lent as it is (zero copy); with ``lend_segments`` (default: when
``PYTORCH_CUDA_ALLOC_CONF`` asks for expandable segments) a CUDA tensor is
handed to the channel, which lends torch's pages in place; any other tensor is
copied once into the pool (staged), however many engines there are. Staging
buffers are kept from version to version when they all fit in the pool
(``keep``: the engine may hold every batch until it releases the version);
otherwise a version goes in buckets of at most half the pool, each staged when
the engines gave the one two before it back (the pool is reused), and an engine
gives batch ``i-1`` back once it has taken batch ``i``.

A version that stops part-way is reported, never half-applied silently: the
trainer sends an ``abort`` batch when it fails after the first batch went out,
and the engine raises :class:`~dmabuf_interop.errors.IncompleteVersionError`
saying how many batches its loader already applied (a batch from a stale,
unfinished version is skipped at the start of the next one).

Nothing is pickled: tensors travel as the channel's JSON descriptors; dtypes
the channel has no name for (float8, and bfloat16 over host pools, which NumPy
lacks) travel as same-size integers and are viewed back on arrival from a
fixed list of torch dtype names. Peers are checked as channels check them
(``SO_PEERCRED``: the same uid unless ``allow_uids``/``allow_gids`` say more).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

from .channel import SharedPool, as_tensors, connect, listen, release_all
from .errors import (DmaBufError, IncompleteVersionError, InvalidArgumentError, PoolExhaustedError, ProtocolError,
                     WaitTimeoutError)

__all__ = ["PROTOCOL", "Batch", "PublishReport", "ReceivedVersion", "WeightPublisher", "WeightReceiver"]

#: ``meta["weight_sync"]`` of every batch.
PROTOCOL = 1
#: Most tensors per batch (the channel takes 65536; a JSON body stays far below its 16 MiB).
MAX_BATCH_ITEMS = 4096
#: Most batches per version an engine accepts.
MAX_BATCHES = 1 << 16
#: CUDA streams a receiver loads batches on in turn.
RECV_STREAMS = 4
#: Name of the one item of an ``abort`` batch.
ABORT_ITEM = "__weight_sync_abort__"
#: torch dtypes a trainer may send, by name (what ``meta["dtypes"]`` may name).
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
#: Dtypes the channel describes on the wire by their own name; bfloat16 only on device pools.
_WIRE = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64",
         "complex128"}

T = TypeVar("T")


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is what weight sync moves
        from .errors import NotSupportedError

        raise NotSupportedError(f"weight sync moves torch tensors: torch is not installed ({exc})") from None
    return torch


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _carrier(torch: Any, name: str, host: bool) -> Any:
    """The dtype a tensor of ``name`` travels as: itself, or an integer of its size."""
    if name in _WIRE or (name == "bfloat16" and not host):
        return None
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[getattr(torch, name).itemsize]


def _aligned(nbytes: int) -> int:
    """Bytes a pool block of ``nbytes`` takes (blocks are 256-byte aligned)."""
    return -(-max(nbytes, 1) // 256) * 256


def _chunk_for(max_bytes: int) -> int:
    """A pool chunk of an eighth of ``max_bytes``, a whole number of 2 MiB (the device granularity on
    H200) or, below 2 MiB, of 256 bytes (:data:`~dmabuf_interop.channel.ALIGN`): a chunk size that the
    pool rounds up past ``max_bytes`` would leave no room for any chunk."""
    if max_bytes >= 2 << 20:
        return max(2 << 20, max_bytes // 8 // (2 << 20) * (2 << 20))
    return max(256, max_bytes // 256 * 256)


def _segments_asked() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


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
        self._lock = threading.Lock()

    # --- engines ---------------------------------------------------------------------------

    @property
    def engines(self) -> int:
        """Engines connected now."""
        return len(self._channels)

    def accept(self, timeout: float | None = 60.0) -> None:
        """Take the next engine's connection (its peer checked; :meth:`Listener.accept`'s errors)."""
        ch = self._listener.accept(timeout=timeout)
        with self._lock:
            self._channels.append(ch)

    def accept_while(self, call: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run ``call`` in a thread and take every engine that connects until it returns, then its result.

        For a control plane that tells engines to connect and returns once they have (vLLM's
        ``init_weight_transfer_engine``): the engines' ``connect`` completes only once accepted here.

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
        from ._time import deadline_after, remaining

        deadline = deadline_after(timeout)
        while worker.is_alive():
            left = remaining(deadline)
            if left is not None and left <= 0:
                raise WaitTimeoutError(f"the control-plane call did not return within {timeout} s")
            try:
                self.accept(timeout=0.05 if left is None else min(0.05, left))
            except WaitTimeoutError:
                pass
        while True:  # connections that were queued as the call returned
            try:
                self.accept(timeout=0)
            except WaitTimeoutError:
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

    def _items(self, state: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> list[_Item]:
        torch = _torch()
        pairs = state.items() if isinstance(state, Mapping) else state
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
        return items

    def _wire(self, torch: Any, item: _Item, t: Any) -> Any:
        carrier = _carrier(torch, item.dtype, self.pool.is_host)
        if carrier is not None:
            t = t.view(carrier) if t.dim() else t.reshape(1).view(carrier).reshape(())
        return t.numpy() if self.pool.is_host else t  # a host pool's channel reads NumPy arrays

    def _stage(self, torch: Any, item: _Item, timeout: float | None) -> Any:
        """A pool block shaped like ``item.src`` (``timeout=0``: only if there is room now)."""
        flat = self.pool.empty((max(item.nbytes, 1),), "uint8", timeout=timeout)
        buf = torch.from_numpy(flat) if self.pool.is_host else torch.from_dlpack(flat)
        return buf[:item.nbytes].view(item.src.dtype).view(item.src.shape)

    def _plan(self, items: list[_Item]) -> list[list[_Item]]:
        """Batches in order: a first of 1/16 of the bytes, then ``stream_batches`` of about equal bytes,
        none over :data:`MAX_BATCH_ITEMS`, and (staging not kept) none staging more than half the pool."""
        total = sum(i.nbytes for i in items)
        n = self.stream_batches
        first = total / 16 if n > 1 else total
        each = (total - first) / n if n > 1 else total
        half = None
        if not self._kept:
            half = (self.pool.max_bytes - self.pool.used_bytes) // 2
            big = max((i for i in items if i.staged), key=lambda i: i.nbytes, default=None)
            if big is not None and _aligned(big.nbytes) > half:
                raise InvalidArgumentError(
                    f"{big.name} ({big.nbytes} bytes) needs a pool of at least twice its size: "
                    f"{half * 2} bytes are free of max_bytes {self.pool.max_bytes}")
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
        self._kept, self._kept_key = {}, None
        kept: dict[str, Any] = {}
        try:
            for it in items:
                if it.staged:
                    kept[it.name] = self._stage(torch, it, timeout=0)
        except PoolExhaustedError:
            return False
        self._kept, self._kept_key = kept, key
        return True

    def publish(self, state: Mapping[str, Any] | Iterable[tuple[str, Any]], version: int, *,
                stream: Any = None, timeout: float | None = None) -> PublishReport:
        """Send ``state`` (name -> tensor, or (name, tensor) pairs; an iterator is consumed first) as
        ``version`` to every connected engine.

        Waits first for the previous version to be given back. Copies into the pool run on ``stream``
        (default: torch's current stream of the pool's GPU); the engines' streams wait for them.

        Raises:
            InvalidArgumentError: not tensors, unsupported dtypes, duplicate names, no engine connected, a
                staged tensor larger than half the pool (nothing was sent).
            IncompleteVersionError: sending stopped after a first batch went out (engines were told).
            WaitTimeoutError, PoolExhaustedError, PeerClosedError: an engine did not give a version back
                in time, or went (before anything of this version was sent).
        """
        torch = _torch()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidArgumentError(f"version must be an int >= 0, got {version!r}")
        if not self._channels:
            raise InvalidArgumentError("no engine is connected: accept() first")
        t = self.timeout if timeout is None else timeout
        items = self._items(state)
        self.wait(t)
        host = self.pool.is_host
        if stream is None and not host:
            stream = torch.cuda.current_stream(self.pool.device)
        keep = self._keep(torch, items)
        batches = self._plan(items)
        sent = 0
        try:
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            for b, batch in enumerate(batches):
                with ctx:
                    for it in batch:
                        src = it.src
                        if it.staged:
                            dst = self._kept[it.name] if keep else self._stage(torch, it, timeout=t)
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
                    it.send = None  # the leases hold the blocks: a bucket's staging goes back when released
                for ch in list(self._channels):
                    self._leases.append(ch.send_many(payload, stream=stream, meta=meta, timeout=t))
                payload = {}
                sent = b + 1
        except BaseException as exc:
            if sent == 0:
                raise
            reason = f"the trainer stopped sending: {type(exc).__name__}: {exc}"
            self.abort(version, reason)
            raise IncompleteVersionError(version, sent, len(batches), reason) from exc
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
            token = None
        for ch in list(self._channels):
            try:
                if token is None:  # no room for the token: ending the channel reports it as well
                    raise PoolExhaustedError("no room for an abort batch")
                ch.send_many({ABORT_ITEM: token}, meta={"weight_sync": PROTOCOL, "version": version,
                                                        "abort": reason[:1000]}, timeout=1.0)
            except DmaBufError:
                ch.close(timeout=0)
                self._channels.remove(ch)

    def close(self) -> None:
        """Close every engine's channel, the listener, and the pool if the publisher made it."""
        self._kept, self._kept_key, self._leases = {}, None, []
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


@dataclass(slots=True)
class Batch:
    """One batch of a version: ``items`` ((name, tensor) in the trainer's order), on ``stream`` (the
    CUDA stream that waited for the trainer's writes; ``None`` on host pools)."""

    index: int
    items: list[tuple[str, Any]]
    stream: Any
    received: Any = field(default=None, repr=False)


def _check_meta(meta: Any, first: dict[str, Any] | None) -> dict[str, Any]:
    """The batch's ``meta`` if it keeps the protocol (``first``: the version's first batch); else ProtocolError."""
    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"weight sync: {why}: {str(meta)[:200]}")

    if not isinstance(meta, dict) or meta.get("weight_sync") != PROTOCOL:
        raise bad("a batch without the weight-sync meta")
    v = meta.get("version")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise bad("a bad version")
    if "abort" in meta:
        if not isinstance(meta["abort"], str):
            raise bad("a bad abort reason")
        return meta
    b, n, keep = meta.get("batch"), meta.get("batches"), meta.get("keep")
    if (isinstance(b, bool) or isinstance(n, bool) or not isinstance(b, int) or not isinstance(n, int)
            or not 1 <= n <= MAX_BATCHES or not 0 <= b < n or not isinstance(keep, bool)):
        raise bad("bad batch numbers")
    dtypes = meta.get("dtypes", {})
    if not isinstance(dtypes, dict) or any(not isinstance(d, str) or d not in DTYPES for d in dtypes.values()):
        raise bad("a dtype outside the list")
    if first is not None and (v != first["version"] or n != first["batches"] or keep != first["keep"]):
        raise bad(f"a batch of another version within version {first['version']}")
    return meta


class ReceivedVersion:
    """One version as it arrives: iterate :meth:`batches` (or the object itself for ``(name, tensor)``
    pairs), then :meth:`release` (or leave the ``with`` block) to give it back.

    A tensor is valid until released. When the trainer could not keep the whole version in its pool
    (``keep`` false), batch ``i-1`` is given back as batch ``i`` is taken, so hold on to nothing of a
    batch past the next one.
    """

    def __init__(self, receiver: "WeightReceiver", timeout: float | None, streams: list[Any]) -> None:
        self._rx = receiver
        self._timeout = timeout
        self._streams = streams
        self._held: list[Batch] = []
        self.version: int | None = None
        self.batches_total: int | None = None
        self.applied = 0  # batches handed out so far
        self._first: dict[str, Any] | None = None
        self._done = False

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
        if self._first is None:
            self._first = meta
            self.version, self.batches_total = meta["version"], meta["batches"]
        dtypes = meta.get("dtypes", {})
        if next(iter(batch.values())).device < 0:  # host memory (a host pool), whatever the engine's device
            tensors = {n: torch.from_numpy(r.as_array()) for n, r in batch.items()}
        else:
            with torch.no_grad():
                tensors = as_tensors(batch)
        items = []
        for name, t in tensors.items():
            d = dtypes.get(name)
            if d is not None:
                want = getattr(torch, d)
                if want.itemsize != t.element_size():
                    release_all(batch)
                    raise ProtocolError(f"weight sync: {name} travels as {t.dtype}, which is no {d}")
                t = t.view(want) if t.dim() else t.reshape(1).view(want).reshape(())
            items.append((name, t))
        return Batch(index, items, stream, batch)

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
                    b = self._recv(index)
                except IncompleteVersionError:
                    raise
                except DmaBufError as exc:
                    if self.applied == 0:
                        raise
                    raise IncompleteVersionError(self.version or 0, self.applied, self.batches_total or 0,
                                                 f"{type(exc).__name__}: {exc}") from exc
                self._held.append(b)
                self.applied += 1
                yield b
                if not self._first["keep"] and len(self._held) > 1:  # type: ignore[index]
                    old = self._held.pop(0)  # the trainer reuses its pool: give batch i-1 back
                    old.items = []
                    release_all(old.received)
                index += 1
        except IncompleteVersionError:
            self._rx.partial = self.version
            self.release()
            raise
        self._done = True

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for b in self.batches():
            yield from b.items

    def drain(self) -> None:
        """Take and give back the rest of this version without using it (after the engine's loader failed
        part-way), so that a trainer reusing its pool for the remaining buckets is not left waiting;
        stops at the version's last batch, an abort, anything else, or the timeout."""
        self.release()
        last = (self.batches_total or 0) - 1
        index = self.applied
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
        """Give back every batch still held (one stream synchronisation per stream)."""
        held, self._held = self._held, []
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


class WeightReceiver:
    """The engine's end: a channel to the trainer's :class:`WeightPublisher`.

    Args:
        address: the publisher's address.
        device: CUDA ordinal the engine's model is on (imports are mapped there); ``None`` for a host pool.
        timeout: seconds to connect, and the default wait for a version (``None``: no limit).
        wait: retry while nothing listens yet (an engine started before its trainer).
        allow_uids, allow_gids: trainers allowed besides this uid.
        streams: CUDA streams that batches are loaded on in turn (default: :data:`RECV_STREAMS` new ones on
            ``device``, so one batch's copies overlap the next's hand-off and the copies of the batches
            before it).

    Raises:
        SyscallError, PeerRefusedError, WaitTimeoutError: as :func:`~dmabuf_interop.channel.connect`.
    """

    def __init__(self, address: str, *, device: int | None = None, timeout: float | None = 60.0,
                 wait: bool = False, allow_uids: Iterable[int] | None = None, allow_gids: Iterable[int] | None = None,
                 streams: list[Any] | None = None) -> None:
        self.host = device is None
        self.device = device
        self.timeout = timeout
        if streams is None and not self.host:
            torch = _torch()
            streams = [torch.cuda.Stream(device) for _ in range(RECV_STREAMS)]
        self._streams = list(streams or [])
        self._ch = connect(address, timeout=timeout, device=device, wait=wait, allow_uids=allow_uids,
                           allow_gids=allow_gids)
        #: The last version received whole, and a version stopped part-way after it (``None``: none).
        self.version: int | None = None
        self.partial: int | None = None

    def receive(self, *, timeout: float | None = None) -> ReceivedVersion:
        """The next version, read batch by batch as it is iterated (``timeout`` per batch)."""
        return ReceivedVersion(self, self.timeout if timeout is None else timeout, self._streams)

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
        self.version, self.partial = rv.version, None
        return rv.version  # type: ignore[return-value]

    def load_into(self, module: Any, *, timeout: float | None = None, strict: bool = True) -> int:
        """Receive a version and copy it into ``module``'s parameters and buffers of the same names and
        shapes, in place. Returns the version.

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
        """Close the channel (a version still held is given back by the channel)."""
        self._ch.close()

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
