"""The parent: one producer/consumer pair per mechanism, their records turned into cells.

Each pair is two fresh interpreters (:mod:`.peers`; CUDA does not survive
``fork()``) joined to the parent and to each other by the sockets of
:mod:`.protocol`. The parent waits on both control sockets with one
``--timeout`` per message, validates every message before use, and reaps
both children whatever happens.

Phases of one repetition, from the two processes' ``CLOCK_MONOTONIC`` stamps:

=================  ==========================================================
export             producer: t_exp - t0 (make the shareable handle)
transport          t_recv - t_send (JSON + SCM_RIGHTS, receive and validate)
import_map         consumer: t_imp - t_recv (import and map until a pointer exists)
first_access       consumer: t_read - t_imp (a 1-thread kernel reads 4 bytes, synchronised)
total              t_read - t0 (producer starts sharing -> consumer has read)
export_transport   t_recv - t0 (what a mechanism without an import can show)
=================  ==========================================================
"""

from __future__ import annotations

import select
import socket
import sys
from typing import Any

from ...errors import DmaBufError, PeerClosedError
from .._units import size_label
from .child import Child, reap, start
from .progress import Progress
from .protocol import check, make
from .report import fmt
from .stats import Stats
from .targets import ratio

__all__ = ["PHASES", "cell_stats", "run_pair"]

PHASES = ("export", "transport", "import_map", "first_access", "total", "export_transport")
_REPORTS = ("hello", "rec", "first", "cell", "idle", "bw", "overhead", "done", "error")


def _stat(values: list[float]) -> dict[str, float] | None:
    """A cell's JSON statistics of one phase (µs), or ``None`` for no samples."""
    stats = Stats.of(values)
    return None if stats is None else stats.to_json("median", "p90", "p99")


def cell_stats(size: int, prod: list[dict[str, Any]], cons: list[dict[str, Any]],
               info: dict[str, Any], cpu: dict[str, dict[str, int] | None] | None = None) -> dict[str, Any]:
    """One cell of the JSON from the producer's and consumer's ``rec`` messages (µs), and from each side's
    CPU time over the cell (``cpu``: role -> the ``cell`` message's ``cpu``) its CPU µs per hand-off.
    ``info``: the two ``cell`` messages' other fields (``import``, and ``ring``: whether a channel used its
    shared-memory ring), copied into the cell."""
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    for p, c in zip(prod, cons):
        t0, t_exp, t_send = p["t"]
        t_recv, t_imp, t_read = c["t"]
        samples["export"].append((t_exp - t0) / 1e3)
        samples["transport"].append((t_recv - t_send) / 1e3)
        samples["export_transport"].append((t_recv - t0) / 1e3)
        if t_imp is not None and t_read is not None:
            samples["import_map"].append((t_imp - t_recv) / 1e3)
            samples["first_access"].append((t_read - t_imp) / 1e3)
            samples["total"].append((t_read - t0) / 1e3)
    cell: dict[str, Any] = {
        "size": size, "label": size_label(size), "reps": len(samples["export"]),
        "phases_us": {k: _stat(v) for k, v in samples.items()},
        "samples_us": {k: [round(x, 2) for x in v] for k, v in samples.items() if v},
    }
    breakdown = {}
    for side, recs, phase in (("producer_export", prod, "export"), ("consumer_import_map", cons, "import_map")):
        steps = [r.get("steps") for r in recs]
        if not any(steps) or not samples[phase]:
            continue
        names = sorted({k for s in steps if s for k in s})
        per = {n: _stat([(s or {}).get(n, 0) / 1e3 for s in steps]) for n in names}
        other = [ph - sum((s or {}).values()) / 1e3 for ph, s in zip(samples[phase], steps)]
        per["other (Python, fd, bookkeeping)"] = _stat(other)
        breakdown[side] = per
    if breakdown:
        cell["breakdown_us"] = breakdown
    if any("first_share" in c for c in cons):
        cell["first_share_reps"] = sum(1 for c in cons if c.get("first_share"))
    if "import" in info:
        cell["import"] = info["import"]
    if "ring" in info:
        cell["ring"] = info["ring"]
    reps = len(samples["export"])
    if cpu and reps and all(cpu.values()):
        cell["cpu_us_per_handoff"] = {side: {"loop": round(c["loop_ns"] / reps / 1e3, 2),
                                             "handoff": round(c["handoff_ns"] / reps / 1e3, 2)}
                                      for side, c in cpu.items() if c}
    return cell


class _Role:
    """What the parent knows of one child."""

    def __init__(self) -> None:
        self.hello: dict[str, Any] | None = None
        self.recs: list[dict[str, Any]] = []
        self.first: list[Any] | None = None  # the ``t`` of the run's very first hand-off
        self.cells: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
        self.ended = False
        self.done = False
        self.error: str | None = None
        self.unsupported = False


def run_pair(name: str, cfg: dict[str, Any], progress: Progress, *, label: str | None = None) -> dict[str, Any]:
    """Run one mechanism (or ``"_bandwidth"``) in a fresh producer/consumer pair.

    ``cfg``: the :mod:`.protocol` ``config`` fields other than ``mechanism``. ``label``: the run's name
    in progress lines (default ``name``).
    Returns ``{"status", "reason", "versions", "cells", "bandwidth", "overhead"}``, and ``first_handoff_us``
    and ``idle`` (the consumer's CPU while nothing was sent) where measured;
    a child that fails, breaks the protocol or stays silent past ``cfg["timeout"]``
    gives status ``error`` with the reason, never an exception.
    """
    timeout = float(cfg["timeout"])
    config = make("config", mechanism=name, **cfg)
    (pc_p, pc_c), (aux_p, aux_c) = (socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    children: list[Child] = []
    roles = {"producer": _Role(), "consumer": _Role()}
    out: dict[str, Any] = {"cells": [], "bandwidth": [], "overhead": None, "versions": {}}
    timed_out = False
    try:
        try:
            children.append(start("peers", "producer", config, fds=[pc_p, aux_p]))
            children.append(start("peers", "consumer", config, fds=[pc_c, aux_c]))
        finally:
            for s in (pc_p, pc_c, aux_p, aux_c):
                s.close()  # the children hold them; EOF must reach a peer when the other dies
        while not all(r.ended for r in roles.values()):
            live = {c.ctl: c for c in children if not roles[c.role].ended}
            ready, _, _ = select.select(list(live), [], [], timeout)
            if not ready:
                timed_out = True
                for r in roles.values():
                    if not r.ended:
                        r.error = r.error or f"no message for {timeout:g} s (--timeout)"
                        r.ended = True
                break
            for sock in ready:
                role = live[sock].role
                st = roles[role]
                try:
                    msg = check(live[sock].report(timeout), *_REPORTS)
                except PeerClosedError:
                    st.ended = True
                    if not st.done and st.error is None and (st.hello is None or st.hello["status"] == "ok"):
                        st.error = f"{role} exited without reporting (see its stderr above)"
                    continue
                except DmaBufError as exc:  # a broken frame or message: stop listening to this child
                    st.ended = True
                    st.error = f"{role}: {exc}"
                    continue
                _dispatch(label or name, role, msg, roles, out, progress)
    finally:
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)  # Ctrl-C: end the children now
        for child in children:
            reap(child, 0 if timed_out or interrupted else min(timeout, 60.0))
    return _outcome(roles, out)


def _outcome(roles: dict[str, _Role], out: dict[str, Any]) -> dict[str, Any]:
    hellos = [r.hello for r in roles.values() if r.hello]
    for h in hellos:
        out["versions"].update(h.get("versions") or {})
    not_ok = [h for h in hellos if h["status"] != "ok"]
    unsupported = [r.error for r in roles.values() if r.error and r.unsupported]
    errors = [r.error for r in roles.values() if r.error]
    if not_ok:
        first = min(not_ok, key=lambda h: ("not installed", "unsupported", "error").index(h["status"]))
        out["status"], out["reason"] = first["status"], first.get("reason")
    elif unsupported:
        out["status"], out["reason"] = "unsupported", unsupported[0]
    elif errors:
        out["status"], out["reason"] = "error", "; ".join(errors)
    else:
        out["status"], out["reason"] = "ok", None
    return out


def _dispatch(name: str, role: str, msg: dict[str, Any], roles: dict[str, _Role], out: dict[str, Any],
              progress: Progress) -> None:
    """Act on one validated report from ``role``."""
    st = roles[role]
    kind = msg["kind"]
    if kind == "hello":
        st.hello = msg
        if msg["status"] != "ok":
            progress.say(f"{name}: {role}: {msg['status']}: {msg.get('reason')}")
    elif kind == "rec":
        st.recs.append(msg)
    elif kind == "first":
        st.first = msg["t"]
        prod, cons = roles["producer"].first, roles["consumer"].first
        if prod is not None and cons is not None:
            # producer starts -> consumer has read (received, where nothing is imported)
            end = cons[2] if cons[2] is not None else cons[0]
            out["first_handoff_us"] = round((end - prod[0]) / 1e3, 2)
    elif kind == "cell":
        size = msg["size"]
        st.cells[size] = (st.recs, msg)
        st.recs = []
        if size in roles["producer"].cells and size in roles["consumer"].cells:
            prod = roles["producer"].cells.pop(size)
            cons = roles["consumer"].cells.pop(size)
            if len(prod[0]) != len(cons[0]):
                st.error = f"{role}: {len(prod[0])} producer records against {len(cons[0])} consumer records"
                return
            cpu = {"producer": prod[1].pop("cpu", None), "consumer": cons[1].pop("cpu", None)}
            rings = [m.pop("ring") for m in (prod[1], cons[1]) if "ring" in m]
            info = {**prod[1], **cons[1], **({"ring": all(rings)} if rings else {})}  # the ring only if both use it
            cell = cell_stats(size, prod[0], cons[0], info, cpu)
            out["cells"].append(cell)
            total = cell["phases_us"]["total"] or cell["phases_us"]["export_transport"]
            what = "total" if cell["phases_us"]["total"] else "export+transport (no import)"
            progress.cell(f"{name} {cell['label']}: {what} median {fmt(total['median'])} us, "
                          f"p90 {fmt(total['p90'])} us ({cell['reps']} reps)")
    elif kind == "idle":
        cpu, wall = msg.get("cpu_ns", 0), msg.get("wall_ns", 0)
        out["idle"] = {"cpu_ms": round(cpu / 1e6, 3), "wall_s": round(wall / 1e9, 3),
                       "cpu_pct": round(100 * cpu / wall, 2) if wall else None}
        progress.say(f"{name}: idle consumer {out['idle']['cpu_pct']}% CPU over {out['idle']['wall_s']} s")
    elif kind == "bw":
        bw = msg["result"]
        out["bandwidth"].append(bw)
        r = ratio(bw.get("import"), bw.get("native"))
        line = f"bandwidth {size_label(bw['size'])}" + (f": import/native {r:.3f}" if r else "")
        if bw.get("cross_import") and bw.get("memcpy_peer"):
            line += (f", GPU{bw['peer_device']} reading GPU{bw['device']} through the import "
                     f"{bw['cross_import']['gbps']:.0f} GB/s vs cuMemcpyPeer {bw['memcpy_peer']['gbps']:.0f} GB/s")
        progress.say(line)
    elif kind == "overhead":
        out["overhead"] = msg["result"]
        progress.say("Python overhead measured")
    elif kind == "done":
        st.done = True
    elif kind == "error":
        st.error = msg["reason"]
        st.unsupported = msg["unsupported"]
        progress.say(f"{name}: {st.error}")
