"""What both ends of weight sync share: the batch ``meta`` protocol, the dtypes, sizes."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ProtocolError

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


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is what weight sync moves
        from ..errors import NotSupportedError

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
