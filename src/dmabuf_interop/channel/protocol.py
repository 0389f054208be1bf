"""The channel wire protocol: message kinds, the array descriptor, and their validation.

Every message is one JSON object with a ``"kind"`` (see ``docs/channel.md``).
Nothing a peer sends is used before :func:`parse_message` (and, for arrays,
:meth:`ArrayDescriptor.from_json`) has checked every field: exact key sets,
ints that are ints (a JSON ``true`` is not ``1``), non-negative sizes, known
dtypes, and a layout that stays inside its block. A failure raises
:class:`~..errors.ProtocolError`; the channel then closes the connection
without mapping anything.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProtocolError
from ._ring_region import check_offer

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_META_BYTES",
    "MAX_NDIM",
    "MAX_CHUNKS",
    "MAX_NAME_CHARS",
    "MAX_ITEMS",
    "MAX_LAYOUTS",
    "MAX_SINGLE_LAYOUTS",
    "MAX_PARTS",
    "DTYPES",
    "ORDERINGS",
    "ArrayDescriptor",
    "parse_message",
    "parse_region",
    "parse_nixl",
    "MAX_METADATA_BYTES",
    "host_boot_id",
    "visible_gpu_uuids",
]

#: Bumped on any incompatible change of the messages below (2: ``arrays`` may define a ``layout``,
#: and ``repeat`` lends the arrays of one again; 3: a ``chunk`` lists its ``parts``; 4: an ``array``
#: may define a layout too, and its ``repeat`` arrives as one array; 5: the float8 kinds, ``complex32``
#: and ``float4_e2m1fn_x2`` are dtypes, and a descriptor may name 64 dimensions; 6: ``hello`` offers a
#: shared-memory ``ring``, and a ``ring`` message sets it up). A peer of another version is refused at the
#: handshake, so neither end ever meets a dtype name it does not know.
PROTOCOL_VERSION = 6

# The limits. Both ends read them from here: the receiver refuses a message past one (ProtocolError,
# the connection ends), so the sender checks the same limit first and refuses the call
# (InvalidArgumentError), nothing sent and the channel still up.

#: Largest caller ``meta`` per array, as compact JSON, in bytes.
MAX_META_BYTES = 64 * 1024
#: Largest number of dimensions a descriptor may name (DLPack has no limit; NumPy's, and torch's, is 64).
MAX_NDIM = 64
#: Most chunks (``chunk`` or ``region`` messages) one end may have announced to the other and not retired,
#: per connection: a bound on what a peer can make this process map.
MAX_CHUNKS = 4096
#: Longest ``name`` of an array in a ``send_many`` mapping, in characters.
MAX_NAME_CHARS = 4096
#: Largest number of arrays in one ``arrays`` message (:meth:`Channel.send_many`).
MAX_ITEMS = 65536
#: Layouts each end remembers: the last this many ``arrays`` messages that defined one (first in, first out).
MAX_LAYOUTS = 16
#: Layouts of one array each end remembers, apart from the batches': the last this many ``array`` messages
#: that defined one (first in, first out); a ring of blocks sent again and again stays known.
MAX_SINGLE_LAYOUTS = 256
#: Most physical allocations one device chunk may join (one fd each, all on one message: ``SCM_MAX_FD``).
MAX_PARTS = 253
#: Largest int accepted in any size, offset, id or stride (2**62: far beyond any pool, below int64).
MAX_INT = 1 << 62
#: Largest NIXL metadata blob accepted from a peer (``nixl`` and ``region`` messages of ``tcp://`` channels), bytes.
MAX_METADATA_BYTES = 1 << 20
#: Every block starts at a multiple of this many bytes of its chunk (``pool.ALIGN`` is this value).
BLOCK_ALIGN = 256

#: dtype names accepted on the wire -> itemsize in bytes: NumPy's ``dtype.name`` spellings, and for the
#: dtypes NumPy lacks the names torch and ml_dtypes share (``torch.float8_e4m3fn``,
#: ``ml_dtypes.float8_e4m3fn``): every such dtype that DLPack describes as it lies in memory, one
#: element per itemsize. ``complex32`` is torch's ``chalf`` (two float16); ``float4_e2m1fn_x2`` is torch's
#: byte of two packed FP4 values. (ml_dtypes' sub-byte types, ``float4_e2m1fn``, ``float6_*``, ``int4``
#: and kin, hold one value per byte, which DLPack's packed sub-byte types do not describe.)
#: Byte order is always little-endian (x86-64 and aarch64 hosts, CUDA devices).
DTYPES: dict[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e4m3b11fnuz": 1, "float8_e3m4": 1, "float8_e4m3": 1, "float4_e2m1fn_x2": 1, "complex32": 4,
}

#: How the consumer learns that the producer's writes are complete:
#: ``none`` (host pool: the writes happened before ``send`` returned), ``event``
#: (an interprocess CUDA event to wait on), ``sync`` (the producer synchronised its stream).
ORDERINGS = ("none", "event", "sync")

_EVENT_HANDLE_BYTES = 64


def _int(obj: dict[str, Any], key: str, lo: int = 0, hi: int = MAX_INT) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(f"field {key!r} = {v} is outside [{lo}, {hi}]")
    return v


def _str(obj: dict[str, Any], key: str, max_len: int = 256) -> str:
    v = obj.get(key)
    if not isinstance(v, str):
        raise ProtocolError(f"field {key!r} must be a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(f"field {key!r} is {len(v)} characters, more than {max_len}")
    return v


def _keys(obj: Any, required: "set[str] | frozenset[str]", what: str) -> None:
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(obj).__name__}")
    if obj.keys() != required:
        got = set(obj)
        missing, extra = sorted(required - got), sorted(got - required)
        raise ProtocolError(f"{what} has the wrong fields (missing {missing}, unexpected {extra})")


def _int_list(obj: dict[str, Any], key: str, max_len: int) -> tuple[int, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or len(v) > max_len:
        raise ProtocolError(f"field {key!r} must be a list of at most {max_len} integers")
    out = []
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INT:
            raise ProtocolError(f"field {key!r} holds {x!r}: expected integers in [0, {MAX_INT}]")
        out.append(x)
    return tuple(out)


@dataclass(frozen=True)
class ArrayDescriptor:
    """Where one array lies in a shared pool and how to read it.

    Attributes:
        chunk: id of the pool chunk (announced before with a ``chunk`` message).
        block_offset: the block's start inside the chunk, bytes (a multiple of 256).
        block_bytes: the block's size, bytes.
        byte_offset: the array's first element relative to the block's start, bytes.
        shape: elements per dimension (``()`` for a scalar).
        strides: bytes between consecutive elements per dimension, non-negative
            multiples of the itemsize (so DLPack can describe them).
        dtype: a name from :data:`DTYPES`.
        ordering: one of :data:`ORDERINGS`.
        event: the base64 ``cuIpcGetEventHandle`` bytes when ``ordering == "event"``, else ``None``.
        name: the key of this array in a ``send_many`` batch, else ``None``.
        meta: the sender's JSON object (at most :data:`MAX_META_BYTES`), or ``None``.
    """

    chunk: int
    block_offset: int
    block_bytes: int
    byte_offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    ordering: str = "none"
    event: str | None = None
    name: str | None = None
    meta: dict[str, Any] | None = field(default=None, compare=False)

    _FIELDS = frozenset({"chunk", "block_offset", "block_bytes", "byte_offset", "shape", "strides", "dtype",
                         "ordering", "event", "name", "meta"})

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes the elements occupy (``prod(shape) * itemsize``)."""
        return math.prod(self.shape) * self.itemsize

    def extent(self) -> int:
        """One past the last byte the layout touches, relative to the block's start (0 for an empty array)."""
        if any(s == 0 for s in self.shape):
            return 0
        return self.byte_offset + sum((n - 1) * st for n, st in zip(self.shape, self.strides)) + self.itemsize

    def is_c_contiguous(self) -> bool:
        expect = self.itemsize
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and st != expect:
                return False
            expect *= n
        return True

    @functools.cached_property
    def elements(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(shape, strides, offset) in elements, the offset from the chunk's start: ``as_strided``'s
        arguments over the chunk (computed once per descriptor; a repeated layout reuses it)."""
        size = DTYPES[self.dtype]
        return self.shape, tuple(st // size for st in self.strides), (self.block_offset + self.byte_offset) // size

    @functools.cached_property
    def span(self) -> int:
        """Bytes from the first element to one past the last byte the layout touches (at least 1)."""
        return max(self.extent() - self.byte_offset, 1)

    @functools.cached_property
    def view_plan(self) -> tuple[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``((chunk, dtype), elements)``: which chunk view a tensor of this array is cut from, and how."""
        return (self.chunk, self.dtype), self.elements

    def event_handle(self) -> bytes | None:
        """The decoded 64-byte event handle, or ``None``."""
        return None if self.event is None else base64.b64decode(self.event)

    def to_json(self) -> dict[str, Any]:
        """The JSON object that travels in ``array`` / ``arrays`` messages. Not validated here: the
        sender builds it from its own pool's blocks after checking the caller's array, and the
        receiver validates it (:meth:`from_json`)."""
        return {"chunk": self.chunk, "block_offset": self.block_offset, "block_bytes": self.block_bytes,
                "byte_offset": self.byte_offset, "shape": list(self.shape), "strides": list(self.strides),
                "dtype": self.dtype, "ordering": self.ordering, "event": self.event, "name": self.name,
                "meta": self.meta}

    @classmethod
    def from_json(cls, obj: Any) -> "ArrayDescriptor":
        """Validate a peer's descriptor and build it.

        Raises:
            ProtocolError: a missing or unexpected field, a non-integer (or
                bool) where an integer belongs, a negative size, offset or
                stride, an unknown dtype or ordering, a stride that is not a
                multiple of the itemsize, a malformed event handle, ``meta``
                that is not an object or is over :data:`MAX_META_BYTES`, or a
                layout reaching outside ``block_bytes``.
        """
        # Fast checks first (a batch has thousands of items); a failure is re-checked by the
        # helpers, which raise with the precise message. type(v) is int also refuses bools.
        if type(obj) is not dict or obj.keys() != cls._FIELDS:
            _keys(obj, cls._FIELDS, "array descriptor")
        chunk, block_offset, block_bytes, byte_offset = (obj["chunk"], obj["block_offset"], obj["block_bytes"],
                                                         obj["byte_offset"])
        for key, v in (("chunk", chunk), ("block_offset", block_offset), ("block_bytes", block_bytes),
                       ("byte_offset", byte_offset)):
            if type(v) is not int or not 0 <= v <= MAX_INT:
                _int(obj, key)
        if block_offset % BLOCK_ALIGN:
            raise ProtocolError(f"block_offset {block_offset} is not a multiple of {BLOCK_ALIGN}")
        shape, strides = obj["shape"], obj["strides"]
        for key, v in (("shape", shape), ("strides", strides)):
            if type(v) is not list or len(v) > MAX_NDIM or not all(type(x) is int and 0 <= x <= MAX_INT for x in v):
                _int_list(obj, key, MAX_NDIM)
        shape, strides = tuple(shape), tuple(strides)
        if len(shape) != len(strides):
            raise ProtocolError(f"shape has {len(shape)} dimensions but strides has {len(strides)}")
        dtype = obj["dtype"]
        itemsize = DTYPES.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise ProtocolError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
        if itemsize > 1 and any(st % itemsize for st in strides):
            raise ProtocolError(f"strides {strides} are not multiples of the {itemsize}-byte itemsize")
        if byte_offset % itemsize:
            raise ProtocolError(f"byte_offset {byte_offset} is not a multiple of the {itemsize}-byte itemsize")
        ordering, event = obj["ordering"], obj["event"]
        if ordering != "sync" or event is not None:
            _check_ordering(ordering, event)
        name = obj["name"]
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
            raise ProtocolError(f"name must be a string of at most {MAX_NAME_CHARS} characters, or null")
        meta = obj["meta"]
        if meta is not None:
            _check_meta(meta)
        extent = 0 if 0 in shape else byte_offset + itemsize + sum((n - 1) * st for n, st in zip(shape, strides))
        if extent > block_bytes:
            raise ProtocolError(f"shape {shape} with strides {strides} from byte {byte_offset} reaches byte "
                                f"{extent}, outside its {block_bytes}-byte block")
        # Validated: fill the frozen instance directly (the generated __init__ pays one
        # object.__setattr__ per field, a third of this method's time).
        desc = object.__new__(cls)
        desc.__dict__.update(chunk=chunk, block_offset=block_offset, block_bytes=block_bytes, byte_offset=byte_offset,
                             shape=shape, strides=strides, dtype=dtype, ordering=ordering, event=event, name=name,
                             meta=meta)
        return desc


def _check_ordering(ordering: Any, event: Any) -> None:
    if ordering not in ORDERINGS:
        raise ProtocolError(f"unknown ordering {ordering!r}; accepted: {', '.join(ORDERINGS)}")
    if ordering == "event":
        if not isinstance(event, str) or len(event) > 128:
            raise ProtocolError("ordering 'event' needs a base64 event handle")
        try:
            raw = base64.b64decode(event, validate=True)
        except ValueError as exc:
            raise ProtocolError(f"event handle is not base64: {exc}") from exc
        if len(raw) != _EVENT_HANDLE_BYTES:
            raise ProtocolError(f"event handle is {len(raw)} bytes, not {_EVENT_HANDLE_BYTES}")
    elif event is not None:
        raise ProtocolError(f"an event handle came with ordering {ordering!r}")


def _check_meta(meta: Any) -> None:
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta must be a JSON object or null, got {type(meta).__name__}")
    size = len(json.dumps(meta, separators=(",", ":")).encode())
    if size > MAX_META_BYTES:
        raise ProtocolError(f"meta is {size} bytes of JSON, more than {MAX_META_BYTES}")


# --- messages ---------------------------------------------------------------------

_HELLO = frozenset({"kind", "protocol", "library", "boot_id", "gpus", "pid", "ring"})


def _check_hello(msg: dict[str, Any]) -> None:
    _keys(msg, _HELLO, "hello message")
    _int(msg, "protocol", 0, 1 << 31)
    if msg["ring"] is not None:
        _int(msg, "ring", 1, 1 << 31)
    _str(msg, "library", 64)
    _str(msg, "boot_id", 64)
    _int(msg, "pid", 0, 1 << 31)
    gpus = msg["gpus"]
    if not isinstance(gpus, list) or len(gpus) > 1024 or not all(isinstance(g, str) and len(g) <= 64 for g in gpus):
        raise ProtocolError("hello: gpus must be a list of GPU UUID strings")


def _check_chunk(msg: dict[str, Any]) -> None:
    _keys(msg, {"kind", "chunk", "size", "mechanism", "device_uuid", "parts"}, "chunk message")
    _int(msg, "chunk")
    size = _int(msg, "size", 1)
    if msg["mechanism"] not in ("memfd", "posix-fd"):
        raise ProtocolError(f"chunk: unknown mechanism {msg['mechanism']!r}")
    _str(msg, "device_uuid", 64)
    parts = _int_list(msg, "parts", MAX_PARTS)
    if not parts or 0 in parts or sum(parts) != size:
        raise ProtocolError(f"chunk: parts {list(parts)[:8]} must be positive sizes adding up to size {size}")
    if len(parts) > 1 and msg["mechanism"] != "posix-fd":
        raise ProtocolError(f"chunk: a {msg['mechanism']} chunk has one part")


_MAX_RELEASED = 1 << 20  # the most ids in one list (a release's leases)


def _check_ids(msg: dict[str, Any], key: str, what: str) -> None:
    ids = msg.get(key)
    if not isinstance(ids, list) or len(ids) > _MAX_RELEASED:
        raise ProtocolError(f"{what}: {key!r} must be a list of integers")
    for x in ids:
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_INT:
            raise ProtocolError(f"{what}: {key!r} holds {x!r}, not an id")


_ARRAY = frozenset({"kind", "lease", "desc"})
_ARRAY_LAYOUT = _ARRAY | {"layout"}


def _check_array(msg: dict[str, Any]) -> list[ArrayDescriptor]:
    if msg.keys() != _ARRAY_LAYOUT:
        _keys(msg, _ARRAY, "array message")
    else:
        _int(msg, "layout")
    _int(msg, "lease")
    return [ArrayDescriptor.from_json(msg["desc"])]


_ARRAYS = frozenset({"kind", "lease", "items", "mapping"})
_ARRAYS_LAYOUT = _ARRAYS | {"layout"}
_REPEAT = frozenset({"kind", "lease", "layout", "ordering", "event", "meta"})


def _check_arrays(msg: dict[str, Any]) -> list[ArrayDescriptor]:
    if msg.keys() != _ARRAYS_LAYOUT:
        _keys(msg, _ARRAYS, "arrays message")
    else:
        _int(msg, "layout")
        if not msg["items"]:
            raise ProtocolError("arrays: a layout needs at least one item")
    _int(msg, "lease")
    if not isinstance(msg["mapping"], bool):
        raise ProtocolError("arrays: 'mapping' must be true or false")
    items = msg["items"]
    if not isinstance(items, list) or len(items) > MAX_ITEMS:
        raise ProtocolError(f"arrays: 'items' must be a list of at most {MAX_ITEMS} descriptors")
    descs = [ArrayDescriptor.from_json(d) for d in items]
    if msg["mapping"]:
        names = [d.name for d in descs]
        if any(n is None for n in names) or len(set(names)) != len(names):
            raise ProtocolError("arrays: a mapping batch needs a distinct name on every item")
    return descs


_RELEASE = frozenset({"kind", "leases"})
_NO_EVENT = ("none", "sync")


def parse_message(msg: Any) -> tuple[str, list[ArrayDescriptor]]:
    """Validate one decoded message; returns its kind and, for array messages, the descriptors.

    Kinds: ``hello``, ``refuse``, ``ring``, ``chunk``, ``retire``, ``array``, ``arrays``, ``repeat``,
    ``release``, ``bye``. A ``repeat`` names a layout that only the channel knows: it returns no descriptors.

    Raises:
        ProtocolError: an unknown kind or any malformed field.
    """
    # Speed trick, measured: the two messages of every hand-off, a ``repeat`` with no event or meta and a
    # ``release``, checked in one expression (the same checks as _parse_general: exact keys, ints that are
    # ints in [0, MAX_INT], a known ordering; 0.25 us instead of 0.7 us a repeat, 0.2 instead of 0.55 a
    # release, on the 2-core CI machine). It only accepts: anything else, and every refusal with its
    # message, is the general path's (tests/channel/test_fastpath.py compares both on mutated messages).
    if type(msg) is dict:
        kind = msg.get("kind")
        if kind == "repeat":
            if (msg.keys() == _REPEAT and type(lease := msg["lease"]) is int and 0 <= lease <= MAX_INT
                    and type(layout := msg["layout"]) is int and 0 <= layout <= MAX_INT
                    and msg["event"] is None and msg["meta"] is None and msg["ordering"] in _NO_EVENT):
                return kind, []
        elif kind == "release":
            if (msg.keys() == _RELEASE and type(leases := msg["leases"]) is list and len(leases) <= _MAX_RELEASED
                    and all(type(x) is int and 0 <= x <= MAX_INT for x in leases)):
                return kind, []
    return _parse_general(msg)


def _parse_general(msg: Any) -> tuple[str, list[ArrayDescriptor]]:
    """:func:`parse_message` for every message, each field checked on its own with its own error."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message is a JSON object, got {type(msg).__name__}")
    kind = msg.get("kind")
    if kind == "hello":
        _check_hello(msg)
    elif kind == "refuse":
        _keys(msg, {"kind", "reason"}, "refuse message")
        _str(msg, "reason", 4096)
    elif kind == "chunk":
        _check_chunk(msg)
    elif kind == "retire":
        _keys(msg, {"kind", "chunk"}, "retire message")
        _int(msg, "chunk")
    elif kind == "array":
        return kind, _check_array(msg)
    elif kind == "arrays":
        return kind, _check_arrays(msg)
    elif kind == "repeat":
        _keys(msg, _REPEAT, "repeat message")
        _int(msg, "lease")
        _int(msg, "layout")
        _check_ordering(msg["ordering"], msg["event"])
        _check_meta(msg["meta"])
    elif kind == "release":
        _keys(msg, {"kind", "leases"}, "release message")
        _check_ids(msg, "leases", "release")
    elif kind == "bye":
        _keys(msg, {"kind"}, "bye message")
    elif kind == "ring":
        check_offer(msg)  # (the ring's own rules: version, power-of-two lengths, the region's size)
    else:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return kind, []


# --- tcp:// messages (NIXL) ---------------------------------------------------------

def _b64_field(msg: dict[str, Any], key: str, limit: int) -> bytes:
    v = msg.get(key)
    if not isinstance(v, str) or len(v) > 4 * limit // 3 + 4:
        raise ProtocolError(f"field {key!r} must be base64 of at most {limit} bytes")
    try:
        return base64.b64decode(v, validate=True)
    except ValueError as exc:  # (binascii.Error is a ValueError)
        raise ProtocolError(f"field {key!r} is not base64: {exc}") from exc


def parse_region(msg: dict[str, Any]) -> bytes:
    """Validate a ``region`` message (a producer chunk registered with NIXL, on ``tcp://`` channels):
    ``chunk`` (>= 1), ``addr``, ``size`` (>= 1), ``device`` (0..65536), ``mem`` (``"DRAM"`` or
    ``"VRAM"``), ``metadata`` (base64 of at most :data:`MAX_METADATA_BYTES`). Returns the metadata's bytes.

    Raises:
        ProtocolError: any malformed field.
    """
    _keys(msg, {"kind", "chunk", "addr", "size", "device", "mem", "metadata"}, "region message")
    _int(msg, "chunk", 1)
    _int(msg, "addr")
    _int(msg, "size", 1)
    _int(msg, "device", 0, 1 << 16)
    if msg["mem"] not in ("DRAM", "VRAM"):
        raise ProtocolError(f"region memory type must be DRAM or VRAM, got {msg['mem']!r}")
    return _b64_field(msg, "metadata", MAX_METADATA_BYTES)


def parse_nixl(msg: dict[str, Any], own_agent: str) -> bytes:
    """Validate the ``nixl`` handshake message of a ``tcp://`` channel (``agent``: a name of 1 to 256
    characters, not ``own_agent``; ``metadata``: base64 of at most :data:`MAX_METADATA_BYTES`).
    Returns the metadata's bytes.

    Raises:
        ProtocolError: any malformed field.
    """
    _keys(msg, {"kind", "agent", "metadata"}, "nixl message")
    if not isinstance(msg["agent"], str) or not 0 < len(msg["agent"]) <= 256 or msg["agent"] == own_agent:
        raise ProtocolError("nixl message: agent must be a name of 1 to 256 characters, not ours")
    return _b64_field(msg, "metadata", MAX_METADATA_BYTES)


# --- identity -----------------------------------------------------------------------

@functools.cache
def host_boot_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``): equal on both ends only on one host. Read
    once per process, then remembered (it is fixed until the machine boots again).

    Raises:
        SyscallError: the file cannot be read.
    """
    from ..errors import SyscallError

    try:
        # Bytes: a text read looks up a codec, whose first lookup imports it (~0.3 ms of every process's first
        # handshake, on both ends).
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError as exc:
        raise SyscallError("open(/proc/sys/kernel/random/boot_id)", exc) from exc


def visible_gpu_uuids(initialise: bool = False) -> list[str]:
    """UUIDs of the GPUs this process can see (``cuDeviceGetUuid``), or ``[]``.

    CUDA is left alone unless ``initialise`` is true or this process has
    already initialised it: a process with no GPU work (a host pool) must not
    pay for, or be forked after, ``cuInit``. Without a driver the answer is ``[]``.
    """
    from .. import _driver as driver
    from ..errors import DmaBufError

    if not (initialise or driver.is_initialized()):
        return []
    try:
        return [driver.device_uuid(i) for i in range(driver.device_count())]
    except DmaBufError:
        return []
