"""A drop-in for torch's CUDA tensor sharing that needs no ``pidfd_getfd``: :func:`install` in the
producer and the consumer, and every ``reduce_tensor`` / ``ForkingPickler`` / ``torch.multiprocessing``
share of a CUDA tensor whose memory can travel as a POSIX fd goes through this library.

The pickled tuple keeps torch's shape, ``(rebuild_cuda_tensor, args)`` with torch's 15 arguments
(the device index at ``args[6]``), so code that rewrites ``args[6]`` or calls ``func(*args)`` keeps
working; ``args[7]`` is a :class:`ShareHandle` instead of a CUDA IPC handle. See
``docs/torch-sharing.md``, and Note [Sharing torch memory by fd] below for the reasoning.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from ... import _driver as driver
from ..._checks import id_set
from ..._time import check_timeout
from ...channel.segments import segments_for
from ...errors import CudaError, InvalidArgumentError, NotSupportedError
from . import broker as _broker
from . import client as _client
from .broker import MAGIC, ShareHandle

__all__ = ["install", "uninstall", "installed", "rebuild_cuda_tensor", "share_storage", "ShareHandle"]

# Note [Sharing torch memory by fd]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch shares a CUDA storage in two halves that meet only through a pickle: the producer's
# ``reduce_tensor`` calls ``storage._share_cuda_()`` and returns ``(rebuild_cuda_tensor, args)``;
# the consumer calls ``rebuild_cuda_tensor(*args)``, which calls ``_new_shared_cuda``. Under
# expandable segments torch's handle names the producer's pid and fd numbers, and the consumer
# fetches the fds with ``pidfd_open`` + ``pidfd_getfd``: that needs the producer's PID namespace
# and ptrace rights, and fails in containers and under seccomp. A pickle has no side channel for
# ``SCM_RIGHTS``; so the handle names one instead: a per-process *broker* socket.
#
# Where we hook. ``install()`` replaces two attributes and registers nothing:
#   * ``torch.UntypedStorage._share_cuda_`` (the Python class shadows the C method; torch's
#     ``TypedStorage._share_cuda_`` forwards to it). Every caller of torch's ``reduce_tensor``
#     reaches it, including code that did ``from torch.multiprocessing.reductions import
#     reduce_tensor`` before ``install()``, and torch's ``ForkingPickler`` registrations.
#   * ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, a module global that torch's
#     ``reduce_tensor`` reads when it builds the tuple: tuples name *our* function, which the
#     consumer's unpickler imports by name (so the consumer needs this package installed; calling
#     ``install()`` there too makes its own shares go through it). Handles that are not ours go to
#     torch's original function unchanged.
# ``uninstall()`` puts both back; torch's ``ForkingPickler._extra_reducers`` are never touched.
#
# Which path. A storage goes our way when ``cuMemRetainAllocationHandle`` finds ``cuMemCreate``
# pages under it that allow a POSIX fd: torch's expandable segments, a ``SharedPool``, a tensor
# rebuilt here from another producer. Everything else (torch's default allocator, ``cudaMalloc``)
# takes torch's own path (legacy CUDA IPC, which works across PID namespaces), unless
# ``install(fallback="refuse")``. The pages are found and cached by ``channel.segments``: a
# storage in a segment shared before costs one ``cuMemRetainAllocationHandle`` per page (to see
# that torch still maps the same memory there) and no export.
#
# Lifetime. Each ``_share_cuda_`` call registers a *share* in the broker holding the storage
# (so the caching allocator cannot hand its block out again) and returns a handle naming the
# share's id and a 128-bit secret. A consumer that rebuilds it takes a *lease* on its connection to
# the broker; the lease ends when the rebuilt storage is freed (a DLPack deleter) or when the
# connection ends, which the kernel does when the consumer dies, SIGKILL included. When the
# last lease of an opened share ends, the share lets go of the storage; the handle still opens
# while the producer itself keeps the storage alive (one tuple sent to several consumers, as
# SGLang's TP ranks do), and is stale after that. A share nobody opens holds its storage, as
# torch's limbo does, up to ``MAX_UNOPENED`` of them (the oldest are then let go). No
# ``/dev/shm`` file is used; ``torch.cuda.ipc_collect()`` only sees torch's own shares.
#
# Imports. A consumer keeps one connection per broker and maps each chunk (the pages a storage
# spans) once per device: its fds cross the connection the first time, later shares of the same
# chunk are a JSON round trip. An unused mapping stays cached (``MAX_IDLE_IMPORTS``), and is
# unmapped when the broker says its chunk is retired (torch remapped those addresses).
#
# Ordering. torch records an IPC event on the producer's current stream and the consumer's
# current stream waits on it. We ask ``cuStreamQuery`` first: an idle stream needs no event.
# Otherwise one interprocess event per (device, stream) is recorded again for each share; a
# consumer waiting on a later recording than its own only waits longer. Across PID namespaces
# ``cuIpcOpenEventHandle`` may refuse; the consumer then asks the broker to
# ``cuEventSynchronize`` before the rebuild returns (the CPU waits instead of the stream).
#
# Onward. A tensor rebuilt here is ``cuMemCreate`` memory imported from an fd, so sharing it on
# goes through this process's broker like any other: the third process maps the same physical
# pages. Its lease here keeps the first producer's lease: if this middle process dies, the
# first producer may reuse the memory while the third still reads it (stale bytes, never a fault:
# its import keeps the pages). torch itself refuses ("Attempted to send CUDA tensor received
# from another process").
#
# Safety. The broker is owner-only and checks ``SO_PEERCRED``; it lends only the chunk of the
# share the handle names, and only for the right secret (``hmac.compare_digest``). A stale,
# forged or foreign handle gives ``StaleHandleError`` naming the producer; a malformed one
# ``InvalidArgumentError``. This package unpickles nothing: the caller's unpickler calls
# ``rebuild_cuda_tensor`` with plain values, and everything from the broker is JSON, checked.

_lock = threading.Lock()
_saved: dict[str, Any] = {}  # torch's originals while installed
_options: dict[str, Any] = {"fallback": "torch", "timeout": 60.0}
_events: dict[tuple[int, int], tuple[Any, bytes]] = {}  # (device, stream) -> (CUevent, IPC handle)
_opened_events: dict[tuple[int, bytes], Any] = {}  # consumer: (device, handle) -> CUevent
_no_ipc_events: set[str] = set()  # broker addresses whose events this process cannot open
_torch_rebuild: Any = None  # torch's rebuild_cuda_tensor


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def install(*, fallback: str = "torch", allow_uids: Iterable[int] | None = None,
            timeout: float | None = 60.0) -> None:
    """Share CUDA tensors through this library from now on (idempotent; see the module docstring).

    Args:
        fallback: memory that cannot travel as a POSIX fd (torch's default allocator): ``"torch"``
            shares it torch's way; ``"refuse"`` raises ``NotSupportedError`` when it is shared.
        allow_uids: uids whose consumers this process's broker serves, and whose brokers it
            borrows from (``SO_PEERCRED``); default: this process's effective uid.
        timeout: seconds a rebuild waits for the producer's broker.

    Raises:
        InvalidArgumentError: a bad ``fallback``; ``allow_uids`` not an iterable of ids (a bare ``1000`` or
            ``"1000"`` included); ``timeout`` not a number of seconds >= 0 or ``None``.
        NotSupportedError: torch is not installed.
    """
    global _torch_rebuild
    if fallback not in ("torch", "refuse"):
        raise InvalidArgumentError(f"fallback must be 'torch' or 'refuse', got {fallback!r}")
    allow_uids = id_set(allow_uids, "allow_uids")
    timeout = check_timeout(timeout)  # checked here, not at the first rebuild in some other process
    try:
        import torch
        import torch.multiprocessing.reductions as reductions
    except ImportError as exc:
        raise NotSupportedError(f"torch is not installed ({exc})") from exc
    with _lock:
        _options.update(fallback=fallback, timeout=timeout)
        _broker.configure(allow_uids)
        if _saved:
            return
        _saved["share"] = torch.UntypedStorage.__dict__.get("_share_cuda_")  # None: the C method
        _saved["rebuild"] = reductions.rebuild_cuda_tensor
        if _torch_rebuild is None:
            _torch_rebuild = reductions.rebuild_cuda_tensor
        torch.UntypedStorage._share_cuda_ = _share_cuda_
        reductions.rebuild_cuda_tensor = rebuild_cuda_tensor


def uninstall() -> None:
    """Put torch's ``_share_cuda_`` and ``rebuild_cuda_tensor`` back, and close this process's broker
    and connections: shares not yet rebuilt become stale; tensors rebuilt here stay valid, and their
    producers may reuse the memory once they are freed. Idempotent."""
    import torch
    import torch.multiprocessing.reductions as reductions

    with _lock:
        if not _saved:
            return
        share = _saved.pop("share")
        if share is None:
            del torch.UntypedStorage._share_cuda_
        else:
            torch.UntypedStorage._share_cuda_ = share
        reductions.rebuild_cuda_tensor = _saved.pop("rebuild")
    _broker.shutdown()


def _share_cuda_(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``UntypedStorage._share_cuda_`` while installed: ours for fd-exportable memory, else torch's."""
    out = share_storage(self) if not args and not kwargs else None
    if out is not None:
        return out
    if _options["fallback"] == "refuse" and self.is_cuda and self.nbytes():
        raise NotSupportedError(f"storage at 0x{self.data_ptr():x} is not cuMemCreate memory that allows a "
                                f"POSIX fd (torch's default allocator?), and install(fallback='refuse') was asked")
    import torch

    return torch._C.StorageBase._share_cuda_(self, *args, **kwargs)


def share_storage(storage: Any) -> tuple[Any, ...] | None:
    """Register ``storage`` (a CUDA ``torch.UntypedStorage``) with this process's broker and return
    what ``_share_cuda_`` returns: ``(device, handle, nbytes, offset_in_chunk, b"", 0, event_handle,
    event_sync_required)``; ``None`` when its memory is not ``cuMemCreate`` pages that allow a
    POSIX fd (empty storages included).

    Raises:
        CudaError: a driver call failed (``cuStreamQuery``, ``cuEventRecord``, ...).
        SyscallError: the broker could not listen.
    """
    if not storage.is_cuda:
        return None
    nbytes, ptr = storage.nbytes(), storage.data_ptr()
    if nbytes == 0 or ptr == 0:
        return None
    device = storage.device.index
    segs = segments_for(device)
    block = segs.find_many([(ptr, nbytes, storage)])[0]
    if block is None:
        return None
    try:
        import torch

        stream = torch.cuda.current_stream(device).cuda_stream
        event = None
        if not driver.stream_idle(stream):  # torch records always; an idle stream needs no event
            event = _event_for(device, stream)
            driver.event_record(event[0], stream)
        chunk = block.chunk
        b = _broker.broker()
        handle = b.register(chunk, ptr - chunk.ptr, nbytes, block, _give_back,
                            relend=_Relend(storage, device), alive=_Alive(storage),
                            event=None if event is None else event[0], wait=_sync_event,
                            event_handle=b"" if event is None else event[1])
    except BaseException:
        segs.give_back([block])
        raise
    ev = b"" if event is None else event[1]
    return (device, handle.to_bytes(), nbytes, ptr - chunk.ptr, b"", 0, ev, event is not None)


def _give_back(block: Any) -> None:
    """The share's leases are over: torch may reuse the block's memory."""
    block.pool.give_back([block])


class _Alive:
    """Whether the producer still holds the storage (a weak reference, as torch's ``StorageWeakRef``)."""

    __slots__ = ("ref",)

    def __init__(self, storage: Any) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref = StorageWeakRef(storage)

    def __call__(self) -> bool:
        return not self.ref.expired()


class _Relend(_Alive):
    """Lend the storage again if the producer still holds it: ``(chunk, offset, block)`` or ``None``."""

    __slots__ = ("device",)

    def __init__(self, storage: Any, device: int) -> None:
        super().__init__(storage)
        self.device = device

    def __call__(self) -> tuple[Any, int, Any] | None:
        import torch

        if self.ref.expired():
            return None
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        block = segments_for(self.device).find_many([(storage.data_ptr(), storage.nbytes(), storage)])[0]
        return None if block is None else (block.chunk, storage.data_ptr() - block.chunk.ptr, block)


def _event_for(device: int, stream: int) -> tuple[Any, bytes]:
    ev = _events.get((device, stream))
    if ev is None:
        with _lock:
            ev = _events.get((device, stream))
            if ev is None:
                driver.set_current(device)
                e = driver.event_create_interprocess()
                ev = _events[(device, stream)] = (e, driver.ipc_get_event_handle(e))
    return ev


def _sync_event(event: Any) -> None:
    driver.event_synchronize(event)


def _device_index(device: Any) -> int:
    """``args[6]`` as torch takes it: an int, or a ``torch.device`` / ``"cuda:N"``."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    import torch

    try:
        d = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except RuntimeError:  # torch's "Invalid device string"
        d = None
    if d is None or d.type != "cuda":
        raise InvalidArgumentError(f"args[6] must name a CUDA device, got {device!r}")
    return torch.cuda.current_device() if d.index is None else d.index


class _Lease:
    """Owned by a rebuilt storage (through its DLPack deleter): freeing the storage ends the lease."""

    __slots__ = ("client", "lease", "imp")

    def __init__(self, client: Any, lease: int, imp: Any) -> None:
        self.client = client
        self.lease = lease
        self.imp = imp

    def __del__(self) -> None:
        try:
            self.client.release(self.lease, self.imp)
        except Exception:  # noqa: BLE001 - interpreter shutdown, a broker gone: the lease ended with it
            pass


def _open_storage(handle: ShareHandle, device: int, nbytes: int) -> Any:
    """Borrow ``handle``'s share mapped on ``device`` as a new ``UntypedStorage`` whose deleter ends
    the lease, with the current stream ordered after the producer's writes."""
    import numpy as np
    import torch
    from cuda.core.utils import StridedMemoryView

    from ...buffers import mapped_buffer

    client = _client.client_for(handle, _client.default_importer, timeout=_options["timeout"])
    wait = handle.address in _no_ipc_events
    lease, imp, offset, got, event = client.open(handle, device, wait=wait)
    hold = _Lease(client, lease, imp)
    torch.cuda._lazy_init()
    if got != nbytes:
        raise InvalidArgumentError(f"args[8] says {nbytes} bytes, the broker of {handle.producer} lends {got}")
    if event and not wait:
        stream = torch.cuda.current_stream(device).cuda_stream
        try:
            ev = _opened_events.get((device, event))
            if ev is None:
                driver.set_current(device)
                ev = _opened_events[(device, event)] = driver.ipc_open_event_handle(event)
            driver.stream_wait_event(stream, ev)
        except CudaError:  # another PID namespace: legacy IPC events do not open there
            _no_ipc_events.add(handle.address)
            client.wait(lease)
    buf = mapped_buffer(imp.buf.ptr + offset, nbytes, device, hold)
    raw = StridedMemoryView.from_buffer(buf, (nbytes,), (1,), dtype=np.dtype("uint8"))
    return torch.from_dlpack(raw).untyped_storage()


def rebuild_cuda_tensor(tensor_cls: Any, tensor_size: Any, tensor_stride: Any, tensor_offset: int,
                        storage_cls: Any, dtype: Any, storage_device: Any, storage_handle: Any,
                        storage_size_bytes: int, storage_offset_bytes: int, requires_grad: bool,
                        ref_counter_handle: Any, ref_counter_offset: Any, event_handle: Any,
                        event_sync_required: Any) -> Any:
    """torch's ``rebuild_cuda_tensor`` with the same 15 arguments: a handle of ours (``args[7]``
    begins with :data:`~.broker.MAGIC`) is borrowed from its producer's broker and mapped on
    ``storage_device`` (``args[6]``, which callers may rewrite); any other handle goes to torch's.

    Raises:
        InvalidArgumentError: a malformed handle, or sizes that disagree with the broker's.
        StaleHandleError: the producer is gone, never made that share, released it, or the handle's
            secret is wrong (the message names the producer).
        PeerRefusedError: the producer's broker runs as a uid that is not allowed.
        ProtocolError: the broker broke the protocol.
        NotSupportedError, CudaError: the memory cannot be mapped here (no peer access, ...).
    """
    if not (isinstance(storage_handle, bytes) and storage_handle.startswith(MAGIC)):
        rebuild = _torch_rebuild
        if rebuild is None:
            from torch.multiprocessing import reductions

            rebuild = reductions.rebuild_cuda_tensor
        return rebuild(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device,
                       storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
                       ref_counter_offset, event_handle, event_sync_required)
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache, storage_from_cache

    handle = ShareHandle.from_bytes(storage_handle)
    device = _device_index(storage_device)
    if type(storage_size_bytes) is not int or storage_size_bytes <= 0:  # noqa: E721
        raise InvalidArgumentError(f"args[8] must be a positive byte count, got {storage_size_bytes!r}")
    key = (storage_handle, device)  # a tuple rebuilt twice in one process shares one storage, as torch's
    storage = storage_from_cache(storage_cls, key)
    if storage is None:
        storage = _open_storage(handle, device, storage_size_bytes)
        shared_cache[key] = StorageWeakRef(storage)
    t = torch._utils._rebuild_tensor(torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True),
                                     tensor_offset, tensor_size, tensor_stride)
    if tensor_cls == torch.nn.parameter.Parameter:
        t = torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    else:
        t.requires_grad = requires_grad
    return t
