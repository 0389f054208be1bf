"""Sending: a caller's array to a placement (inspect it, find the pool block that holds it, lend torch's
pages in place, or copy it into a new block), the wire form of the placed arrays, and the memo of
placements sent again.

Speed tricks here are measured and load-bearing: the per-type caches (``_TORCH_DTYPES``, ``_NUMPY_NAMES``,
``_SIG_KINDS``) and :func:`signatures` make sending a state dict of thousands of tensors again (every
step) cost one comparison per tensor instead of an inspection; :class:`Memo` then skips placement
altogether and the message is a ``repeat``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .. import _driver as driver  # (at module level: an import in a function costs a send ~1.5 us)
from ..errors import DmaBufError, InvalidArgumentError
from ._torch_views import BULK_ITEMS, bulk
from .arrays import STORAGE, DeviceView, HostView, c_strides, shown_dtype, storage_dtype, wire_dtype
from .pool import LIVE_POOLS, Block, SharedPool
from .protocol import DTYPES, MAX_INT, MAX_ITEMS, MAX_META_BYTES, MAX_NAME_CHARS, MAX_NDIM

if TYPE_CHECKING:
    from ._link import Link

__all__ = ["Source", "Found", "Placed", "Prepared", "Memo", "MemoTable", "batch_items", "check_meta", "order_writes", "prepare", "stream_handle", "inspect_array", "find", "lend_in_place",
           "place", "signatures", "wire_descs", "MAX_MEMOS"]

try:  # speed trick: a NumPy array's address in one C call (``ndarray.ctypes.data`` builds a ctypes object: ~4 us)
    from .._atomic import address as _address
except ImportError:  # the extension is optional (it carries the shared-memory ring)
    def _address(array: Any) -> int:
        return array.ctypes.data

_NO_ADDRESS = (BufferError, TypeError, ValueError)  # an exporter that refuses the buffer protocol's strided form


def _numpy_address(array: Any) -> int:
    """The address of a NumPy array's first element."""
    try:
        return _address(array)
    except _NO_ADDRESS:
        return array.ctypes.data


#: Most placements a channel remembers for arrays sent again (:class:`Memo`).
MAX_MEMOS = 256


def stream_handle(stream: Any) -> int:
    """A ``CUstream`` handle as an int from a cuda.core, torch or CuPy stream, an int, or ``None`` (0)."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    handle = getattr(stream, "handle", None)  # cuda.core.Stream
    if handle is not None:
        return int(handle)
    raise InvalidArgumentError(f"cannot find a CUDA stream handle in {type(stream).__name__}")


@dataclass(slots=True)
class Source:
    """What the sender needs to know about a caller's array."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    dtype: str
    known_device: int | None  # -1: host; None: ask the driver only if a copy needs it
    obj: Any
    whole_items: bool = False  # strides known to be multiples of the itemsize (torch's are in elements)

    @property
    def device(self) -> int:
        if self.known_device is None:  # a StridedMemoryView: device memory, or host memory CUDA knows
            view = self.obj
            self.known_device = view.device_id if view.is_device_accessible and not _is_host_ptr(view) else -1
        return self.known_device


def inspect_array(array: Any) -> Source:
    import numpy as np

    mod = type(array).__module__
    if mod.startswith("torch"):
        if array.is_nested or array.layout is not sys.modules["torch"].strided:  # (no one block to lend)
            kind = "a nested" if array.is_nested else f"a {str(array.layout).replace('torch.', '')}"
            instead = "its components (tensor.unbind())" if array.is_nested else "tensor.to_dense()"
            raise InvalidArgumentError(f"{kind} torch tensor cannot travel: only strided (dense) tensors can: send "
                                       f"{instead}")
        if not (array.is_cuda or array.is_cpu):  # (is_cuda/is_cpu: a tenth of a µs; tensor.device makes an object)
            raise InvalidArgumentError(f"a torch tensor on device {array.device.type!r} cannot travel: only CPU and "
                                       f"CUDA tensors can")
        if array.is_conj() or array.is_neg():  # lazy views: the memory holds the values before the conjugation
            raise InvalidArgumentError("a torch tensor with its conjugate or negative bit set cannot travel as "
                                       "it lies in memory: send tensor.resolve_conj().resolve_neg()")
        known = _TORCH_DTYPES.get(array.dtype)
        if known is None:
            name = str(array.dtype).replace("torch.", "")
            if DTYPES.get(name) != array.element_size():  # a quantized, bits or sub-byte shell dtype
                raise _refused(array.dtype)
            known = _TORCH_DTYPES[array.dtype] = (name, array.element_size())
        dtype, es = known
        _SIG_KINDS.setdefault(type(array), 1)
        dev = array.get_device()  # -1 for CPU tensors
        return Source(array.data_ptr(), tuple(array.shape), tuple(s * es for s in array.stride()), dtype,
                       dev, array, True)
    if type(array) is DeviceView:  # a received array sent on, as it is mapped here (no memory view made)
        size = array.dtype.itemsize
        return Source(array.ptr, array.shape, tuple(st * size for st in array.strides), array._wire_dtype,
                       array.device_id, array, True)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        ptr = int(cai["data"][0])
        strides = tuple(cai["strides"]) if cai.get("strides") else c_strides(shape, dt.itemsize)
        dev = driver.pointer_device(ptr) if ptr else 0
        return Source(ptr, shape, strides, _numpy_name(dt, cai["typestr"]), dev, array)
    if isinstance(array, np.ndarray):
        _SIG_KINDS.setdefault(type(array), 2)
    else:
        from cuda.core.utils import StridedMemoryView

        if isinstance(array, StridedMemoryView):
            _SIG_KINDS.setdefault(type(array), 3)
            dt = np.dtype(array.dtype)
            shape = tuple(array.shape)
            strides = (tuple(s * dt.itemsize for s in array.strides) if array.strides is not None
                       else c_strides(shape, dt.itemsize))
            return Source(int(array.ptr), shape, strides, _numpy_name(dt), None, array)
        if isinstance(array, Mapping):  # numpy.asarray would make it a 0-d object array ("dtype object")
            raise InvalidArgumentError(f"cannot send a {type(array).__name__} as one array: send_many sends a "
                                       f"mapping of name -> array")
        try:
            array = np.asarray(array)
        except ValueError as exc:  # a ragged list, for one
            raise InvalidArgumentError(f"cannot send {type(array).__name__}: numpy.asarray refused it ({exc})") from exc
    name = _NUMPY_NAMES.get(array.dtype)
    if name is None:
        name = _numpy_name(array.dtype)
    return Source(_numpy_address(array), array.shape, array.strides, name, -1, array)


def _refused(shown: Any) -> InvalidArgumentError:
    return InvalidArgumentError(f"dtype {shown_dtype(shown)} cannot travel; accepted: {', '.join(DTYPES)}")


def _numpy_name(dtype: Any, shown: Any = None) -> str:
    """The wire name of a NumPy dtype (remembered), or InvalidArgumentError naming it as the caller did."""
    name = _NUMPY_NAMES.get(dtype)
    if name is None:
        if dtype.byteorder == ">":
            raise InvalidArgumentError(f"big-endian arrays cannot travel ({shown_dtype(dtype)}): convert with "
                                       "astype(dtype.newbyteorder('='))")
        name = wire_dtype(dtype)
        if name is None:
            raise _refused(dtype if shown is None else shown)
        _NUMPY_NAMES[dtype] = name
    return name


#: NumPy dtype -> wire dtype name (``dtype.name`` builds a new string on every read).
_NUMPY_NAMES: dict[Any, str] = {}
#: torch dtype -> (wire dtype name, itemsize).
_TORCH_DTYPES: dict[Any, tuple[str, int]] = {}
#: Array types :func:`signatures` reads: 1 torch tensors, 2 NumPy arrays, 3 cuda.core StridedMemoryViews.
_SIG_KINDS: dict[type, int] = {}


def _is_host_ptr(view: Any) -> bool:
    """True for host memory CUDA knows (pinned or registered): ``CU_MEMORYTYPE_HOST`` from ``cuPointerGetAttributes``."""
    try:
        host = int(driver.bindings().CUmemorytype.CU_MEMORYTYPE_HOST)
        return driver.pointer_facts(int(view.ptr))["memory_type"] == host
    except DmaBufError:
        return False


def wire_descs(placed: "list[Placed]", order: str, ev64: str | None, meta: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The wire form of :meth:`ArrayDescriptor.to_json` for each placed array, built directly (a batch
    has thousands of items); ``meta`` rides on the first."""
    descs = [{"chunk": p.block.chunk.id, "block_offset": p.block.offset, "block_bytes": p.block.size,
              "byte_offset": p.offset, "shape": list(p.shape), "strides": list(p.strides), "dtype": p.dtype,
              "ordering": order, "event": ev64, "name": p.name, "meta": None}
             for p in placed]
    if descs:
        descs[0]["meta"] = meta
    return descs


class Memo:
    """A batch, or one array, lent whose every array lay in a :class:`.pool.SharedPool` block:
    sending the same names over the same addresses and layouts again (a model's state dict, every
    step, whole or in buckets; a ring of blocks) reuses its placement, referencing its blocks again,
    without inspecting and finding each array, and sends a ``repeat`` of its layout."""

    __slots__ = ("names", "key", "sigs", "placed", "blocks", "dev_pool", "by_pool", "heads", "layout", "batch",
                 "current")

    @staticmethod
    def key_of(batch: bool, names: list[str | None], sigs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Where a memo is kept, cheap to make (the full names and signatures are compared on use):
        a named batch by its length and end names; arrays without names by their signatures."""
        return (batch, len(names), names[0], names[-1]) if names[0] is not None else (batch, sigs)

    def __init__(self, names: list[str | None], sigs: tuple[Any, ...], placed: "list[Placed]", dev_pool: Any,
                 batch: bool) -> None:
        self.names = names
        self.key = self.key_of(batch, names, sigs)
        self.batch = batch  # a send_many batch, else one send (each sent as a layout)
        self.sigs = sigs
        self.placed = placed
        self.blocks = [p.block for p in placed]  # a lease's list, shared: a Lease never changes it
        self.dev_pool = dev_pool
        by_pool: dict[Any, list[Block]] = {}
        heads: dict[int, Block] = {}  # one block per chunk, to check that the peer has it
        for p in placed:
            by_pool.setdefault(p.block.pool, []).append(p.block)
            heads.setdefault(p.block.chunk.id, p.block)
        self.by_pool = list(by_pool.items())
        self.heads = list(heads.values())
        self.layout: int | None = None  # set once the peer has its layout
        #: Whether it is the one its table remembers for its key (set and cleared under the send lock).
        self.current = False


def signatures(arrays: list[Any]) -> tuple[Any, ...] | None:
    """Each array's (address, shape, strides, dtype), read as cheaply as its type allows (torch
    tensors and NumPy arrays that :func:`inspect_array` has met); ``None`` if some array has no such form."""
    if len(arrays) >= BULK_ITEMS:
        with bulk(len(arrays)):
            return _signatures(arrays)
    return _signatures(arrays)  # (a few arrays: no context manager, 0.3 us less a send())


def _signatures(arrays: list[Any]) -> tuple[Any, ...] | None:
    out = []
    append = out.append
    kinds = _SIG_KINDS
    for a in arrays:
        kind = kinds.get(type(a))
        if kind == 1:  # (a lazy conjugate or negative view of the same memory is another array)
            try:
                append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.is_conj(), a.is_neg()))
            except RuntimeError:  # a sparse or nested tensor: inspect_array refuses it with a typed error
                return None
        elif kind == 2:
            try:  # (_numpy_address, inline: a send of an array lent again makes this call, and a call costs it ~1 us)
                ptr = _address(a)
            except _NO_ADDRESS:
                ptr = a.ctypes.data
            append((ptr, a.shape, a.strides, a.dtype))
        elif kind == 3:
            append((3, a.ptr, a.shape, a.strides, a.dtype))  # strides in items: never equal to NumPy's
        else:
            return None
    return tuple(out)


@dataclass(slots=True)
class Found:
    """An array :func:`find` inspected: its :class:`Source`, itemsize, ``span`` (bytes from its first
    element to one past its last; 0: empty, or negative strides: nothing to find) and the pool block
    that already holds it (referenced), else ``None``. :func:`lend_in_place` may fill ``block`` in;
    :func:`place` takes it over."""

    src: Source
    itemsize: int
    span: int
    block: Any


@dataclass(slots=True)
class Placed:
    """Where one array of a send lies: ``block`` (referenced for the lease), the array's ``offset`` in it
    (bytes), its shape, strides (bytes) and wire dtype, and its ``name`` in a ``send_many`` mapping."""

    name: str | None
    block: Any
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


def find(pool: SharedPool | None, array: Any) -> Found:
    """Inspect a caller's array and find the block of ``pool``, or of another live pool of this process,
    that already holds it.

    Raises:
        InvalidArgumentError: a dtype that cannot travel (named as the caller gave it), more than
            :data:`~.protocol.MAX_NDIM` dimensions, an empty array whose strides would pass
            :data:`~.protocol.MAX_INT` (and what :func:`inspect_array` raises): the peer would refuse them.
    """
    src = inspect_array(array)
    itemsize = DTYPES[src.dtype]  # (inspect_array refused any other)
    if len(src.shape) > MAX_NDIM:
        raise InvalidArgumentError(f"an array of {len(src.shape)} dimensions cannot travel: at most {MAX_NDIM}")
    span = itemsize
    for n, st in zip(src.shape, src.strides):
        if n == 0 or st < 0:
            span = 0
            break
        span += (n - 1) * st
    if not span and math.prod(max(n, 1) for n in src.shape) * itemsize > MAX_INT:
        # (only an empty array's other dimensions can be that large; its copy's strides would be too)
        raise InvalidArgumentError(f"an array of shape {tuple(src.shape)} cannot travel: its strides would pass "
                                   f"{MAX_INT} bytes")
    block = None
    if span:
        block = pool._find_ref(src.ptr, span) if pool is not None else None
        if block is None and len(LIVE_POOLS) > (pool is not None):  # another pool of this process
            for p in list(LIVE_POOLS):
                if p is not pool:
                    block = p._find_ref(src.ptr, span)
                    if block is not None:
                        break
    return Found(src, itemsize, span, block)


def lend_in_place(pool: SharedPool | None, found: list[Found]) -> None:
    """Fill in the block of each device array in no pool whose memory torch's expandable segments
    hold, lent in place (:mod:`.segments`), one batch per device."""
    if pool is not None and pool.is_host:
        return  # a host-pool channel: its peer may have no GPU; device arrays are copied to the host
    by_device: dict[int, list[Found]] = {}
    for f in found:
        if f.block is None and f.span and f.src.device >= 0:
            by_device.setdefault(f.src.device, []).append(f)
    if not by_device:
        return
    from .segments import segments_for

    for dev, fs in by_device.items():
        blocks = segments_for(dev).find_many([(f.src.ptr, f.span, f.src.obj) for f in fs])
        for f, b in zip(fs, blocks):
            f.block = b


def place(pool: SharedPool | None, name: str | None, src: Source, itemsize: int, block: Any, stream: int,
          timeout: float | None, auto: Any = None) -> Placed:
    """The block to lend for an array :func:`find` inspected: ``block`` itself (zero-copy), or a new
    block of ``pool`` it is copied into (host: ``numpy.copyto``; device: ``cuMemcpyAsync`` on ``stream``).
    Without ``pool``, the pool of ``auto`` (a :class:`._autopool.Membership`) for the array's device:
    host memory to the host, a GPU's to that GPU. On failure ``block`` is released.

    Raises:
        InvalidArgumentError: no pool to copy into; a non-contiguous copy to or from device memory.
        PoolExhaustedError: no room within ``timeout``.
    """
    shape, strides = src.shape, tuple(src.strides)
    if block is not None:
        off = src.ptr - block.ptr
        if itemsize == 1 or (off % itemsize == 0 and (src.whole_items or not any(st % itemsize for st in strides))):
            return Placed(name, block, off, shape, strides, src.dtype)
        # A view DLPack cannot describe (a stride or its start not a whole number of items): copied instead.
        block.pool._unref(block)
    if pool is None:
        if auto is None:
            raise InvalidArgumentError("this channel has no pool to copy into: pass pool= to listen/connect, "
                                       "or send arrays from SharedPool.empty")
        pool = auto.pool_for(src.device)
    nbytes = math.prod(src.shape) * itemsize
    block = pool.alloc(nbytes, timeout=timeout)
    block.pool._ref(block)
    try:
        strides = c_strides(src.shape, itemsize)
        _copy_into(block, src, nbytes, strides, stream)
    except BaseException:
        block.pool._unref(block)
        raise
    return Placed(name, block, 0, src.shape, strides, src.dtype)


def _copy_into(block: Block, src: Source, nbytes: int, strides: tuple[int, ...], stream: int) -> None:
    import numpy as np

    if nbytes == 0:
        return
    if block.pool.is_host and src.device < 0:
        obj = src.obj
        # A dtype NumPy lacks is copied as the unsigned int of its size (torch's .numpy() refuses it).
        store = storage_dtype(src.dtype)
        if type(obj).__module__.startswith("torch"):
            obj = obj.detach()  # a parameter that requires grad: its values, not its graph
            if src.dtype in STORAGE:
                import torch

                obj = obj.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[store.itemsize])
            obj = obj.numpy()
        srcarr = np.asarray(obj)
        if srcarr.dtype != store:
            srcarr = srcarr.view(store)  # (same itemsize: any strides)
        dst = np.asarray(HostView(block.ptr, src.shape, strides, store.str,
                                  (block.chunk.host_keepalive(block.offset, block.size),)))
        np.copyto(dst, srcarr, casting="no")
        return
    # A device on either side: cuMemcpyAsync (unified addressing) of contiguous bytes on the caller's stream.
    contiguous = src.strides == c_strides(src.shape, DTYPES[src.dtype]) or math.prod(src.shape) <= 1
    if not contiguous:
        raise InvalidArgumentError("copying a non-contiguous array to or from GPU memory is not supported: "
                                   "send a contiguous array (e.g. tensor.contiguous()) or one from pool.empty")
    driver.set_current(block.pool.device if not block.pool.is_host else src.device)
    driver.memcpy_async(block.ptr, src.ptr, nbytes, stream)
    if block.pool.is_host:
        driver.stream_synchronize(stream)  # host pools carry no event: the bytes must be there now


class MemoTable:
    """The placements a channel lent whose every array lay in one of its pool's blocks (:class:`Memo`),
    by :meth:`Memo.key_of`, at most ``limit`` (the oldest forgotten first). Changed only under the
    channel's send lock (``link``'s); read without it by :meth:`lend_again`, whose result is checked."""

    def __init__(self, link: "Link", limit: int = MAX_MEMOS) -> None:
        self._link = link
        self._memos: dict[tuple[Any, ...], Memo] = {}
        # One NumPy array sent alone, by its address: the last such memo remembered there (load-bearing for a
        # send's speed: a dict keyed by the whole signature hashes a nested tuple and its dtype at every send).
        self._by_address: dict[int, Memo] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self._memos)

    def values(self) -> list[Memo]:
        return list(self._memos.values())

    def get(self, key: tuple[Any, ...]) -> "Memo | None":
        return self._memos.get(key)

    def __getitem__(self, key: tuple[Any, ...]) -> Memo:
        return self._memos[key]

    def lend_again(self, names: list[str | None], arrays: list[Any],
                   batch: bool) -> tuple[list[Placed] | None, tuple[Any, ...] | None, "Memo | None"]:
        """A remembered placement, its blocks referenced again, when ``names`` and ``arrays`` are its names
        over arrays at the same addresses with the same shapes, strides and dtypes, and every block is
        still allocated: ``(placement, signatures, memo)``. Otherwise ``(None, signatures, None)``; the
        signatures are ``None`` when some array has no cheap one."""
        sigs = signatures(arrays)
        memo = self._memos.get(Memo.key_of(batch, names, sigs)) if sigs is not None else None
        # Arrays without names are kept by their signatures: found, they equal the memo's (the dict compared
        # the keys), and so do their names (as many Nones). Not compared again: 0.3-0.5 us a send().
        if memo is None or (names[0] is not None and (sigs != memo.sigs or names != memo.names)):
            return None, sigs, None
        done: list[tuple[Any, list[Block]]] = []
        for pool, blocks in memo.by_pool:
            if not pool._ref_live(blocks):  # a block was freed (its array dropped) since
                for p, bl in done:
                    p._unref_many(bl)
                self._forget_stale(memo)
                return None, sigs, None
            done.append((pool, blocks))
        return memo.placed, sigs, memo

    def single_again(self, array: Any) -> "Memo | None":
        """:meth:`lend_again` of one array sent alone (``send``), in fewer steps (a sender's hot path): its memo,
        the block referenced again, or ``None`` (no such placement remembered, or its block was freed)."""
        # (_signatures, inline for one array: this is the call a send of an array lent again makes)
        kind = _SIG_KINDS.get(type(array))
        if kind == 2:
            try:
                ptr = _address(array)
            except _NO_ADDRESS:
                ptr = array.ctypes.data
            memo = self._by_address.get(ptr)
            if memo is not None:  # (its signature's other fields compared in place: no tuple made, none hashed)
                m = memo.sigs[0]
                dt = m[3]
                if m[1] == array.shape and m[2] == array.strides and (dt is array.dtype or dt == array.dtype):
                    pool, blocks = memo.by_pool[0]
                    if pool._ref_live(blocks):
                        return memo
                    self._forget_stale(memo)
                    return None
            sig = (ptr, array.shape, array.strides, array.dtype)
        elif kind == 1:
            try:
                sig = (array.data_ptr(), array.shape, array.stride(), array.dtype, array.is_conj(), array.is_neg())
            except RuntimeError:  # a sparse or nested tensor: inspect_array refuses it with a typed error
                return None
        elif kind == 3:
            sig = (3, array.ptr, array.shape, array.strides, array.dtype)
        else:
            return None
        # (Memo.key_of of one unnamed array: a torch tensor, a DeviceView, a NumPy array where another lay before)
        memo = self._memos.get((False, (sig,)))
        if memo is None:
            return None
        pool, blocks = memo.by_pool[0]
        if pool._ref_live(blocks):
            return memo
        self._forget_stale(memo)
        return None

    def _forget_stale(self, memo: Memo) -> None:
        """Forget ``memo``, whose blocks were freed, if the send lock is free: a send in another thread may hold it
        past this send's timeout. Left, it is found stale again (and a new placement remembered replaces it)."""
        with self._link.held_if_free() as got:
            if got:
                self.forget(memo)

    def is_current(self, memo: Memo) -> bool:
        """``memo`` is still the one remembered for its key, with a layout the peer has."""
        return memo.current and memo.layout is not None

    def remember(self, memo: Memo, layout: int | None) -> None:
        """``memo`` was sent; a batch's ``layout`` is known to the peer now. (The caller holds the send lock.)"""
        memo.layout = layout
        old = self._memos.get(memo.key)
        if old is not None and old is not memo:
            self.forget(old)
        self._memos[memo.key] = memo
        memo.current = True
        sig = _single_numpy_sig(memo)
        if sig is not None:
            self._by_address[sig[0]] = memo
        if len(self._memos) > self.limit:
            self.forget(next(iter(self._memos.values())))

    def forget(self, memo: Memo) -> None:
        """(The caller holds the send lock.)"""
        if self._memos.get(memo.key) is memo:
            del self._memos[memo.key]
            memo.current = False
            sig = _single_numpy_sig(memo)
            if sig is not None and self._by_address.get(sig[0]) is memo:
                del self._by_address[sig[0]]

    def forget_layout(self, layout: int) -> None:
        """The peer forgot ``layout``: no memo may repeat it. (The caller holds the send lock.)"""
        for m in [m for m in self._memos.values() if m.layout == layout]:
            self.forget(m)

    def forget_chunk(self, chunk_id: int) -> None:
        """Chunk ``chunk_id`` is retired: placements in it are gone. (The caller holds the send lock.)"""
        for m in [m for m in self._memos.values() if any(b.chunk.id == chunk_id for b in m.heads)]:
            self.forget(m)

    def clear(self) -> None:
        for memo in self._memos.values():
            memo.current = False
        self._memos.clear()
        self._by_address.clear()


def _single_numpy_sig(memo: Memo) -> tuple[Any, ...] | None:
    """The signature of ``memo``'s one NumPy array sent alone (address, shape, strides, dtype), else ``None``."""
    key = memo.key
    if key[0] is False and len(key) == 2 and len(key[1]) == 1 and len(key[1][0]) == 4:  # (Memo.key_of's forms)
        return key[1][0]
    return None


def batch_items(arrays: Any) -> tuple[list[str | None], list[Any], str]:
    """A ``send_many`` argument as ``(names, arrays, kind)``: ``kind`` ``"mapping"`` (names are the keys)
    or ``"list"`` (names are ``None``).

    Raises:
        InvalidArgumentError: not a mapping, list or tuple; an empty batch; more than
            :data:`~.protocol.MAX_ITEMS` arrays; a mapping key that is not a str of at most
            :data:`~.protocol.MAX_NAME_CHARS` characters.
    """
    names: list[str | None]
    if not isinstance(arrays, (Mapping, list, tuple)):  # an array would go as a batch of its rows
        raise InvalidArgumentError(f"send_many takes a mapping of name -> array, or a list or tuple of arrays, "
                                   f"got {type(arrays).__name__}: use send() for one array")
    if isinstance(arrays, Mapping):
        names, arrs, kind = list(arrays.keys()), list(arrays.values()), "mapping"
        # Checked with C-level maps: a state dict has thousands of keys, sent every step.
        if names and (set(map(type, names)) != {str} or max(map(len, names)) > MAX_NAME_CHARS):
            bad = next((k for k in names if not isinstance(k, str) or len(k) > MAX_NAME_CHARS), None)
            if bad is not None:  # (a str subclass passes)
                shown = repr(bad) if len(repr(bad)) <= 80 else repr(bad)[:77] + "..."
                raise InvalidArgumentError(f"a send_many mapping needs str keys of at most {MAX_NAME_CHARS} characters, "
                                           f"got {shown} ({type(bad).__name__})")
    else:
        arrs, kind = list(arrays), "list"
        names = [None] * len(arrs)
    if not arrs:
        raise InvalidArgumentError("an empty batch: send_many needs at least one array")
    if len(arrs) > MAX_ITEMS:
        raise InvalidArgumentError(f"a batch holds at most {MAX_ITEMS} arrays, got {len(arrs)}: "
                                   f"send it as several batches")
    return names, arrs, kind


def check_meta(meta: Any) -> None:
    """A caller's ``meta``: ``None`` or a JSON object of at most :data:`~.protocol.MAX_META_BYTES` as compact JSON.

    Raises:
        InvalidArgumentError: not a dict, not JSON-serialisable, or too large.
    """
    import json

    if meta is not None:
        if not isinstance(meta, dict):
            raise InvalidArgumentError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            size = len(json.dumps(meta, separators=(",", ":"), allow_nan=False).encode())
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"meta is not JSON-serialisable: {exc}") from exc
        if size > MAX_META_BYTES:
            raise InvalidArgumentError(f"meta is {size} bytes of JSON, more than {MAX_META_BYTES}")


@dataclass(slots=True)
class Prepared:
    """A send ready to go: where each array lies (``placed``, each block referenced for the lease), the
    memo it came from or goes to, and how the peer learns the writes are done (``order``: ``"none"``,
    ``"sync"`` or ``"event"`` with ``event``, an ``(CUevent, IPC handle)`` of the pool ``events``)."""

    placed: list[Placed]
    memo: Memo | None
    again: bool
    order: str
    event: Any
    events: Any

    @property
    def blocks(self) -> list[Any]:
        """The lease's blocks (a remembered placement's list, shared: a Lease never changes it)."""
        return self.memo.blocks if self.again and self.memo is not None else [p.block for p in self.placed]

    @property
    def heads(self) -> Any:
        """One block per chunk when remembered (to check that the peer has each chunk), else every block."""
        return self.memo.heads if self.memo is not None else [p.block for p in self.placed]

    def unref(self) -> None:
        """The send failed: give every block back."""
        for p in self.placed:
            p.block.pool._unref(p.block)


def order_writes(dev_pool: Any, stream: int, ordering: str) -> tuple[str, Any, Any]:
    """How the peer learns that the writes queued on ``stream`` are done, for arrays of the device pool ``dev_pool``
    (``None``: host memory, ``"none"``): ``(order, event, events)``. ``ordering`` ``"sync"``:
    ``cuStreamSynchronize``; ``"event"``: ``"sync"`` as well when ``cuStreamQuery`` finds nothing pending on
    ``stream``, else ``cuEventRecord`` of an interprocess ``event`` of the pool's ``events``.

    Raises:
        CudaError: a driver call failed.
    """
    if dev_pool is None:
        return "none", None, None
    driver.set_current(dev_pool.device)
    if ordering == "sync":
        driver.stream_synchronize(stream)
        return "sync", None, None
    if driver.stream_idle(stream):
        return "sync", None, None  # nothing pending on the stream: the writes are complete, no event to wait on
    events = dev_pool.events
    event = events.take()
    try:
        driver.event_record(event[0], stream)
    except BaseException:
        events.give(event)
        raise
    return "event", event, events


def prepare(pool: SharedPool | None, memos: MemoTable, names: list[str | None], arrays: list[Any], stream: int,
            timeout: float | None, ordering: str, batch: bool, share_segments: bool, auto: Any = None,
            before_place: Callable[[], None] | None = None) -> Prepared:
    """Place every array of a send (:class:`MemoTable.lend_again`, else ``before_place()``, :func:`find`,
    :func:`lend_in_place` and :func:`place`, which copies into ``auto``'s pools when there is no ``pool``), then order the
    writes on a device pool: ``"sync"`` (``cuStreamSynchronize``, or
    nothing pending on ``stream``: ``cuStreamQuery``) or ``"event"`` (``cuEventRecord`` of an interprocess
    event). On failure every block taken is given back.

    Raises:
        what :func:`find` and :func:`place` raise; CudaError: a driver call failed.
    """
    placed: list[Placed] = []
    found: list[Found] = []
    memo = None
    try:
        again, sigs, memo = memos.lend_again(names, arrays, batch)
        if again is not None:
            placed = again  # referenced again by lend_again; the except below gives them back
            dev_pool = memo.dev_pool
        else:
            if before_place is not None:
                before_place()
            zero_copy = True
            try:
                for arr in arrays:
                    found.append(find(pool, arr))
            except InvalidArgumentError as exc:
                if batch:  # say which item of the batch, keeping the error's type
                    name = names[len(found)]
                    item = f"item {name!r}" if name is not None else f"item {len(found)}"
                    exc.args = (f"{item}: {exc.args[0]}", *exc.args[1:]) if exc.args else (item,)
                raise
            if share_segments:
                lend_in_place(pool, found)
            for name, f in zip(names, found):
                block, f.block = f.block, None  # from here on place() owns it
                p = place(pool, name, f.src, f.itemsize, block, stream, timeout, auto)
                placed.append(p)
                # Remembered: arrays lent from this channel's own pool, which the channel holds anyway.
                zero_copy = zero_copy and p.block is block and type(block) is Block and block.pool is pool
            dev_pool = next((p.block.pool for p in placed if not p.block.pool.is_host), None)
            if zero_copy and sigs is None:  # the arrays' types are known now (inspect_array met them)
                sigs = signatures(arrays)
            if zero_copy and sigs is not None:
                memo = Memo(names, sigs, placed, dev_pool, batch)
        order, event, events = order_writes(dev_pool, stream, ordering)
    except BaseException:
        for p in placed:
            p.block.pool._unref(p.block)
        for f in found:  # found but not placed
            if f.block is not None:
                f.block.pool._unref(f.block)
        raise
    return Prepared(placed, memo, again is not None, order, event, events)
