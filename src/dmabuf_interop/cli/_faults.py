"""Fault injection for the tests of dying peers: one switch, read at named points of the demos.

``DMABUF_INTEROP_FAULT=child-<action>-<point>`` in a demo run's environment
makes the forked producer misbehave when it reaches ``<point>``
(``before-send``, ``before-ack``): ``sigkill`` kills it, ``hang`` stops it
for an hour, ``exit`` makes :func:`fault` return True so the caller leaves
early. Unset, every point is a no-op.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["FAULT_ENV", "fault"]

FAULT_ENV = "DMABUF_INTEROP_FAULT"


def fault(point: str) -> bool:
    """Act on the injected fault for ``point``, if any; True when the caller should leave early."""
    want = os.environ.get(FAULT_ENV, "")
    if not want.endswith("-" + point):
        return False
    action = want[: -len(point) - 1].removeprefix("child-")
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        time.sleep(3600)
    return action == "exit"
