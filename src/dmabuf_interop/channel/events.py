"""Interprocess CUDA events: the pool of events that device leases order the peer's reads with.

A lease of a device block carries one event (``cuIpcGetEventHandle``, 64
bytes on the wire as base64); the consumer opens it once
(``cuIpcOpenEventHandle``) and makes its stream wait on it. Events are made
once and reused: the lease gives its event back when the peer has released it.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["EventPool"]


class EventPool:
    """Interprocess CUDA events of one device, reused from send to send.

    ``cuEventCreate(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)`` and
    ``cuIpcGetEventHandle`` happen once per event; a lease gives its event back
    when the peer has released it (the peer's wait on it is queued by then).
    """

    def __init__(self, device: int | None) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._free: list[tuple[Any, bytes]] = []
        self.all: list[Any] = []  # every event made, destroyed by destroy()

    def take(self) -> tuple[Any, bytes]:
        """A free ``(CUevent, 64-byte IPC handle)``; made in ``device``'s primary context when none is free.

        Raises:
            CudaError: ``cuEventCreate`` or ``cuIpcGetEventHandle`` failed.
        """
        from .. import _driver as driver

        with self._lock:
            if self._free:
                return self._free.pop()
        driver.set_current(self.device)
        ev = driver.event_create_interprocess()
        pair = (ev, driver.ipc_get_event_handle(ev))
        with self._lock:
            self.all.append(ev)
        return pair

    def give(self, pair: tuple[Any, bytes]) -> None:
        with self._lock:
            self._free.append(pair)

    @staticmethod
    def destroy(events: list[Any], device: int | None) -> None:
        """``cuEventDestroy`` each of ``events`` (an :attr:`all` list), ignoring failures: used at close."""
        if not events:
            return
        from .. import _driver as driver

        for ev in events:
            try:
                driver.set_current(device)
                driver.event_destroy(ev)
            except Exception:  # noqa: BLE001 - destroying everything matters more than the first error
                pass
        events.clear()

