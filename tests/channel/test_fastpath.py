"""The hand-off's fast paths against the general ones they stand in for (CPU only, no sockets).

* :func:`.protocol.parse_message` checks a ``repeat`` and a ``release`` in one expression: on valid and
  mutated messages of every kind it must accept exactly what the general path accepts, with the same
  result, and refuse the rest with the general path's own error.
* :func:`.wire.encode_repeat` and :func:`.wire.encode_release` frame a ``repeat`` and a ``release`` from a
  template: the bytes must be those the JSON encoder writes for the same dict (or the same refusal).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel import protocol as P
from dmabuf_interop.channel.protocol import _parse_general, parse_message
from dmabuf_interop.channel.wire import MAX_FRAME, encode_release, encode_repeat
from dmabuf_interop.errors import InvalidArgumentError, ProtocolError
from dmabuf_interop.fdpass import decode_message, encode_message
from tests.channel.test_spec_schemas import VALID, _mutate

SETTINGS = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(parse: Any, msg: Any) -> tuple[str, Any]:
    try:
        return "accepted", parse(msg)
    except ProtocolError as exc:
        return "refused", str(exc)


@st.composite
def hand_off_messages(draw: Any) -> Any:
    """Valid repeats and releases (most with no event or meta, as a host hand-off sends them), valid
    messages of the other kinds, and any of them mutated once or twice (a field dropped, added, retyped,
    pushed past its limit), some then relabelled as a repeat or release."""
    kind = draw(st.sampled_from(["repeat", "repeat", "release", "release", *sorted(VALID)]))
    msg = copy.deepcopy(draw(VALID[kind]))  # (a strategy may hand out one object: st.just)
    if kind == "repeat" and draw(st.booleans()):
        msg.update(ordering=draw(st.sampled_from(["none", "sync"])), event=None, meta=None)
    for _ in range(draw(st.integers(0, 2))):
        msg = _mutate(draw, msg)
    if isinstance(msg, dict) and draw(st.integers(0, 4)) == 0:
        msg["kind"] = draw(st.sampled_from(["repeat", "release"]))
    return msg


@SETTINGS
@given(hand_off_messages())
@example({"kind": "repeat", "lease": 1, "layout": 2, "ordering": "none", "event": None, "meta": None})
@example({"kind": "repeat", "lease": True, "layout": 2, "ordering": "none", "event": None, "meta": None})
@example({"kind": "repeat", "lease": 1, "layout": P.MAX_INT + 1, "ordering": "sync", "event": None, "meta": None})
@example({"kind": "repeat", "lease": 1, "layout": 2, "ordering": "event", "event": None, "meta": None})
@example({"kind": "repeat", "lease": 1, "layout": 2, "ordering": "none", "event": None, "meta": None, "x": 0})
@example({"kind": "repeat", "lease": 1.0, "layout": 2, "ordering": "none", "event": None, "meta": None})
@example({"kind": "release", "leases": [1, 2, 3]})
@example({"kind": "release", "leases": [1, False]})
@example({"kind": "release", "leases": [-1]})
@example({"kind": "release", "leases": (1,)})
@example({"kind": "release", "leases": [1], "kind2": 0})
@example({"kind": "release"})
@example(["release"])
def test_parse_fast_path_decides_as_the_general_path(msg: Any) -> None:
    assert _outcome(parse_message, msg) == _outcome(_parse_general, msg), msg


def test_the_fast_path_takes_the_hand_off_messages() -> None:
    """Not vacuous: the messages of a host hand-off never reach the general path."""
    import dmabuf_interop.channel.protocol as mod

    calls = []
    general = mod._parse_general
    mod._parse_general = lambda m: calls.append(m) or general(m)
    try:
        for msg in ({"kind": "repeat", "lease": 7, "layout": 1, "ordering": "none", "event": None, "meta": None},
                    {"kind": "repeat", "lease": 7, "layout": 1, "ordering": "sync", "event": None, "meta": None},
                    {"kind": "release", "leases": [7, 8]}, {"kind": "release", "leases": []}):
            assert mod.parse_message(msg) == (msg["kind"], [])
    finally:
        mod._parse_general = general
    assert calls == []


ints = st.integers(0, P.MAX_INT) | st.integers(-(2 ** 70), 2 ** 70) | st.booleans()
events = st.none() | st.text(max_size=100) | st.just("A" * 86 + "==") | st.integers(0, 3)
json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6)
metas = st.none() | st.dictionaries(st.text(max_size=5), json_leaf, max_size=3)


@SETTINGS
@given(ints, ints, st.sampled_from(["none", "sync", "event", "maybe", ""]) | st.text(max_size=5), events, metas)
def test_encode_repeat_writes_what_the_encoder_writes(lease: Any, layout: Any, ordering: Any, event: Any,
                                                      meta: Any) -> None:
    """The same bytes, or the same refusal (meta holding an infinity, for one)."""
    msg = {"kind": "repeat", "lease": lease, "layout": layout, "ordering": ordering, "event": event, "meta": meta}
    try:
        want = encode_message(msg, MAX_FRAME)
    except InvalidArgumentError as exc:
        with pytest.raises(InvalidArgumentError) as got:
            encode_repeat(lease, layout, ordering, event, meta)
        assert str(got.value) == str(exc)
        return
    frame = encode_repeat(lease, layout, ordering, event, meta)
    assert frame == want
    assert decode_message(frame, MAX_FRAME) == json.loads(want[4:])


@SETTINGS
@given(st.lists(ints, max_size=8) | st.lists(json_leaf, max_size=3))
def test_encode_release_writes_what_the_encoder_writes(leases: Any) -> None:
    try:
        want = encode_message({"kind": "release", "leases": leases}, MAX_FRAME)
    except InvalidArgumentError as exc:
        with pytest.raises(InvalidArgumentError) as got:
            encode_release(leases)
        assert str(got.value) == str(exc)
        return
    assert encode_release(leases) == want
