"""Mutual challenge-response over a control connection with a shared secret (HMAC-SHA256).

The secret never crosses the wire. Each side sends a fresh 32-byte nonce
(:func:`secrets.token_bytes`); each proves it holds the secret with
``HMAC-SHA256(secret, role || listener_nonce || connector_nonce)``, where the
role label differs per direction so that a reply cannot be reflected back.
Digests are compared with :func:`hmac.compare_digest`. Messages are JSON frames
(:mod:`.wire`), nothing is unpickled.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
import socket
import stat
from typing import Any

from .._time import deadline_after, remaining
from ..errors import InvalidArgumentError, PeerRefusedError, ProtocolError
from .handshake import recv_handshake_frame, refuse
from .wire import send_frame

__all__ = ["TOKEN_ENV", "load_secret", "authenticate_listener", "authenticate_connector"]

#: Environment variable read when neither ``token`` nor ``token_file`` is given.
TOKEN_ENV = "DMABUF_INTEROP_TOKEN"
#: Shortest secret accepted, bytes.
MIN_SECRET_BYTES = 16
_NONCE_BYTES = 32
_ROLES = (b"dmabuf-interop connector v1", b"dmabuf-interop listener v1")


def load_secret(token: str | bytes | None = None, token_file: str | os.PathLike[str] | None = None) -> bytes:
    """The shared secret: ``token``, else the contents of ``token_file`` (trailing newline stripped), else ``$DMABUF_INTEROP_TOKEN``.

    A ``token_file`` that group or others may read or write (any of mode ``0o077``) is read with a
    ``UserWarning`` naming its mode: keep it ``0600``.

    Raises:
        InvalidArgumentError: none given, both given, or shorter than 16 bytes.
        SyscallError: ``token_file`` cannot be read.
    """
    if token is not None and token_file is not None:
        raise InvalidArgumentError("give token or token_file, not both")
    if token_file is not None:
        from ..errors import SyscallError

        try:
            with open(token_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode  # of the file read, not of whatever the path names later
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise SyscallError(f"open({os.fspath(token_file)!r})", exc) from exc
        if mode & 0o077:
            import warnings

            # Warned, not refused: secrets mounted by orchestrators are often 0644 inside a private volume.
            warnings.warn(f"token_file {os.fspath(token_file)!r} is readable by group or others (mode "
                          f"{stat.S_IMODE(mode):#05o}): anyone who reads it can connect; chmod 600 it",
                          UserWarning, stacklevel=4)
    elif token is not None:
        secret = token.encode() if isinstance(token, str) else bytes(token)
    else:
        env = os.environ.get(TOKEN_ENV)
        if env is None:
            raise InvalidArgumentError(f"a tcp:// channel needs a shared secret: token=, token_file= or ${TOKEN_ENV}")
        secret = env.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(f"the shared secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                                   f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def _mac(secret: bytes, role: int, listener_nonce: bytes, connector_nonce: bytes) -> bytes:
    return hmac.new(secret, _ROLES[role] + listener_nonce + connector_nonce, hashlib.sha256).digest()


def _field(msg: dict[str, Any], kind: str, keys: set[str], b64: str, size: int) -> bytes:
    if msg.get("kind") == "refuse" and set(msg) == {"kind", "reason"} and isinstance(msg["reason"], str):
        raise PeerRefusedError(f"the peer refused this connection: {msg['reason'][:512]}")
    if msg.get("kind") != kind or set(msg) != keys:
        raise ProtocolError(f"expected a {kind!r} message with fields {sorted(keys)}")
    value = msg[b64]
    if not isinstance(value, str) or len(value) > 4 * size:
        raise ProtocolError(f"field {b64!r} must be base64 of {size} bytes")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"field {b64!r} is not base64: {exc}") from exc
    if len(raw) != size:
        raise ProtocolError(f"field {b64!r} holds {len(raw)} bytes, expected {size}")
    return raw


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def authenticate_listener(sock: socket.socket, secret: bytes, timeout: float | None) -> None:
    """Listener side: send a nonce, check the connector's proof, then prove ourselves; all of it within
    ``timeout`` seconds (a connector that sends part of its answer and stops is not given more).

    Raises:
        PeerRefusedError: the connector's proof is wrong (it is told so), or it refused us.
        ProtocolError: a malformed message. WaitTimeoutError: no answer within ``timeout``.
        PeerClosedError: the connector left.
    """
    deadline = deadline_after(timeout)
    mine = secrets.token_bytes(_NONCE_BYTES)
    send_frame(sock, {"kind": "challenge", "nonce": _b64(mine)}, timeout=remaining(deadline))
    msg, _ = recv_handshake_frame(sock, remaining(deadline))
    theirs = _field(msg, "auth", {"kind", "nonce", "mac"}, "nonce", _NONCE_BYTES)
    mac = _field(msg, "auth", {"kind", "nonce", "mac"}, "mac", hashlib.sha256().digest_size)
    if not hmac.compare_digest(mac, _mac(secret, 0, mine, theirs)):
        refuse(sock, "authentication failed: wrong shared secret")
        raise PeerRefusedError("refused a connection: wrong shared secret")
    send_frame(sock, {"kind": "proof", "mac": _b64(_mac(secret, 1, mine, theirs))}, timeout=remaining(deadline))


def authenticate_connector(sock: socket.socket, secret: bytes, timeout: float | None) -> None:
    """Connector side: answer the listener's nonce with ours and a proof, then check the listener's proof.

    Raises:
        PeerRefusedError: the listener refused us (wrong secret), or its proof is wrong.
        ProtocolError, WaitTimeoutError, PeerClosedError: as :func:`authenticate_listener`.
    """
    deadline = deadline_after(timeout)
    msg, _ = recv_handshake_frame(sock, remaining(deadline))
    theirs = _field(msg, "challenge", {"kind", "nonce"}, "nonce", _NONCE_BYTES)
    mine = secrets.token_bytes(_NONCE_BYTES)
    send_frame(sock, {"kind": "auth", "nonce": _b64(mine), "mac": _b64(_mac(secret, 0, theirs, mine))},
               timeout=remaining(deadline))
    msg, _ = recv_handshake_frame(sock, remaining(deadline))
    mac = _field(msg, "proof", {"kind", "mac"}, "mac", hashlib.sha256().digest_size)
    if not hmac.compare_digest(mac, _mac(secret, 1, theirs, mine)):
        refuse(sock, "authentication failed: the listener's proof is wrong")
        raise PeerRefusedError("the listener does not hold the shared secret")
