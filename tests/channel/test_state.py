"""The channel's protocol state machine (``channel._state.ConnectionState``) with no I/O at all: two of them
joined by a pair that carries messages as the channel builds them (as h11 tests its connection state),
hostile messages, and hypothesis-made sequences in which both ends must keep the same layouts."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel._state import (ArraysArrived, ChunkAnnounced, ChunkRetired, ConnectionState, EndReason,
                                           LayoutForgotten, LeasesReleased, Phase, PeerClosed)
from dmabuf_interop.channel.protocol import ArrayDescriptor
from dmabuf_interop.errors import PeerClosedError, ProtocolError

EVENT = "A" * 86 + "=="  # 64 zero bytes, base64


class ConnectionPair:
    """Two ends joined with no I/O: each message is built as the channel builds it and handed to the other
    end's ``receive``. ``sent`` keeps, per lease, the descriptors the sender meant, to compare with what arrived."""

    def __init__(self, **limits: Any) -> None:
        self.a = ConnectionState(**limits)
        self.b = ConnectionState(**limits)
        self.leases = itertools.count(1)
        self.chunk_ids = itertools.count(1)  # unique per process, as the pool's are
        self.arrived: dict[int, ArraysArrived] = {}

    def peer(self, end: ConnectionState) -> ConnectionState:
        return self.b if end is self.a else self.a

    def deliver(self, end: ConnectionState, msg: dict[str, Any], fds: int = 0) -> list[Any]:
        return self.peer(end).receive(msg, fds)

    def announce(self, end: ConnectionState, size: int = 1 << 20, host: bool = True) -> int:
        cid = next(self.chunk_ids)
        msg = {"kind": "chunk", "chunk": cid, "size": size, "mechanism": "memfd" if host else "posix-fd",
               "device_uuid": "" if host else "GPU-0", "parts": [size]}
        (ev,) = self.deliver(end, msg, 1)
        end.chunk_announced(cid)
        assert type(ev) is ChunkAnnounced and (ev.chunk.id, ev.chunk.size, ev.chunk.host) == (cid, size, host)
        return cid

    def retire(self, end: ConnectionState, cid: int) -> None:
        assert end.retire_chunk(cid)
        assert self.deliver(end, {"kind": "retire", "chunk": cid}) == [ChunkRetired(cid)]

    def lend(self, end: ConnectionState, items: list[dict[str, Any]], mapping: bool | None,
             ordering: str = "none", meta: Any = None) -> tuple[int, list[Any]]:
        """Lend ``items`` (wire descriptors without ordering, event and meta) as the channel does: a layout
        defined once, a ``repeat`` after; ``mapping`` None is one array."""
        lease = next(self.leases)
        descs = [{**d, "ordering": ordering, "event": EVENT if ordering == "event" else None, "meta": None}
                 for d in items]
        descs[0]["meta"] = meta
        key = (mapping, tuple(tuple(sorted((k, str(v)) for k, v in d.items() if k not in ("ordering", "event", "meta")))
                              for d in items))
        choice = end.choose_layout(key, single=mapping is None)
        end.lend(lease, lease)
        if not choice.define:
            msg = {"kind": "repeat", "lease": lease, "layout": choice.id, "ordering": ordering,
                   "event": EVENT if ordering == "event" else None, "meta": meta}
            events = self.deliver(end, msg)
        else:
            msg = ({"kind": "array", "lease": lease, "desc": descs[0], "layout": choice.id} if mapping is None else
                   {"kind": "arrays", "lease": lease, "items": descs, "mapping": mapping, "layout": choice.id})
            events = self.deliver(end, msg)
            end.layout_sent(choice)
        arrived = [e for e in events if type(e) is ArraysArrived]
        assert len(arrived) == 1
        got = arrived[0]
        assert got.lease == lease and got.layout == choice.id
        assert got.kind == ("array" if mapping is None else "arrays") and got.mapping == bool(mapping)
        if choice.define:  # as sent; a repeat's other items keep the ordering they were defined with
            assert [d.to_json() for d in got.descs] == [ArrayDescriptor.from_json(d).to_json() for d in descs]
        first = got.descs[0]
        assert (first.ordering, first.event, first.meta) == (descs[0]["ordering"], descs[0]["event"], meta)
        assert [(d.chunk, d.block_offset, d.shape, d.name) for d in got.descs] == \
            [(d["chunk"], d["block_offset"], tuple(d["shape"]), d["name"]) for d in items]
        self.arrived[lease] = got
        return lease, events

    def release(self, end: ConnectionState, lease: int) -> None:
        """``end`` received ``lease`` and releases it."""
        assert lease in end.held
        assert end.released(lease)
        (ev,) = self.deliver(end, {"kind": "release", "leases": [lease]})
        assert type(ev) is LeasesReleased and ev.leases == (lease,) and ev.tokens == (lease,)

    def agree(self) -> None:
        """Both ends keep the same layouts, each way."""
        for x, y in ((self.a, self.b), (self.b, self.a)):
            assert x.layouts_sent() == y.layouts_held()
            assert x.layouts_sent(single=True) == y.layouts_held(single=True)


def block(chunk: int, i: int, name: str | None = None, n: int = 4) -> dict[str, Any]:
    return {"chunk": chunk, "block_offset": 256 * i, "block_bytes": 256, "byte_offset": 0, "shape": [n],
            "strides": [4], "dtype": "float32", "name": name}


def test_a_layout_is_defined_once_then_repeated_both_ways() -> None:
    p = ConnectionPair()
    ca, cb = p.announce(p.a), p.announce(p.b)
    batch_a = [block(ca, 0, "w"), block(ca, 1, "b")]
    batch_b = [block(cb, 0, "x")]
    for step in range(3):
        lease, _ = p.lend(p.a, batch_a, True, meta={"step": step})
        p.release(p.b, lease)
        lease, _ = p.lend(p.b, batch_b, False)
        p.release(p.a, lease)
    assert p.a.layouts_sent() == p.b.layouts_held() == [1]
    assert p.b.layouts_sent() == p.a.layouts_held() == [1]
    assert p.a.lent == p.b.lent == 0 and not p.a.held and not p.b.held


def test_layouts_past_the_limit_are_forgotten_alike_and_defined_again() -> None:
    p = ConnectionPair(max_layouts=2, max_single_layouts=2)
    c = p.announce(p.a)
    seen = []
    for i in range(5):
        lease, events = p.lend(p.a, [block(c, i, "a")], True)
        seen += [e.layout for e in events if type(e) is LayoutForgotten]
        p.agree()
    assert seen == [1, 2, 3] and p.b.layouts_held() == [4, 5]
    lease, events = p.lend(p.a, [block(c, 0, "a")], True)  # forgotten by both: defined anew, not repeated
    assert p.arrived[lease].layout == 6 and p.b.layouts_held() == [5, 6]


def test_a_repeat_gives_its_ordering_event_and_meta_to_the_first_item_only() -> None:
    p = ConnectionPair()
    c = p.announce(p.a, 2 << 20, host=False)
    items = [block(c, 0, None), block(c, 1, None)]
    p.lend(p.a, items, False)
    lease, _ = p.lend(p.a, items, False, ordering="event", meta={"k": 1})
    got = p.arrived[lease]
    assert got.ordering == "event" and got.descs[0].event == EVENT and got.descs[1].event is None
    assert got.descs[1].meta is None


def test_a_retired_chunk_stops_repeats_of_its_layouts() -> None:
    p = ConnectionPair()
    c = p.announce(p.a)
    lease, _ = p.lend(p.a, [block(c, 0)], None)
    p.release(p.b, lease)
    p.retire(p.a, c)
    with pytest.raises(ProtocolError, match="names chunk 1, retired since"):
        p.b.receive({"kind": "repeat", "lease": 99, "layout": 1, "ordering": "none", "event": None, "meta": None})
    assert p.b.phase is Phase.ENDED and p.b.end_reason is EndReason.PROTOCOL_ERROR


def test_a_ring_slot_is_taken_as_the_repeat_it_stands_for() -> None:
    """``receive_slot`` (a repeat read from the peer's ring) makes the events ``receive`` makes of the same
    repeat as a message, and refuses what it refuses, ending the connection."""
    p = ConnectionPair()
    c = p.announce(p.a, 2 << 20, host=False)
    items = [block(c, 0, None), block(c, 1, None)]
    lease, _ = p.lend(p.a, items, False)
    p.release(p.b, lease)
    twin = ConnectionPair()  # the same steps, so the same layout ids and state
    tc = twin.announce(twin.a, 2 << 20, host=False)
    twin.lend(twin.a, [block(tc, 0, None), block(tc, 1, None)], False)
    for k, (ordering, event) in enumerate((("sync", None), ("event", EVENT), ("sync", None))):
        by_slot = p.b.receive_slot(100 + k, 1, ordering, event)
        by_msg = twin.b.receive({"kind": "repeat", "lease": 100 + k, "layout": 1, "ordering": ordering,
                                 "event": event, "meta": None})
        assert by_slot == by_msg and type(by_slot[0]) is ArraysArrived and by_slot[0].ordering == ordering
        assert by_slot[0].descs[0].event == event
    with pytest.raises(ProtocolError, match="lease 101 is already held"):
        p.b.receive_slot(101, 1, "sync", None)
    assert p.b.phase is Phase.ENDED and p.b.end_reason is EndReason.PROTOCOL_ERROR
    with pytest.raises(ProtocolError, match="after the end"):
        p.b.receive_slot(200, 1, "sync", None)
    with pytest.raises(ProtocolError, match="unknown layout 9"):
        twin.b.receive_slot(200, 9, "sync", None)
    fresh = ConnectionState(phase=Phase.HANDSHAKE)
    with pytest.raises(ProtocolError, match="before the peer's ring message"):
        fresh.receive_slot(1, 1, "sync", None)


def _twins(host: bool = True, meta: Any = None) -> tuple[ConnectionPair, ConnectionPair, int]:
    """Two pairs put through the same steps (the same layout ids and state): one array's layout 1, defined with
    ordering "none" (host) or "sync" (device) and ``meta``, and a batch's layout 2; both released."""
    pairs = []
    for _ in range(2):
        p = ConnectionPair()
        c = p.announce(p.a, 2 << 20, host=host)
        lease, _ = p.lend(p.a, [block(c, 0)], None, ordering="none" if host else "sync", meta=meta)
        p.release(p.b, lease)
        lease, _ = p.lend(p.a, [block(c, 1, "w")], True, ordering="none" if host else "sync")
        p.release(p.b, lease)
        pairs.append(p)
    return pairs[0], pairs[1], c


def _state_of(s: ConnectionState) -> tuple[Any, ...]:
    return s.phase, s.held, s.layouts_held(), s.layouts_held(single=True), s.error


@pytest.mark.parametrize("case", ["as defined", "another ordering", "an event", "held already", "unknown layout",
                                  "a batch's layout", "defined with meta", "chunk retired", "closing", "ended"])
def test_a_slot_repeating_a_layout_as_defined_is_taken_as_receive_slot_takes_it(case: str) -> None:
    """``receive_slot_as_defined`` (the receiving lane's) takes the slot ``receive_slot`` would turn into that
    layout's arrival as defined, with the same lease held after; any other slot it leaves, changing nothing,
    for ``receive_slot`` to take or refuse."""
    host = case != "an event"
    fast, slow, c = _twins(host=host, meta={"k": 1} if case == "defined with meta" else None)
    lease, layout, ordering, event = 50, 1, "none" if host else "sync", None
    if case == "another ordering":
        ordering = "sync"
    elif case == "an event":
        ordering, event = "event", EVENT
    elif case == "held already":
        for s in (fast.b, slow.b):
            s.receive_slot(lease, 1, ordering, None)
    elif case == "unknown layout":
        layout = 9
    elif case == "a batch's layout":
        layout = 2
    elif case == "chunk retired":
        fast.retire(fast.a, c)
        slow.retire(slow.a, c)
    elif case == "closing":
        fast.b.close()
        slow.b.close()
    elif case == "ended":
        fast.b.end()
        slow.b.end()
    before = _state_of(fast.b)
    got = fast.b.receive_slot_as_defined(lease, layout, ordering, event is not None)
    try:
        want = slow.b.receive_slot(lease, layout, ordering, event)
    except ProtocolError:
        want = None
    if case == "as defined":
        assert got is not None and want == [ArraysArrived("array", lease, got.descs, False, ordering,
                                                          tuple(got.chunks), got.id)]
        assert _state_of(fast.b) == _state_of(slow.b) and lease in fast.b.held
    else:
        assert got is None and _state_of(fast.b) == before  # (nothing done: receive_slot decides)


def test_bye_ends_the_connection_and_end_completes_what_was_lent() -> None:
    p = ConnectionPair()
    p.a.lend(7, "token")
    assert p.deliver(p.b, {"kind": "bye"}) == [PeerClosed()]
    assert p.a.ended and p.a.end_reason is EndReason.PEER_CLOSED and isinstance(p.a.error, PeerClosedError)
    assert p.a.end() == ["token"] and p.a.end() == []
    assert not p.a.can_send and not p.a.released(3)  # nothing is due once over


def test_close_drops_arrivals_and_its_end_reason_is_closed() -> None:
    p = ConnectionPair()
    c = p.announce(p.a)
    p.b.close()
    assert p.b.phase is Phase.CLOSING and p.b.over and not p.b.can_send
    msg = {"kind": "array", "lease": 1, "desc": {**block(c, 0), "ordering": "none", "event": None, "meta": None}}
    assert p.b.receive(msg) == []
    assert not p.b.held
    p.b.end()
    assert p.b.end_reason is EndReason.CLOSED


def test_a_send_that_broke_the_stream_stops_every_later_send() -> None:
    s = ConnectionState()
    s.send_failed(OSError("cut off"))
    assert not s.can_send and s.phase is Phase.OPEN
    s.end()
    assert s.end_reason is EndReason.LOCAL_ERROR  # this process failed, not the peer


# --- hostile peers ---------------------------------------------------------------------

def _valid_messages(c: int) -> list[dict[str, Any]]:
    d = {**block(c, 0, "w"), "ordering": "none", "event": None, "meta": None}
    return [
        {"kind": "array", "lease": 5, "desc": d},
        {"kind": "arrays", "lease": 6, "items": [d], "mapping": True, "layout": 3},
        {"kind": "repeat", "lease": 7, "layout": 3, "ordering": "none", "event": None, "meta": None},
        {"kind": "release", "leases": [1]},
        {"kind": "retire", "chunk": c},
        {"kind": "chunk", "chunk": c + 1, "size": 4096, "mechanism": "memfd", "device_uuid": "", "parts": [4096]},
    ]


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 63) | st.text(max_size=6),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                     max_leaves=8)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["kind", "lease", "desc", "items", "layout", "chunk",
                                                              "leases", "mapping", "meta", "ordering", "parts"]),
                          _JSON, st.integers(0, 2)), max_size=12))
def test_any_message_is_taken_or_refused_as_the_peers_fault(mutations: list[Any]) -> None:
    """Valid messages with fields replaced by arbitrary JSON, in any order and with any fd count: the state
    machine yields events or raises ProtocolError (and has ended), never anything else."""
    s = ConnectionState()
    s.lend(1, "t")
    s.receive({"kind": "chunk", "chunk": 1, "size": 1 << 20, "mechanism": "memfd", "device_uuid": "",
               "parts": [1 << 20]}, 1)
    for which, key, value, fds in mutations:
        msg = dict(_valid_messages(1)[which])
        msg[key] = value
        try:
            s.receive(msg, fds)
        except ProtocolError:
            assert s.ended
            return
        if s.ended:
            return


# --- both ends in step, whatever is sent ---------------------------------------------------

_OPS = st.one_of(
    st.tuples(st.just("one"), st.integers(0, 5), st.sampled_from(["none", "event"]), st.none() | st.just({"k": 1})),
    st.tuples(st.just("many"), st.sets(st.integers(0, 5), min_size=1, max_size=4), st.booleans(),
              st.none() | st.just({"k": 2})),
    st.tuples(st.just("renew"), st.integers(0, 5)),
    st.tuples(st.just("retire"), st.integers(0, 1)),
    st.tuples(st.just("back"), st.integers(0, 5), st.sampled_from(["none", "event"]), st.none()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_OPS, max_size=40))
def test_two_ends_keep_the_same_layouts_whatever_is_sent(ops: list[Any]) -> None:
    """Single arrays and batches sent again, renewed (a block moves), over chunks retired and announced
    anew, both ways, past both layout limits (made small): every message the sender builds is accepted,
    every arrival is what was sent, and the two ends keep the same layouts, each way."""
    p = ConnectionPair(max_layouts=2, max_single_layouts=3)
    chunks = [p.announce(p.a, 1 << 16, host=False), p.announce(p.a, 1 << 16, host=False)]
    back = p.announce(p.b, 1 << 16, host=False)
    ring = [(i % 2, i) for i in range(6)]  # (which chunk, which block)
    renewals = itertools.count(6)
    for op in ops:
        if op[0] == "one":
            _, i, ordering, meta = op
            lease, _ = p.lend(p.a, [block(chunks[ring[i][0]], ring[i][1])], None, ordering, meta)
            p.release(p.b, lease)
        elif op[0] == "many":
            _, idx, mapping, meta = op
            items = [block(chunks[ring[i][0]], ring[i][1], f"a{i}" if mapping else None) for i in sorted(idx)]
            lease, _ = p.lend(p.a, items, mapping, "none", meta)
            p.release(p.b, lease)
        elif op[0] == "renew":
            ring[op[1]] = (ring[op[1]][0], next(renewals) % 200)
        elif op[0] == "retire":
            p.retire(p.a, chunks[op[1]])
            chunks[op[1]] = p.announce(p.a, 1 << 16, host=False)
        else:
            _, i, ordering, meta = op
            lease, _ = p.lend(p.b, [block(back, i)], None, ordering, meta)
            p.release(p.a, lease)
        p.agree()
        assert not p.a.held and not p.b.held and p.a.lent == p.b.lent == 0
    assert p.a.phase is p.b.phase is Phase.OPEN
