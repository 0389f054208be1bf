"""What both ends of a torch-sharing broker connection share: the :class:`ShareHandle` a pickled
tuple carries (``args[7]``, beginning with :data:`MAGIC`), the peer check (``SO_PEERCRED``) and the
kernel boot id that tells a handle from another host. Torch-free, and imports nothing of the broker
or the client, so both import it.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from typing import Any

from ...channel.protocol import host_boot_id
from ...errors import InvalidArgumentError, SyscallError

__all__ = ["ShareHandle", "MAGIC", "peer_uid"]

#: First bytes of every handle this package makes (``args[7]`` of the pickled tuple).
MAGIC = b"dmabuf-interop/share/1\n"

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _boot_id() -> str:
    try:
        return host_boot_id()
    except SyscallError:
        return ""


_BOOT_ID = _boot_id()


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """``getsockopt(SO_PEERCRED)``: the peer's (pid, uid) as the kernel recorded them.

    Raises:
        SyscallError: the getsockopt failed.
    """
    try:
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError as exc:
        raise SyscallError("getsockopt(SO_PEERCRED)", exc) from exc
    return pid, uid


# --- the handle ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class ShareHandle:
    """What a pickled tuple carries to name a share: where the broker listens and which share.

    Attributes:
        address: the broker's socket path. pid: the producer's pid (in its own PID namespace).
        share: the share's id in that broker. token: 32 hex digits, the share's secret.
        boot_id: the producer's kernel boot id. device_uuid: the GPU holding the memory (``""``: host).
    """

    address: str
    pid: int
    share: int
    token: str
    boot_id: str
    device_uuid: str

    @property
    def producer(self) -> str:
        return f"pid {self.pid} (broker {self.address})"

    def to_bytes(self) -> bytes:
        return MAGIC + json.dumps(dataclasses.astuple(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: Any) -> "ShareHandle":
        """Parse and check a handle.

        Raises:
            InvalidArgumentError: not bytes of this format (a truncated or altered handle).
        """
        if not isinstance(raw, (bytes, bytearray)) or not bytes(raw[:len(MAGIC)]) == MAGIC or len(raw) > 4096:
            raise InvalidArgumentError("not a dmabuf-interop share handle")
        try:
            v = json.loads(bytes(raw[len(MAGIC):]).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidArgumentError(f"a malformed share handle: {exc}") from None
        types = (str, int, int, str, str, str)
        if (not isinstance(v, list) or len(v) != 6
                or not all(type(x) is t for x, t in zip(v, types))):  # noqa: E721 - bools are not ints here
            raise InvalidArgumentError("a malformed share handle: wrong fields")
        h = cls(*v)
        if (not h.address.startswith("/") or "\0" in h.address or h.pid <= 0 or h.share < 0
                or len(h.token) != 32 or any(c not in "0123456789abcdef" for c in h.token)):
            raise InvalidArgumentError("a malformed share handle: bad field values")
        return h


def _ints(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 1 << 16 and all(type(x) is int for x in v)  # noqa: E721
