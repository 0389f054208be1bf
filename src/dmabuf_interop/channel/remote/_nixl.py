"""NIXL for ``tcp://`` channels: the module, the agent of one channel (every call checked and locked), and
the address and UCX helpers."""

from __future__ import annotations

import atexit
import logging
import os
import re
import secrets
import socket
import threading
import urllib.parse
import weakref
from typing import Any

from ... import _forks
from ...errors import ForkedResourceError, InvalidArgumentError, NotSupportedError, PeerClosedError, TransferError

__all__ = ["Agent", "NIXL_EXTRA", "is_remote", "nixl_module", "parse_address", "ucx_read_transports"]

#: What a user installs to get the remote path: the wheel alone, as the README advises (the ``nixl``
#: extra's ``nixl-cu13`` declares torch, which it needs only for tensors).
NIXL_EXTRA = ("pip install --no-deps 'nixl-cu13==1.5.1' (or pip install 'dmabuf-interop[nixl]', "
              "which also installs torch)")


def is_remote(address: Any) -> bool:
    """Whether ``address`` is a ``tcp://HOST:PORT`` channel address."""
    return isinstance(address, str) and address.startswith("tcp://")


def nixl_module() -> Any:
    """The NIXL Python API module (``nixl_cu13``, ``nixl_cu12`` or ``nixl``); its ``nixl`` logger is set to
    ``WARNING`` unless ``$NIXL_LOG_LEVEL`` says otherwise.

    Raises:
        NotSupportedError: NIXL is not installed (the message names the extra to install).
    """
    import importlib

    errors = []
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs each agent at INFO on standard output, the caller's
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise NotSupportedError(f"tcp:// channels need NIXL, which is not importable ({'; '.join(errors)}): "
                            f"{NIXL_EXTRA}")


def parse_address(address: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"bad port in {address!r}: {exc}") from exc
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.username:
        raise InvalidArgumentError(f"a remote address is tcp://HOST:PORT, got {address!r}")
    return parts.hostname, port


def ucx_read_transports(proto_info: str) -> list[str]:
    """The UCX transports (``"tcp/lo"``, ``"cuda_copy/cuda"``, ...) that ``UCX_PROTO_INFO=y`` output shows for
    ``ucp_get`` (NIXL ``READ``), in the order first seen.

    UCX prints its protocol tables to standard output when ``UCX_PROTO_INFO=y``
    is set before the agent is created; pass that text here.
    """
    found: list[str] = []
    in_get = False
    for line in proto_info.splitlines():
        if "remote memory read by ucp_get" in line:
            in_get = True
            continue
        if not in_get:
            continue
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 5 and cells[1] and cells[1] != "Range":
            for t in re.split(r",\s*|\s+", cells[3]):
                m = re.match(r"(\d+%\s+on\s+)?([a-z_0-9]+/[\w:.\-]+)", t)
                if m and m.group(2) not in found:
                    found.append(m.group(2))
        elif len(cells) == 3 and cells[1] and "ucp_get" not in cells[1] and not cells[1].startswith("+"):
            in_get = False  # the title of the next table
    return found


class Agent:
    """A NIXL agent for one channel, its registrations (chunk id -> descriptor list), and a lock around it.

    NIXL agents are created without a listener thread (``NIXL_THREAD_SYNC_NONE``), so
    every call into one goes through ``lock``.
    """

    def __init__(self) -> None:
        nixl = nixl_module()
        self.name = f"dmabuf-interop-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        self.lock = threading.Lock()
        self.registered: dict[int, Any] = {}
        self.remotes: set[str] = set()
        self.closed = False
        self.owner = _forks.pid  # a forked child may not call into the parent's agent (Note in .channel)
        self.agent = self._call("nixl_agent", nixl.nixl_agent, self.name, nixl.nixl_agent_config(backends=["UCX"]))
        _LIVE_AGENTS.add(self)
        if "UCX" not in self.agent.backends:
            raise NotSupportedError(f"NIXL has no UCX backend here (plugins: {self.agent.plugin_list})")

    @staticmethod
    def _call(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own exception types for every status
            raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def _closed_error(self) -> Exception:
        if self.owner != _forks.pid:
            return ForkedResourceError("this NIXL agent", self.owner)
        return PeerClosedError("the channel is closed")

    def call(self, what: str, *args: Any) -> Any:
        with self.lock:
            if self.closed:
                raise self._closed_error()
            return self._call(what, getattr(self.agent, what), *args)

    def register(self, chunk: Any, host: bool) -> bytes | None:
        """Register a pool chunk once; returns its partial agent metadata when newly registered."""
        with self.lock:
            if self.closed:
                raise self._closed_error()
            if chunk.id in self.registered:
                return None
            mem, dev = ("DRAM", 0) if host else ("VRAM", chunk.device)
            descs = self._call("register_memory", self.agent.register_memory, [(chunk.ptr, chunk.size, dev, "")], mem)
            self.registered[chunk.id] = descs
            return self._call("get_partial_agent_metadata", self.agent.get_partial_agent_metadata, descs, False)

    def deregister(self, chunk_id: int) -> None:
        with self.lock:
            descs = self.registered.pop(chunk_id, None)
            if descs is not None and not self.closed:
                self._call("deregister_memory", self.agent.deregister_memory, descs)

    def close(self) -> None:
        """Deregister everything, forget the peers and destroy the agent (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            regs, self.registered = self.registered, {}
            remotes, self.remotes = self.remotes, set()
            for descs in regs.values():
                try:
                    self.agent.deregister_memory(descs)
                except Exception:  # noqa: BLE001 - deregister everything even if one fails
                    pass
            for name in remotes:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass
            # Destroy the agent now, while the interpreter is whole: left to interpreter exit, its
            # progress thread can still be running when the C++ runtime tears down (std::terminate).
            self.agent = None


#: Agents not closed yet: closed at interpreter exit (atexit runs before the interpreter is torn down),
#: so a channel its owner never closed does not leave NIXL's progress thread to the C++ runtime's exit.
_LIVE_AGENTS: "weakref.WeakSet[Agent]" = weakref.WeakSet()


#: The NIXL agents a forked child inherited: never called into nor destroyed there (their threads and UCX
#: state are the parent's; destroying one would join threads the child does not have).
_INHERITED: list[Any] = []


@atexit.register
def _close_live_agents() -> None:
    for agent in list(_LIVE_AGENTS):
        agent.close()


def _after_fork_in_child() -> None:
    """Every agent of the parent is closed in the child without a NIXL call, and kept from destruction."""
    for agent in list(_LIVE_AGENTS):
        agent.lock = threading.Lock()  # a parent thread may have held it
        agent.closed = True
        agent.registered, agent.remotes = {}, set()
        if agent.agent is not None:
            _INHERITED.append(agent.agent)
    _LIVE_AGENTS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
