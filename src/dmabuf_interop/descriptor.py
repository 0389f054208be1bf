"""`ShareDescriptor`: what travels beside a shareable fd, typed and validated on receipt.

An exporter describes its buffer with :meth:`ShareDescriptor.to_json` (a
JSON-ready dict, sent by :func:`~dmabuf_interop.fdpass.send_message` next to
the fd); the importer rebuilds it with :meth:`ShareDescriptor.from_json`,
which checks every field once, before anything is mapped: integers that are
not bools, floats or strings; no negatives; ``offset + size <=
export_size``; a known mechanism and memory kind; a device UUID of the form
``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``. A bad field raises
:class:`~dmabuf_interop.errors.ProtocolError` naming it.

Across a process boundary a GPU is identified by its UUID: an ordinal means
nothing in a process with another ``CUDA_VISIBLE_DEVICES``, so the exporter's
ordinal travels as ``exporter_device``, for messages only.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .errors import ProtocolError
from .kinds import MEMORY_KINDS, MECHANISM_NAMES

__all__ = ["ShareDescriptor", "UUID_RE"]

#: A CUDA device UUID as ``cuDeviceGetUuid`` gives it, formatted like ``nvidia-smi -L``.
UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

_INT_FIELDS = ("size", "offset", "export_size", "exporter_device")


@dataclass(frozen=True)
class ShareDescriptor:
    """What an importer needs beside the fd.

    Attributes:
        mechanism: ``"dmabuf"``, ``"posix-fd"`` or ``"memfd"``.
        memory: what backs it (``"host"``, ``"device"``, ``"vmm"``, ``"range"``, ``"memfd"``).
        size: the exporter's bytes (> 0).
        offset: where those bytes start inside the exported range (bytes, >= 0).
        export_size: bytes the fd covers (page or granularity aligned, >= offset + size).
        exporter_device: the exporter's CUDA ordinal *in the exporter's process* (-1 for memfd).
        device_uuid: the exporter's GPU UUID (``""`` for memfd); importers match GPUs by it.
        fallback: why a preferred mechanism was not used, or ``None``.
    """

    mechanism: str
    memory: str
    size: int
    offset: int
    export_size: int
    exporter_device: int = -1
    device_uuid: str = ""
    fallback: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the inverse of :meth:`from_json`)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ShareDescriptor":
        """Validate a received mapping and build the descriptor; unknown keys are ignored.

        Raises:
            ProtocolError: a missing field, a field of the wrong type or range, or sizes
                that do not fit (``offset + size > export_size``); the message names the field.
        """
        if isinstance(obj, ShareDescriptor):
            return obj
        if not isinstance(obj, Mapping):
            raise ProtocolError(f"a share descriptor is a JSON object, got {type(obj).__name__}")
        values: dict[str, Any] = {}
        for name in ("mechanism", "memory"):
            v = obj.get(name)
            known = MECHANISM_NAMES if name == "mechanism" else MEMORY_KINDS
            if v not in known or not isinstance(v, str):
                raise ProtocolError(f"descriptor field {name!r}: {v!r} is not one of {', '.join(known)}")
            values[name] = str(v)
        for name in _INT_FIELDS:
            if name not in obj:
                if name == "exporter_device":
                    values[name] = -1
                    continue
                raise ProtocolError(f"descriptor field {name!r} is missing")
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ProtocolError(f"descriptor field {name!r} must be an integer, got {type(v).__name__} {v!r}")
            values[name] = v
        if values["size"] <= 0:
            raise ProtocolError(f"descriptor field 'size' must be > 0, got {values['size']}")
        if values["offset"] < 0:
            raise ProtocolError(f"descriptor field 'offset' must be >= 0, got {values['offset']}")
        if values["exporter_device"] < -1:
            raise ProtocolError(f"descriptor field 'exporter_device' must be >= -1, got {values['exporter_device']}")
        if values["offset"] + values["size"] > values["export_size"]:
            raise ProtocolError(f"descriptor fields 'offset' {values['offset']} + 'size' {values['size']} exceed "
                                f"'export_size' {values['export_size']}")
        uuid = obj.get("device_uuid", "")
        if not isinstance(uuid, str) or (uuid and not UUID_RE.fullmatch(uuid)):
            raise ProtocolError(f"descriptor field 'device_uuid' {uuid!r} is not a GPU UUID "
                                f"(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) or ''")
        if values["mechanism"] != "memfd" and not uuid:
            raise ProtocolError(f"descriptor field 'device_uuid' is empty for a {values['mechanism']} share")
        fallback = obj.get("fallback")
        if fallback is not None and not isinstance(fallback, str):
            raise ProtocolError(f"descriptor field 'fallback' must be a string or null, got {type(fallback).__name__}")
        return cls(device_uuid=uuid, fallback=fallback, **values)
