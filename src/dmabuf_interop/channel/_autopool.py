"""The pools a channel makes for itself when it was given none.

A channel (or a listener) made without ``pool=`` copies what it sends into a pool made on first need: a
host pool for host arrays (NumPy, CPU tensors), a pool on the tensor's GPU for device arrays, sized by
:data:`AUTO_POOL_CHUNK_BYTES` and :data:`AUTO_POOL_MAX_BYTES`. A listener's pools are shared by every
channel it accepts (one chunk announced to each consumer, not one pool per consumer); a connected
channel has its own. They are closed when their owners have all gone: the listener and each channel
that used them, by ``close()`` or, as a safety net, when collected. An explicit pool stays the fast
path: arrays made with its ``empty()`` travel without a copy.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from ..errors import InvalidArgumentError
from .pool import SharedPool

__all__ = ["AUTO_POOL_CHUNK_BYTES", "AUTO_POOL_MAX_BYTES", "AutoPools", "Membership", "join"]

#: Bytes per chunk of a pool made on first need (device pools round it up to the allocation granularity).
AUTO_POOL_CHUNK_BYTES = 16 << 20
#: Most bytes each pool made on first need exports (one host pool, one per GPU): a larger array needs ``pool=``.
AUTO_POOL_MAX_BYTES = 1 << 30


class AutoPools:
    """The pools made on first need for one owner and the channels that share them: at most one host pool
    and one per GPU, closed when the last member leaves (:meth:`Membership.leave`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[int, SharedPool] = {}  # device ordinal, or -1 for the host -> pool
        self._members = 0

    def pool_for(self, device: int) -> SharedPool:
        """The pool to copy an array of ``device`` (a CUDA ordinal, or ``-1`` for host memory) into, made now
        if this is its first need.

        Raises:
            InvalidArgumentError: every member has left (the pools are closed).
            NoDriverError, CudaError, SyscallError: as :class:`.pool.SharedPool`.
        """
        with self._lock:
            if self._members <= 0:
                raise InvalidArgumentError("the channel's own pools are closed")
            pool = self._pools.get(device)
            if pool is None:
                pool = self._pools[device] = SharedPool(None if device < 0 else device,
                                                        chunk_bytes=AUTO_POOL_CHUNK_BYTES,
                                                        max_bytes=AUTO_POOL_MAX_BYTES)
            return pool

    @property
    def pools(self) -> list[SharedPool]:
        """The pools made so far."""
        with self._lock:
            return list(self._pools.values())

    def _join(self) -> None:
        with self._lock:
            self._members += 1

    @staticmethod
    def _leave(auto: "AutoPools", pid: int) -> None:
        if os.getpid() != pid:
            return  # an owner inherited through fork() and collected in the child: the pools are the parent's
        with auto._lock:
            auto._members -= 1
            last = auto._members == 0
            pools = list(auto._pools.values()) if last else []
            if last:
                auto._pools.clear()
        for pool in pools:  # outside the lock: closing tells every channel that has the pool's chunks
            pool.close()


class Membership:
    """One owner's share of an :class:`AutoPools`: ``leave()`` (idempotent) at its ``close()``, or when the
    owner is collected; never in a process that inherited the owner through ``fork()``."""

    __slots__ = ("pools", "leave")

    def __init__(self, owner: Any, pools: AutoPools) -> None:
        self.pools = pools
        pools._join()
        self.leave = weakref.finalize(owner, AutoPools._leave, pools, os.getpid())
        self.leave.atexit = False  # at exit the pools' own finalizers unexport them; nothing to tell a peer

    def pool_for(self, device: int) -> SharedPool:
        return self.pools.pool_for(device)


def join(owner: Any, shared: Membership | None = None) -> Membership:
    """``owner`` (a channel or listener made without a pool) joins the pools of ``shared`` (its listener's
    membership), or pools of its own."""
    return Membership(owner, shared.pools if shared is not None else AutoPools())
