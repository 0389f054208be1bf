"""Property tests of the message framing (encode_message / decode_message), CPU only."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop.errors import InvalidArgumentError, ProtocolError
from dmabuf_interop.fdpass import MAX_MESSAGE, decode_message, encode_message

HEADER = struct.Struct(">I")

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=8)


def _decodes_or_protocol_error(frame: bytes) -> None:
    try:
        out = decode_message(frame)
    except ProtocolError:
        return
    assert isinstance(out, dict)


@SETTINGS
@given(json_objects)
def test_roundtrip(obj):
    frame = encode_message(obj)
    (n,) = HEADER.unpack_from(frame)
    assert n == len(frame) - HEADER.size <= MAX_MESSAGE
    assert decode_message(frame) == obj
    assert encode_message(obj) == frame  # deterministic


@SETTINGS
@given(json_objects, st.data())
def test_single_byte_corruption_decodes_or_protocol_error(obj, data):
    frame = bytearray(encode_message(obj))
    i = data.draw(st.integers(0, len(frame) - 1), label="index")
    b = data.draw(st.integers(0, 255).filter(lambda v: v != frame[i]), label="byte")
    frame[i] = b
    _decodes_or_protocol_error(bytes(frame))


@SETTINGS
@given(json_objects, st.data())
def test_truncation_is_protocol_error(obj, data):
    frame = encode_message(obj)
    k = data.draw(st.integers(0, len(frame) - 1), label="keep")
    with pytest.raises(ProtocolError):
        decode_message(frame[:k])


@SETTINGS
@given(json_objects, st.binary(min_size=1, max_size=16))
def test_trailing_bytes_are_protocol_error(obj, extra):
    with pytest.raises(ProtocolError):
        decode_message(encode_message(obj) + extra)


@SETTINGS
@given(st.binary(max_size=256))
def test_arbitrary_bytes(raw):
    _decodes_or_protocol_error(raw)


@SETTINGS
@given(st.binary(max_size=256) | st.text(max_size=64).map(str.encode))
def test_arbitrary_body_with_correct_header(body):
    """Random bodies behind a well-formed header reach the JSON decoder."""
    _decodes_or_protocol_error(HEADER.pack(len(body)) + body)


@SETTINGS
@given(json_values.filter(lambda v: not isinstance(v, dict)))
def test_non_object_json_is_protocol_error(value):
    body = json.dumps(value).encode()
    with pytest.raises(ProtocolError, match="not an object"):
        decode_message(HEADER.pack(len(body)) + body)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60000), st.sampled_from([b"[", b'{"a":']))
def test_deep_nesting_is_protocol_error(depth, opener):
    body = (opener * depth)[: MAX_MESSAGE]
    _decodes_or_protocol_error(HEADER.pack(len(body)) + body)


def test_deep_nesting_hits_recursion_limit_as_protocol_error():
    body = b"[" * 50000 + b"]" * 10000
    with pytest.raises(ProtocolError):
        decode_message(HEADER.pack(len(body)) + body)


@SETTINGS
@given(st.integers(MAX_MESSAGE + 1, 2 ** 32 - 1), st.binary(max_size=32))
def test_oversize_announced_length(n, body):
    with pytest.raises(ProtocolError, match="more than"):
        decode_message(HEADER.pack(n) + body)


@SETTINGS
@given(json_objects, st.sampled_from([float("nan"), float("inf"), float("-inf"), object(), b"x", {1, 2}]))
def test_encode_rejects_non_json(obj, bad):
    obj = dict(obj)
    obj["bad"] = bad
    with pytest.raises(InvalidArgumentError):
        encode_message(obj)


@pytest.mark.parametrize("value", [[], "x", 1, None, ("a",)])
def test_encode_rejects_non_dict(value):
    with pytest.raises(InvalidArgumentError, match="dict"):
        encode_message(value)


def test_encode_rejects_oversize_body():
    with pytest.raises(InvalidArgumentError, match=str(MAX_MESSAGE)):
        encode_message({"x": "y" * MAX_MESSAGE})
    # and the largest allowed body still fits
    fits = {"x": "y" * (MAX_MESSAGE - len('{"x":""}'))}
    assert decode_message(encode_message(fits)) == fits


# --- the fast paths against the stdlib's general ones ---------------------------------------------

def _stdlib_decode(body: bytes) -> tuple[str, object]:
    """What decode_message did before its scanner fast path: json.loads of the UTF-8 text."""
    try:
        obj = json.loads(body.decode())
    except (ValueError, RecursionError) as exc:
        return "error", type(exc).__name__
    return ("object", obj) if isinstance(obj, dict) else ("error", "not an object")


def _decoded(body: bytes) -> tuple[str, object]:
    try:
        return "object", decode_message(HEADER.pack(len(body)) + body)
    except ProtocolError as exc:
        return "error", exc


json_bodies = (
    json_objects.map(lambda o: json.dumps(o, separators=(",", ":")).encode())
    | json_objects.map(lambda o: json.dumps(o, indent=1).encode())  # whitespace inside and around
    | st.builds(lambda o, pre, post: (pre + json.dumps(o) + post).encode(), json_objects,
                st.sampled_from(["", " ", "\n", "\ufeff"]), st.sampled_from(["", " ", "\t\n", "x", "}", "{}"]))
    | st.binary(max_size=64).map(lambda b: b"{" + b)
    | st.text(max_size=40).map(lambda t: ("{" + t).encode())
)


@SETTINGS
@given(json_bodies, st.data())
def test_decode_fast_path_agrees_with_json_loads(body, data):
    """The scanner's fast path accepts exactly what json.loads accepts, with the same object; a mutated
    body (a byte changed, or cut) too."""
    cut = data.draw(st.integers(0, len(body)), label="cut")
    for b in (body, body[:cut]):
        want, got = _stdlib_decode(b), _decoded(b)
        assert want[0] == got[0], (b, want, got)
        if want[0] == "object":
            assert got[1] == want[1]


@SETTINGS
@given(json_objects)
def test_encode_matches_json_dumps(obj):
    """The reused C encoder writes what json.dumps with the same options writes, byte for byte."""
    body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    assert encode_message(obj, 1 << 24) == HEADER.pack(len(body)) + body


def test_encode_refuses_a_circular_object():
    obj: dict = {"a": []}
    obj["a"].append(obj)
    with pytest.raises(InvalidArgumentError, match="not JSON-serialisable"):
        encode_message(obj)
