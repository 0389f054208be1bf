"""The benchmark's process protocol: every message between parent, producer and consumer.

A pair runs as three processes joined by AF_UNIX stream sockets, every message
one JSON frame of :func:`~dmabuf_interop.fdpass.send_message` /
:func:`~dmabuf_interop.fdpass.recv_message`, fds by ``SCM_RIGHTS``:

* ``CTL`` parent <-> each child; ``PC`` producer <-> consumer;
* ``AUX`` producer <-> consumer, used only by the torch peer, whose own
  ``Connection`` carries torch's pickled tensor (the one thing it measures).

Each message is a dict with ``"kind"``; :data:`SPEC` lists the fields of
each kind and their JSON types, ``?`` marking optional ones:

=========  ===============  =================================================================
kind       direction        fields
=========  ===============  =================================================================
config     parent -> child  mechanism, sizes [bytes], reps, warmup, devices [P, C], timeout (s),
                            spin? (s the consumer polls before it sleeps; 0 or absent: it blocks;
                            ``"auto"``: a channel's adaptive spin)
hello      child -> parent  role, status (``ok``/``not installed``/``unsupported``/``error``),
                            reason?, versions?, pid?
rec        child -> parent  t: three ``CLOCK_MONOTONIC`` ns stamps (producer: t0, t_exp, t_send;
                            consumer: t_recv, t_imp, t_read, the last two ``null`` without an
                            import); steps? (driver call -> ns); first_share?
first      child -> parent  t: the stamps of the run's very first hand-off (first cell, first warm-up),
                            before the first cell's ``rec`` s
cell       child -> parent  size, import? (the consumer's import status), cpu? (``loop_ns``: process
                            CPU time over the timed repetitions, ``handoff_ns``: the part inside
                            produce / consume), ring? (the channels: whether the connection uses
                            the shared-memory ring, ``Channel.ring``); after its ``rec`` s
idle       child -> parent  cpu_ns, wall_ns: the consumer's process CPU time while it waited with
                            nothing sent, after the last cell
bw         child -> parent  result: one size of the bandwidth pass
overhead   child -> parent  result: the Python-overhead measurement
done       child -> parent  role
error      child -> parent  reason, unsupported
ready      consumer -> prod size: the consumer is set up for this cell
handoff    producer -> cons rep and the mechanism's fields (below); an fd where the mechanism has one
ack        consumer -> prod rep: the consumer has released this repetition's import
pool       producer -> cons (cuda-core-ipc, once) the memory pool's allocation handle as the fd
channel    producer -> cons (channel, channel-host, once) address: the path the producer listens on
service    producer -> cons (iceoryx2, once per cell) name: the iceoryx2 service of the cell
idle       consumer -> prod (mechanisms that measure it) the idle wait is over: the producer may close
=========  ===============  =================================================================

Hand-off fields: ``descriptor`` (a :class:`~dmabuf_interop.ShareDescriptor`)
for posix-fd, dmabuf, memfd and the bandwidth pass; ``alloc``, ``offset``,
``size``, ``export_size?`` for posix-fd-cached; ``handle`` (hex) and
``offset`` for cupy-ipc; ``payload`` (hex) and ``size`` for cuda-core-ipc.

One latency cell::

    consumer -> producer  ready
    warm-up + reps times:  producer: t0, export, t_exp, t_send, handoff
                           consumer: receive, t_recv, import, t_imp, read 4 bytes, t_read,
                                     release, ack
                           producer: release after the ack
    each child -> parent  one rec per timed repetition, then cell

Every received message goes through :func:`check` before any field is used;
nothing is unpickled.
"""

from __future__ import annotations

from typing import Any

from ...errors import ProtocolError
from ...fd import OwnedFd

__all__ = ["SPEC", "STATUSES", "check", "make", "take_fd"]

STATUSES = ("ok", "not installed", "unsupported", "error")

_NUM = (int, float)
#: kind -> {field: JSON type(s)}; a name ending in ``?`` is optional.
SPEC: dict[str, dict[str, Any]] = {
    "config": {"mechanism": str, "sizes": list, "reps": int, "warmup": int, "devices": list, "timeout": _NUM,
               "spin?": (int, float, str)},
    "hello": {"role": str, "status": str, "reason?": (str, type(None)), "versions?": dict, "pid?": int},
    "rec": {"t": list, "steps?": dict, "first_share?": bool},
    "first": {"t": list},
    "cell": {"size": int, "import?": str, "cpu?": dict, "ring?": bool},
    "idle": {"cpu_ns?": int, "wall_ns?": int},
    "bw": {"result": dict},
    "overhead": {"result": dict},
    "done": {"role": str},
    "error": {"reason": str, "unsupported": bool},
    "ready": {"size": int},
    "handoff": {"rep": int, "descriptor?": dict, "alloc?": str, "offset?": int, "size?": int,
                "export_size?": int, "handle?": str, "payload?": str},
    "ack": {"rep": int},
    "pool": {},
    "channel": {"address": str},
    "service": {"name": str},
}


def _is(value: Any, types: Any) -> bool:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        return False  # JSON true is no count
    return isinstance(value, types)


def _deep(kind: str, msg: dict[str, Any]) -> str | None:
    """What is wrong inside a field whose top-level type is right, or None."""
    if kind == "config":
        if not msg["sizes"] or not all(_is(s, int) and s > 0 for s in msg["sizes"]):
            return "sizes must be positive byte counts"
        if len(msg["devices"]) != 2 or not all(_is(d, int) and d >= 0 for d in msg["devices"]):
            return "devices must be two CUDA ordinals"
        if msg["reps"] < 1 or msg["warmup"] < 0 or not msg["timeout"] > 0:
            return "reps >= 1, warmup >= 0 and timeout > 0"
        spin = msg.get("spin", 0)
        if spin != "auto" and (isinstance(spin, (str, bool)) or not 0 <= spin <= 1):
            return "spin must be 0 to 1 s, or \"auto\""
    elif kind == "rec":
        t = msg["t"]
        if len(t) != 3 or not _is(t[0], int) or not all(x is None or _is(x, int) for x in t[1:]):
            return "t must be three nanosecond stamps (the last two may be null)"
        if not all(isinstance(k, str) and _is(v, int) for k, v in msg.get("steps", {}).items()):
            return "steps must map call names to nanoseconds"
    elif kind == "cell" and not all(k in ("loop_ns", "handoff_ns") and _is(v, int) and v >= 0
                                    for k, v in msg.get("cpu", {}).items()):
        return "cpu must map loop_ns and handoff_ns to nanoseconds"
    elif kind == "idle" and any(not (_is(msg.get(k, 0), int) and msg.get(k, 0) >= 0) for k in ("cpu_ns", "wall_ns")):
        return "cpu_ns and wall_ns must be nanoseconds"
    elif kind == "bw" and not (_is(msg["result"].get("size"), int) and _is(msg["result"].get("device"), int)):
        return "result needs the size and the device"
    elif kind == "hello" and msg["status"] not in STATUSES:
        return f"status must be one of {', '.join(STATUSES)}"
    elif kind in ("hello", "done") and msg["role"] not in ("producer", "consumer"):
        return "role must be producer or consumer"
    return None


def check(msg: dict[str, Any], *kinds: str) -> dict[str, Any]:
    """Validate a received message: its ``kind`` is one of ``kinds`` and each field has its type.

    Returns the message. Unknown fields are ignored.

    Raises:
        ProtocolError: another kind, a missing field, or a field of the wrong type or range;
            the message names the kind and the field.
    """
    kind = msg.get("kind")
    if kind not in kinds:
        raise ProtocolError(f"bench protocol: expected {' or '.join(kinds)}, got kind {kind!r}")
    for name, types in SPEC[kind].items():
        key = name.rstrip("?")
        if key not in msg:
            if name.endswith("?"):
                continue
            raise ProtocolError(f"bench protocol: {kind} lacks {key!r}")
        if not _is(msg[key], types):
            raise ProtocolError(f"bench protocol: {kind}.{key} has type {type(msg[key]).__name__}")
    why = _deep(kind, msg)
    if why:
        raise ProtocolError(f"bench protocol: {kind}: {why}")
    return msg


def make(kind: str, **fields: Any) -> dict[str, Any]:
    """Build a message of ``kind`` and check it as its receiver will (a sender's bug fails here).

    Raises:
        ProtocolError: as :func:`check`; also for an unknown kind.
    """
    if kind not in SPEC:
        raise ProtocolError(f"bench protocol: unknown kind {kind!r}")
    return check({"kind": kind, **fields}, kind)


def take_fd(fds: list[int]) -> OwnedFd:
    """The one fd a hand-off carries, owned (``recv_message(max_fds=1)`` allows at most one).

    Raises:
        ProtocolError: the message carried no fd.
    """
    if not fds:
        raise ProtocolError("bench protocol: the hand-off carried no fd")
    return OwnedFd(fds[0])
