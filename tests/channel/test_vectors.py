"""The golden vectors shipped with the package (``channel/spec/vectors/*.json``, format in its README.md) run
against the Python state machine: every step's events, or its refusal, and the final state."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from dmabuf_interop.channel._state import (ArraysArrived, ChunkAnnounced, ChunkRetired, ConnectionState, EmptyBatch,
                                           HelloReceived, LayoutForgotten, LeasesReleased, Phase, PeerClosed,
                                           PeerRefused, RingOffered)
from dmabuf_interop.errors import ProtocolError

_VECTORS = resources.files("dmabuf_interop.channel") / "spec" / "vectors"


def _load() -> list[Any]:
    out = []
    for f in sorted(_VECTORS.iterdir(), key=lambda p: p.name):
        if f.name.endswith(".json"):
            for v in json.loads(f.read_text())["vectors"]:
                out.append(pytest.param(v, id=f"{f.name[:-5]}: {v['name']}"))
    return out


def event_json(ev: Any) -> dict[str, Any]:
    """An event in the vectors' form."""
    t = type(ev)
    if t is HelloReceived:
        return {"event": "hello"}
    if t is ChunkAnnounced:
        return {"event": "chunk_announced", "chunk": ev.chunk.id, "size": ev.chunk.size, "host": ev.chunk.host}
    if t is ChunkRetired:
        return {"event": "chunk_retired", "chunk": ev.chunk_id}
    if t is ArraysArrived:
        return {"event": "arrays_arrived", "kind": ev.kind, "lease": ev.lease, "mapping": ev.mapping,
                "ordering": ev.ordering, "chunks": list(ev.chunks), "layout": ev.layout,
                "items": [d.to_json() for d in ev.descs]}
    if t is EmptyBatch:
        return {"event": "empty_batch", "lease": ev.lease}
    if t is LayoutForgotten:
        return {"event": "layout_forgotten", "layout": ev.layout}
    if t is LeasesReleased:
        return {"event": "leases_released", "leases": list(ev.leases)}
    if t is RingOffered:
        return {"event": "ring_offered", **{k: ev.msg[k] for k in ("version", "bytes", "slots", "release_slots")}}
    if t is PeerClosed:
        return {"event": "peer_closed"}
    if t is PeerRefused:
        return {"event": "peer_refused", "reason": ev.reason}
    raise AssertionError(f"no vector form for {ev!r}")


def run_vector(v: dict[str, Any]) -> ConnectionState:
    state = ConnectionState(v.get("transport", "fd"), phase=Phase(v.get("phase", "open")), ring=v.get("ring", False),
                            **v.get("limits", {}))
    steps = v["steps"]
    for i, step in enumerate(steps):
        if "lend" in step:
            state.lend(step["lend"], object())
        elif "release" in step:
            state.released(step["release"])
        elif "close" in step:
            state.close()
        elif "refuse" in step:
            assert i == len(steps) - 1, "a refusing step is the last"
            assert step["refuse"] == "ProtocolError"
            was_ended = state.ended
            with pytest.raises(ProtocolError, match=None) as info:
                state.receive(step["receive"], step["fds"])
            assert step["reason_contains"] in str(info.value), (step["reason_contains"], str(info.value))
            assert state.ended
            if not was_ended:
                assert state.end_reason.value == "protocol-error"
        else:
            got = [event_json(e) for e in state.receive(step["receive"], step["fds"])]
            assert got == step["expect"], f"step {i}"
    final = v.get("final", {})
    checks = {
        "phase": lambda: state.phase.value,
        "end_reason": lambda: state.end_reason.value if state.end_reason else None,
        "held": lambda: sorted(state.held),
        "lent": state.lent_ids,
        "chunks": state.chunk_ids,
        "layouts_held": lambda: state.layouts_held(),
        "single_layouts_held": lambda: state.layouts_held(single=True),
    }
    assert set(final) <= set(checks), set(final) - set(checks)
    for key, want in final.items():
        assert checks[key]() == want, key
    return state


def test_the_vectors_ship_with_the_package() -> None:
    names = {f.name for f in _VECTORS.iterdir()}
    assert "README.md" in names and len([n for n in names if n.endswith(".json")]) >= 5


@pytest.mark.parametrize("vector", _load())
def test_vector(vector: dict[str, Any]) -> None:
    run_vector(vector)


def test_the_vectors_speak_this_protocol_version_and_name_every_dtype() -> None:
    """The hellos speak :data:`PROTOCOL_VERSION`, and the descriptors name every dtype NumPy lacks, so that
    a change of either shows here."""
    from dmabuf_interop.channel.arrays import STORAGE
    from dmabuf_interop.channel.protocol import DTYPES, PROTOCOL_VERSION

    hellos, dtypes = [], set()
    for v in _load():
        for step in v.values[0]["steps"]:
            msg = step.get("receive", {})
            if msg.get("kind") == "hello":
                hellos.append(msg["protocol"])
            for d in [msg.get("desc")] + list(msg.get("items") or []):
                if isinstance(d, dict) and "refuse" not in step:
                    dtypes.add(d.get("dtype"))
    assert hellos and set(hellos) == {PROTOCOL_VERSION}
    assert set(STORAGE) <= dtypes <= set(DTYPES)  # every dtype NumPy lacks, each by its wire name
