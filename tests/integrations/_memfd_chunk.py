"""A host-memory chunk a broker can lend (memfd), for tests that have no GPU."""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

from dmabuf_interop.mechanisms.memfd import export_memfd, host_array

_ids = itertools.count(1 << 40)


class MemfdChunk:
    """One memfd of ``size`` bytes holding int32 ``base + i``; ``fds()`` yields it."""

    mechanism = "memfd"
    device_uuid = ""

    def __init__(self, size: int = 1 << 16, base: int = 0x1000) -> None:
        self.buf = export_memfd(size)
        self.id = next(_ids)
        self.size = size
        self.parts = [size]
        self.stale = False
        a = host_array(self.buf, "int32")
        a[:] = range(base, base + a.size)

    @contextlib.contextmanager
    def fds(self) -> Iterator[list[int]]:
        yield [self.buf.fd]


class Holds:
    """Records what a broker gives back."""

    def __init__(self) -> None:
        self.given: list[object] = []

    def __call__(self, hold: object) -> None:
        self.given.append(hold)
