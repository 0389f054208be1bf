"""Channels: long-lived processes stream arrays to each other zero-copy through a pool exported once.

A producer creates a :class:`SharedPool` (host memfds, or CUDA VMM chunks
exported as POSIX fds), :func:`listen`\\ s on an address, and lends arrays to
each consumer that :func:`connect`\\ s: every chunk's fd crosses a connection
once (``SCM_RIGHTS``); each array afterwards is a JSON descriptor. A
:class:`Lease` completes when the consumer releases the block. torch tensors
in expandable segments are lent in place, their pages exported as they are
(:mod:`.segments`). See
``docs/channel.md`` for the wire protocol and the security model.
"""

from __future__ import annotations

from ._autopool import AUTO_POOL_CHUNK_BYTES, AUTO_POOL_MAX_BYTES
from .channel import Channel, Lease, PeerInfo, Received, as_tensors, mechanism_for, release_all
from .pool import ALIGN, DeviceView, SharedPool
from .protocol import PROTOCOL_VERSION, ArrayDescriptor, parse_message
from .rendezvous import Listener, connect, listen
from .segments import release_segments

__all__ = [
    "ALIGN", "AUTO_POOL_CHUNK_BYTES", "AUTO_POOL_MAX_BYTES", "ArrayDescriptor", "Channel", "DeviceView", "Lease",
    "Listener", "PROTOCOL_VERSION", "PeerInfo", "Received",
    "SharedPool", "as_tensors", "connect", "listen", "mechanism_for", "parse_message", "release_all", "release_segments",
]
