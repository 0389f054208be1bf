"""The wire spec's JSON Schemas (src/dmabuf_interop/channel/spec/schemas/, docs/protocol.md) against the code.

Two claims, each tested through the real code:

* every message the library builds validates against its kind's schema: messages captured from real
  handshakes and channels over real sockets (host pools; ``tcp://`` through NIXL in a child process);
* the schemas say exactly what the receiver's validation says: hypothesis builds valid messages of every
  kind and mutates them (fields dropped, added, retyped, pushed past their limits), and each is accepted
  by its schema and the rules docs/protocol.md lists as beyond a schema (``EXTRA``) iff the receiver's
  parser accepts it (``parse_message``; ``parse_region``, ``parse_nixl``; the ``tcp://`` authentication's
  field checks).

Integers: JSON Schema's ``integer`` admits ``1.0``; the receiver refuses it (an integer is written without
fraction or exponent, docs/protocol.md). The agreement tests use a validator whose ``integer`` is a JSON
integer token; the one known difference is asserted on its own below.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("jsonschema", reason="the schema tests need the test extras: pip install -e '.[test]'")
from jsonschema import Draft202012Validator, validators  # noqa: E402
from referencing import Registry  # noqa: E402
from referencing.jsonschema import DRAFT202012  # noqa: E402

from dmabuf_interop.channel import SharedPool, connect, listen, parse_message
from dmabuf_interop.channel import protocol as P
from dmabuf_interop.channel._ring import ring_unavailable
from dmabuf_interop.channel.protocol import MAX_METADATA_BYTES, parse_nixl, parse_region
from dmabuf_interop.channel.auth import _NONCE_BYTES, _field, authenticate_connector, authenticate_listener
from dmabuf_interop.channel.wire import MAX_FRAME
from dmabuf_interop.errors import PeerRefusedError, ProtocolError, WaitTimeoutError
from tests.helpers.remote import peer_env
from tests.helpers.spec_capture import captured

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = files("dmabuf_interop.channel") / "spec" / "schemas"
SCHEMAS: dict[str, dict[str, Any]] = {
    p.name[:-len(".json")]: json.loads(p.read_text()) for p in SCHEMA_DIR.iterdir() if p.name.endswith(".json")}
REGISTRY = Registry().with_resources((s["$id"], DRAFT202012.create_resource(s)) for s in SCHEMAS.values())
#: ``integer`` as a JSON integer token: a Python int that is not a bool (``1.0`` is not one).
Strict = validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool)))
VALIDATORS = {kind: Strict(s, registry=REGISTRY) for kind, s in SCHEMAS.items() if kind != "common"}
#: The kinds parse_message knows (every message after the handshake, and hello / refuse during it).
CHANNEL_KINDS = ("hello", "refuse", "ring", "chunk", "retire", "array", "arrays", "repeat", "release", "bye")
#: The kinds of the tcp:// handshake and the tcp:// chunk announcement.
REMOTE_KINDS = ("challenge", "auth", "proof", "nixl", "region")


def schema_errors(msg: dict[str, Any], kind: str | None = None) -> list[str]:
    """Why ``msg`` fails its kind's schema (``kind``: the one expected; default: its own ``kind``)."""
    kind = kind or (msg.get("kind") if isinstance(msg, dict) else None)
    if not isinstance(kind, str) or kind not in VALIDATORS:
        return [f"no schema for kind {kind!r}"]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATORS[kind].iter_errors(msg)]


def assert_valid(messages: list[dict[str, Any]]) -> None:
    bad = [(m, schema_errors(m)) for m in messages if schema_errors(m)]
    assert not bad, bad[:3]


# --- the files -------------------------------------------------------------------------------------------

def test_one_schema_per_kind_each_valid_draft_2020_12() -> None:
    assert set(SCHEMAS) == {"common", *CHANNEL_KINDS, *REMOTE_KINDS}
    for name, schema in SCHEMAS.items():
        Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["$id"] == f"urn:dmabuf-interop:channel:v{P.PROTOCOL_VERSION}:{name}"
        if name != "common":
            assert schema["properties"]["kind"] == {"const": name} and schema["additionalProperties"] is False


def test_schema_numbers_are_the_codes() -> None:
    common = SCHEMAS["common"]["$defs"]
    d = common["descriptor"]["properties"]
    assert d["chunk"]["maximum"] == P.MAX_INT == 1 << 62
    assert d["block_offset"]["multipleOf"] == P.BLOCK_ALIGN
    assert d["shape"]["maxItems"] == d["strides"]["maxItems"] == P.MAX_NDIM
    assert d["dtype"]["enum"] == list(P.DTYPES)
    assert common["ordering"]["properties"]["ordering"]["enum"] == list(P.ORDERINGS)
    assert common["ordering"]["then"]["properties"]["event"]["minLength"] == 4 * math.ceil(64 / 3)
    assert SCHEMAS["arrays"]["properties"]["items"]["maxItems"] == P.MAX_ITEMS
    assert SCHEMAS["chunk"]["properties"]["parts"]["maxItems"] == P.MAX_PARTS
    for kind, field in (("challenge", "nonce"), ("auth", "nonce"), ("auth", "mac"), ("proof", "mac")):
        assert SCHEMAS[kind]["properties"][field]["maxLength"] == 4 * math.ceil(_NONCE_BYTES / 3)
    for kind in ("nixl", "region"):
        assert SCHEMAS[kind]["properties"]["metadata"]["maxLength"] == 4 * MAX_METADATA_BYTES // 3 + 4
    itemsizes = {r["then"]["properties"]["strides"]["items"]["multipleOf"]: set(r["if"]["properties"]["dtype"]["enum"])
                 for r in common["descriptor"]["allOf"][1:]}
    assert itemsizes == {n: {k for k, v in P.DTYPES.items() if v == n} for n in set(P.DTYPES.values()) - {1}}


def test_protocol_md_states_the_codes_limits() -> None:
    from dmabuf_interop.channel.auth import MIN_SECRET_BYTES
    from dmabuf_interop.channel._link import SEND_TIMEOUT
    from dmabuf_interop.channel.channel import MAX_QUEUED
    from dmabuf_interop.channel.handshake import HANDSHAKE_MAX_FRAME, HANDSHAKE_TIMEOUT, REFUSE_TIMEOUT
    from dmabuf_interop.channel.wire import REST_TIMEOUT

    text = (ROOT / "docs" / "protocol.md").read_text()
    limits = text[text.index("## Limits"):text.index("## What a receiver refuses")]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in limits.splitlines()
            if line.startswith("| ") and not line.startswith("| limit")}
    assert rows["protocol version"] == str(P.PROTOCOL_VERSION)
    assert rows["frame body"] == f"{MAX_FRAME} bytes (16 MiB)"
    assert rows["rest of a frame once begun"] == f"{REST_TIMEOUT:g} s"
    assert rows["a message waiting for room in the socket"] == f"{SEND_TIMEOUT:g} s"
    assert rows["fds on one message"] == str(P.MAX_PARTS)
    assert rows["any id, size, offset, stride"] == "2^62" and P.MAX_INT == 2**62
    assert rows["block alignment"] == f"{P.BLOCK_ALIGN} bytes"
    assert rows["dimensions"] == str(P.MAX_NDIM)
    assert rows["items of one `arrays`"] == str(P.MAX_ITEMS)
    assert rows["`meta`"].startswith(f"{P.MAX_META_BYTES} bytes")
    assert rows["batch layouts remembered"] == str(P.MAX_LAYOUTS)
    assert rows["single-array layouts remembered"] == str(P.MAX_SINGLE_LAYOUTS)
    assert rows["chunks announced and not retired, per connection"] == str(P.MAX_CHUNKS)
    assert rows["`name`"] == f"{P.MAX_NAME_CHARS} characters"
    assert rows["handshake frame body"] == f"{HANDSHAKE_MAX_FRAME} bytes"
    most_metadata = "A" * SCHEMAS["nixl"]["properties"]["metadata"]["maxLength"]
    most = {"kind": "nixl", "agent": "a" * 256, "metadata": most_metadata}
    assert len(json.dumps(most, separators=(",", ":"))) <= HANDSHAKE_MAX_FRAME  # the largest nixl message fits
    assert rows["handshake, per connection (listener's default)"] == f"{HANDSHAKE_TIMEOUT:g} s"
    assert rows["a refusal leaving"] == f"{REFUSE_TIMEOUT:g} s"
    assert rows["array messages queued and not taken (Python receiver's default)"] == str(MAX_QUEUED)
    assert rows["`tcp://` secret"] == f"at least {MIN_SECRET_BYTES} bytes"
    assert rows["`nixl`, `region`: `metadata`"] == f"{MAX_METADATA_BYTES} bytes decoded"
    assert "src/dmabuf_interop/channel/spec/vectors/README.md" in text
    assert text.startswith(f"# Channel wire protocol, version {P.PROTOCOL_VERSION}\n")
    assert f"`urn:dmabuf-interop:channel:v{P.PROTOCOL_VERSION}:<kind>`" in text
    assert f"this version: {P.PROTOCOL_VERSION})" in text
    assert "`wire.MAX_FRAME`" in text and f"{HANDSHAKE_MAX_FRAME:,} bytes (`handshake.HANDSHAKE_MAX_FRAME`" in text


def test_protocol_md_lists_every_dtype_with_its_itemsize() -> None:
    """The descriptor's dtype table names each of protocol.DTYPES once, with its itemsize, and nothing else."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    table = text[text.index("| dtype | itemsize | element |"):text.index("## Chunks")]
    listed: dict[str, int] = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| "):
            break
        names, size = line.split("|")[1:3]
        for name in re.findall(r"`([a-z0-9_]+)`", names):
            assert name not in listed, name
            listed[name] = int(size)
    assert listed == P.DTYPES


def test_integral_floats_are_the_one_difference_from_plain_json_schema() -> None:
    msg = {"kind": "retire", "chunk": 1.0}
    assert Draft202012Validator(SCHEMAS["retire"]).is_valid(msg)  # JSON Schema: 1.0 is an integer
    assert schema_errors(msg)  # a JSON integer token
    with pytest.raises(ProtocolError, match="must be an integer"):
        parse_message(msg)


# --- what the code builds --------------------------------------------------------------------------------

@contextlib.contextmanager
def _pair(tmp_path: Path, pool: SharedPool | None, **connect_kw: Any):
    """(listener's channel, connector's channel); a refusal on either side raises here."""
    addr = str(tmp_path / "spec.sock")
    with listen(addr, pool=pool) as listener:
        got: dict[str, Any] = {}

        def connector() -> None:
            try:
                got["ch"] = connect(addr, timeout=10, **connect_kw)
            except PeerRefusedError as exc:
                got["error"] = exc

        t = threading.Thread(target=connector)
        t.start()
        try:
            ch = listener.accept(10, raise_refused=True)  # a refused handshake raises here, not times out
        finally:
            t.join(10)
        with ch:
            if "error" in got:
                raise got["error"]
            with got["ch"]:
                yield ch, got["ch"]


@pytest.mark.parametrize("with_ring", [pytest.param(True, marks=pytest.mark.ring), False], ids=["ring", "socket"])
def test_every_message_of_a_host_channel_validates(tmp_path: Path, with_ring: bool) -> None:
    """With the shared-memory ring, repeats without meta and releases go through it (the socket still carries
    the ring messages and the repeats with meta); without, every message is on the socket."""
    with captured() as seen, SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
        with _pair(tmp_path, pool, ring=with_ring) as (prod, cons):
            a = pool.empty((4, 3), "float64")
            a[...] = 1.5
            ring = pool.empty(8, "int32")
            state = {"w": pool.empty(5, "float32"), "b": pool.empty((), "int8")}
            for _ in range(2):  # defined, then repeated
                leases = [prod.send(a, meta={"step": 1, "text": "é"}), prod.send(ring),
                          prod.send_many(state, meta={"n": 2}), prod.send_many([a, ring])]
                for _ in range(2):
                    cons.recv(5).release()
                for _ in range(2):
                    for r in (lambda b: b.values() if isinstance(b, dict) else b)(cons.recv_many(5)):
                        r.release()
                for lease in leases:
                    lease.wait(5)
            prod.send(np.arange(6, dtype=np.uint16)[::2])  # copied into a new block: no layout
            cons.recv(5).release()
            prod.send_many({"x": np.zeros(0, dtype=np.complex64)})  # an empty array
            r = cons.recv_many(5)["x"]
            assert r.shape == (0,)
            r.release()
            big = pool.empty(70000, "uint8")  # a second chunk, retired once idle
            lease = prod.send(big)
            cons.recv(5).release()
            lease.wait(5)
            del big
            assert pool.trim() >= 1
    kinds = {m["kind"] for m in seen}
    assert {"hello", "chunk", "array", "arrays", "repeat", "retire", "bye"} <= kinds, kinds
    assert ("ring" in kinds) == with_ring and ("release" in kinds) != with_ring, kinds
    offers = {m["ring"] for m in seen if m["kind"] == "hello"}
    # (The listener offers where the ring is available; the connector did not, or did.)
    assert offers == ({1} if with_ring else {None} | ({1} if ring_unavailable() is None else set())), offers
    assert any(m["kind"] == "array" and "layout" in m for m in seen)
    assert any(m["kind"] == "arrays" and m["mapping"] for m in seen)
    assert_valid(seen)


def test_every_dtype_and_the_most_dimensions_validate(tmp_path: Path) -> None:
    """Arrays of every wire dtype (torch's where torch has it, else ml_dtypes') and of MAX_NDIM dimensions, as
    the library sends them: each descriptor validates, and together they name every dtype."""
    import ml_dtypes

    torch = pytest.importorskip("torch", reason="torch's dtypes need torch (CI installs the CPU build)")

    arrays = {n: (torch.zeros(4 * size, dtype=torch.uint8).view(getattr(torch, n)) if hasattr(torch, n)
                  else np.zeros(4, dtype=getattr(ml_dtypes, n))) for n, size in P.DTYPES.items()}
    with captured() as seen, SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as pool:
        with _pair(tmp_path, pool) as (prod, cons):
            lease = prod.send_many(arrays)
            for r in cons.recv_many(5).values():
                r.release()
            lease.wait(5)
            lease = prod.send(np.zeros((1,) * P.MAX_NDIM, dtype=np.float32))
            r = cons.recv(5)
            assert len(r.shape) == P.MAX_NDIM
            r.release()
            lease.wait(5)
    descs = [d for m in seen if m["kind"] == "arrays" for d in m["items"]]
    descs += [m["desc"] for m in seen if m["kind"] == "array"]
    assert {d["dtype"] for d in descs} == set(P.DTYPES)
    assert max(len(d["shape"]) for d in descs) == P.MAX_NDIM
    assert_valid(seen)


def _raw_to_listener(tmp_path: Path, first: bytes) -> dict[str, Any]:
    """What a listener (handshake_timeout 0.5 s) sends a raw client that sends ``first`` and then waits: its
    hello, then its refusal (the frames as they cross, read off the socket)."""
    addr = str(tmp_path / "raw.sock")
    with listen(addr, handshake_timeout=0.5) as listener, socket.socket(socket.AF_UNIX) as s:
        got: dict[str, Any] = {}

        def accept() -> None:  # (handshakes run while an accept takes connections)
            try:
                listener.accept(10, raise_refused=True)
            except Exception as exc:  # noqa: BLE001 - the refusal, checked below
                got["error"] = exc

        t = threading.Thread(target=accept)
        t.start()
        s.settimeout(10)
        s.connect(addr)
        s.sendall(first)
        frames, buf = [], b""
        while True:
            data = s.recv(1 << 16)
            if not data:
                break
            buf += data
        while buf:
            n = int.from_bytes(buf[:4], "big")
            frames.append(json.loads(buf[4:4 + n]))
            buf = buf[4 + n:]
        t.join(10)
        assert isinstance(got.get("error"), (ProtocolError, WaitTimeoutError)), got
        assert listener.refused == 1
    assert [f["kind"] for f in frames] == ["hello", "refuse"], frames
    assert_valid(frames)
    return frames[1]


def test_the_listeners_handshake_refusals_validate(tmp_path: Path) -> None:
    """docs/protocol.md, Deadlines and refusals: a hello begun and not finished within the deadline, and a
    handshake frame past HANDSHAKE_MAX_FRAME, are refused with a reason before the listener drops the peer."""
    from dmabuf_interop.channel.handshake import HANDSHAKE_MAX_FRAME

    half = json.dumps({"kind": "hello", "protocol": P.PROTOCOL_VERSION}).encode()
    slow = _raw_to_listener(tmp_path, (len(half) + 10).to_bytes(4, "big") + half)
    assert "within 0.5 s" in slow["reason"]
    big = _raw_to_listener(tmp_path, (HANDSHAKE_MAX_FRAME + 1).to_bytes(4, "big"))
    assert str(HANDSHAKE_MAX_FRAME) in big["reason"], big


def test_refusals_in_the_handshake_validate(tmp_path: Path) -> None:
    with captured() as seen, pytest.raises(PeerRefusedError, match="protocol version mismatch"):
        with _pair(tmp_path, None, hello_overrides={"protocol": P.PROTOCOL_VERSION + 1}):
            pass  # the connector refuses the listener's hello; the listener's accept learns why
    with captured() as refused, pytest.raises(PeerRefusedError, match="not allowed"):
        with _pair(tmp_path, None, allow_uids=[os.geteuid() + 1]):
            pass  # the connector refuses the listener's uid
    seen += refused
    assert [m["kind"] for m in seen].count("refuse") >= 2
    assert_valid(seen)


def _auth(listener_secret: bytes, connector_secret: bytes) -> None:
    a, b = socket.socketpair()

    def side(fn: Callable[..., None], sock: socket.socket, secret: bytes) -> None:
        with contextlib.suppress(PeerRefusedError), sock:
            fn(sock, secret, 10)

    t = threading.Thread(target=side, args=(authenticate_listener, a, listener_secret))
    t.start()
    side(authenticate_connector, b, connector_secret)
    t.join(10)


def test_authentication_messages_validate() -> None:
    secret = b"spec-shared-secret-0123456789"
    with captured() as seen:
        _auth(secret, secret)
        _auth(secret, b"another-secret-of-enough-bytes")
    assert [m["kind"] for m in seen].count("proof") == 2 and any(m["kind"] == "refuse" for m in seen)
    assert_valid(seen)


@pytest.mark.nixl
def test_every_message_of_a_tcp_channel_validates() -> None:
    p = subprocess.run([sys.executable, "-m", "tests.helpers.spec_capture", "remote"], cwd=ROOT, env=peer_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    seen = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert {"challenge", "auth", "proof", "hello", "nixl", "region", "arrays", "array", "release",
            "bye"} <= {m["kind"] for m in seen}
    assert_valid(seen)


# --- the schemas say what the parser says -----------------------------------------------------------------

def _meta_bytes(meta: Any) -> int:
    return len(json.dumps(meta, separators=(",", ":")).encode())


def _descriptor_extra(d: dict[str, Any]) -> bool:
    """What docs/protocol.md lists as beyond the descriptor's schema."""
    if len(d["shape"]) != len(d["strides"]):
        return False
    if 0 not in d["shape"]:
        extent = d["byte_offset"] + P.DTYPES[d["dtype"]] + sum((n - 1) * s for n, s in zip(d["shape"], d["strides"]))
        if extent > d["block_bytes"]:
            return False
    return d["meta"] is None or _meta_bytes(d["meta"]) <= P.MAX_META_BYTES


#: Per kind, the rules docs/protocol.md lists as not expressible in its schema (checked on messages the schema
#: accepts). State-dependent rules (ids announced, layouts known, leases held) are not the parser's either.
EXTRA: dict[str, Callable[[dict[str, Any]], bool]] = {
    "chunk": lambda m: sum(m["parts"]) == m["size"],
    "array": lambda m: _descriptor_extra(m["desc"]),
    "arrays": lambda m: all(map(_descriptor_extra, m["items"])) and (
        not m["mapping"] or len({d["name"] for d in m["items"]}) == len(m["items"])),
    "repeat": lambda m: m["meta"] is None or _meta_bytes(m["meta"]) <= P.MAX_META_BYTES,
    "ring": lambda m: all(m[k] & (m[k] - 1) == 0 for k in ("slots", "release_slots")) and m["bytes"] == (
        (4096 + m["slots"] * 128 + m["release_slots"] * 8 + 4095) // 4096 * 4096),
    "nixl": lambda m: m["agent"] != OWN_AGENT,  # (state: the receiver's own agent name)
}
#: The receiver's NIXL agent name, for the ``nixl`` rule above.
OWN_AGENT = "dmabuf-interop-spec-agent"
_SURPLUS_PADDING = re.compile(r"(?:[A-Za-z0-9+/]{4})+=+")


def _lenient(kind: str, msg: dict[str, Any]) -> bool:
    """docs/protocol.md: the schemas pin canonical base64; Python's decoder also takes a complete encoding
    followed by surplus ``=`` in ``metadata`` (whether it does depends on the Python version). Such messages
    are left out of the agreement."""
    v = msg.get("metadata") if kind in ("nixl", "region") else None
    return isinstance(v, str) and _SURPLUS_PADDING.fullmatch(v) is not None


def _auth_parser(kind: str, fields: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    keys = {"kind", *fields}

    def parse(msg: dict[str, Any]) -> None:  # as authenticate_listener / _connector read the message
        for f in fields:
            _field(msg, kind, keys, f, _NONCE_BYTES)
    return parse


def _tcp_parser(kind: str, parse: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def check(msg: dict[str, Any]) -> None:  # as the tcp:// handshake and ConnectionState dispatch on the kind
        if msg.get("kind") != kind:
            raise ProtocolError(f"expected a {kind} message")
        parse(msg)
    return check


#: The receiver's parser of each kind (raises ProtocolError or PeerRefusedError to refuse).
PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    **{kind: parse_message for kind in CHANNEL_KINDS},
    "nixl": _tcp_parser("nixl", lambda m: parse_nixl(m, OWN_AGENT)),
    "region": _tcp_parser("region", parse_region),
    "challenge": _auth_parser("challenge", ("nonce",)),
    "auth": _auth_parser("auth", ("nonce", "mac")),
    "proof": _auth_parser("proof", ("mac",)),
}


def _parser_accepts(parse: Callable[[dict[str, Any]], Any], msg: Any) -> bool:
    try:
        parse(msg)
    except (ProtocolError, PeerRefusedError):
        return False
    return True


def check_agreement(expected_kind: str, msg: Any) -> None:
    """The parser for ``expected_kind`` accepts ``msg`` iff its schema and the kind's EXTRA rules do. For the
    channel kinds the message's own ``kind`` picks the schema, as ``parse_message`` picks its checks."""
    parse = PARSERS[expected_kind]
    if not isinstance(msg, dict):  # no frame holds one: the framing refuses it (a JSON object or nothing)
        assert schema_errors(msg, expected_kind) and not _parser_accepts(parse_message, msg)
        return
    kind = expected_kind if expected_kind in REMOTE_KINDS else msg.get("kind")
    known = kind in (REMOTE_KINDS if expected_kind in REMOTE_KINDS else CHANNEL_KINDS)
    if known and _lenient(kind, msg):
        return
    schema_ok = known and VALIDATORS[kind].is_valid(msg) and EXTRA.get(kind, lambda m: True)(msg)
    assert _parser_accepts(parse, msg) == schema_ok, (msg, schema_errors(msg, kind) if known else "unknown kind")


# Valid messages of every kind.
ids = st.integers(0, P.MAX_INT)
small = st.integers(0, 6)
json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6)
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                            max_size=3), max_leaves=8)
metas = st.none() | st.dictionaries(st.text(max_size=5), json_values, max_size=3)


def b64(n: int) -> st.SearchStrategy[str]:
    return st.binary(min_size=n, max_size=n).map(lambda b: base64.b64encode(b).decode())


orderings = st.sampled_from(P.ORDERINGS).flatmap(
    lambda o: st.tuples(st.just(o), b64(64) if o == "event" else st.none()))


@st.composite
def descriptors(draw: Any, name: Any = st.none() | st.text(max_size=8)) -> dict[str, Any]:
    dtype = draw(st.sampled_from(list(P.DTYPES)))
    size = P.DTYPES[dtype]
    ndim = draw(st.integers(0, 4) | st.just(P.MAX_NDIM))
    shape = draw(st.lists(small, min_size=ndim, max_size=ndim))
    strides = [size * draw(small) for _ in range(ndim)]
    byte_offset = size * draw(st.integers(0, 64))
    extent = 0 if 0 in shape else byte_offset + size + sum((n - 1) * s for n, s in zip(shape, strides))
    ordering, event = draw(orderings)
    return {"chunk": draw(ids), "block_offset": P.BLOCK_ALIGN * draw(st.integers(0, 1 << 20)),
            "block_bytes": extent + draw(st.integers(0, 512)), "byte_offset": byte_offset, "shape": shape,
            "strides": strides, "dtype": dtype, "ordering": ordering, "event": event, "name": draw(name),
            "meta": draw(metas)}


@st.composite
def batches(draw: Any, most: int = 4) -> dict[str, Any]:
    mapping = draw(st.booleans())
    n = draw(st.integers(0, most))
    names = draw(st.lists(st.text(max_size=6), min_size=n, max_size=n, unique=True)) if mapping else [None] * n
    msg = {"kind": "arrays", "lease": draw(ids), "items": [draw(descriptors(st.just(nm))) for nm in names],
           "mapping": mapping}
    if n and draw(st.booleans()):
        msg["layout"] = draw(ids)
    return msg


@st.composite
def chunks(draw: Any) -> dict[str, Any]:
    mechanism = draw(st.sampled_from(["memfd", "posix-fd"]))
    parts = draw(st.lists(st.integers(1, 1 << 40), min_size=1, max_size=1 if mechanism == "memfd" else 8))
    return {"kind": "chunk", "chunk": draw(ids), "size": sum(parts), "mechanism": mechanism,
            "device_uuid": "" if mechanism == "memfd" else "GPU-" + draw(st.uuids()).hex, "parts": parts}


@st.composite
def repeats(draw: Any) -> dict[str, Any]:
    ordering, event = draw(orderings)
    return {"kind": "repeat", "lease": draw(ids), "layout": draw(ids), "ordering": ordering, "event": event,
            "meta": draw(metas)}


def _with_layout(msg: dict[str, Any], layout: int | None) -> dict[str, Any]:
    return msg if layout is None else {**msg, "layout": layout}


VALID: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "hello": st.builds(lambda p, lib, boot, gpus, pid, ring: {"kind": "hello", "protocol": p, "library": lib,
                                                               "boot_id": boot, "gpus": gpus, "pid": pid, "ring": ring},
                       st.integers(0, 1 << 31), st.text(max_size=64), st.text(max_size=64),
                       st.lists(st.text(max_size=64), max_size=4), st.integers(0, 1 << 31),
                       st.none() | st.integers(1, 1 << 31)),
    "ring": st.builds(lambda slots, rel: {"kind": "ring", "version": 1, "slots": 1 << slots, "release_slots": 1 << rel,
                                          "bytes": (4096 + (128 << slots) + (8 << rel) + 4095) // 4096 * 4096},
                      st.integers(0, 16), st.integers(0, 20)),
    "refuse": st.builds(lambda r: {"kind": "refuse", "reason": r}, st.text(max_size=100)),
    "chunk": chunks(),
    "retire": st.builds(lambda c: {"kind": "retire", "chunk": c}, ids),
    "array": st.builds(lambda lease, d, layout: _with_layout({"kind": "array", "lease": lease, "desc": d}, layout),
                       ids, descriptors(), st.none() | ids),
    "arrays": batches(),
    "repeat": repeats(),
    "release": st.builds(lambda ls: {"kind": "release", "leases": ls}, st.lists(ids, max_size=5)),
    "bye": st.just({"kind": "bye"}),
    "challenge": st.builds(lambda n: {"kind": "challenge", "nonce": n}, b64(32)),
    "auth": st.builds(lambda n, m: {"kind": "auth", "nonce": n, "mac": m}, b64(32), b64(32)),
    "proof": st.builds(lambda m: {"kind": "proof", "mac": m}, b64(32)),
    "nixl": st.builds(lambda a, md: {"kind": "nixl", "agent": a, "metadata": md},
                      st.text(min_size=1, max_size=256).filter(lambda a: a != OWN_AGENT),
                      st.integers(0, 70).flatmap(b64)),
    "region": st.builds(lambda c, addr, size, dev, mem, md: {"kind": "region", "chunk": c, "addr": addr, "size": size,
                                                            "device": dev, "mem": mem, "metadata": md},
                        st.integers(1, P.MAX_INT), ids, st.integers(1, P.MAX_INT), st.integers(0, 1 << 16),
                        st.sampled_from(["DRAM", "VRAM"]), st.integers(0, 70).flatmap(b64)),
}

# Mutations: one or two edits anywhere in the message, chosen by what the field is, at and past each limit.
FIELD_NAMES = sorted({k for s in SCHEMAS.values() for k in s.get("properties", {})}
                     | set(SCHEMAS["common"]["$defs"]["descriptor"]["properties"]) | {"x"})
B64_64 = "A" * 86 + "=="
FIELD_VALUES: dict[str, tuple[Any, ...]] = {
    "kind": (*CHANNEL_KINDS, *REMOTE_KINDS, "launch", None),
    "dtype": (*P.DTYPES, "object", ">f8", None),
    "ordering": (*P.ORDERINGS, "maybe", None),
    "event": (None, B64_64, "A" * 85 + "B==", "A" * 87 + "=", "A" * 88, "AAAA", "A" * 86 + "=", B64_64 + "\n", 0),
    "mechanism": ("memfd", "posix-fd", "dmabuf", None),
    "mapping": (True, False, 0, 1, None),
    "name": (None, None, "", "a", "b", "A" * 4096, "A" * 4097, 0),
    "meta": (None, {}, {"a": 1}, [], "x", {"x": "y" * 65528}, {"x": "y" * 65529}),
    "nonce": ("A" * 43 + "=", "A" * 42 + "==", "A" * 44, "A" * 43 + "!", "A" * 43 + "=\n", None),
    "device_uuid": ("", "GPU-x", "G" * 64, "G" * 65, None),
    "metadata": ("", "AAAA", "AAA=", "AA==", "A", "AAA", "AA=A", "====", "AAAA\n", "*AAA", "AAAA=", 7, None),
    "mem": ("DRAM", "VRAM", "dram", None),
    "agent": ("", "a", OWN_AGENT, "A" * 256, "A" * 257, None),
}
FIELD_VALUES["mac"] = FIELD_VALUES["nonce"]
INT_EDGES = (0, 1, -1, 255, 256, P.MAX_INT, P.MAX_INT + 1, 1 << 31, (1 << 31) + 1, 65536, True, 1.0, "1", None)
#: Lengths tried for a string or list field: around its limit (a batch's 65,536 items and a release's 2^20
#: leases are left out: too slow to build here).
LENGTHS: dict[Any, tuple[int, ...]] = {
    "shape": (0, 1, 32, 33), "strides": (0, 1, 32, 33), "parts": (0, 1, 2, 253, 254), "gpus": (0, 1024, 1025),
    "library": (0, 64, 65), "boot_id": (0, 64, 65), "device_uuid": (0, 64, 65), "reason": (0, 4096, 4097),
    "name": (0, 4096, 4097), "event": (0, 88, 89, 128, 129), "nonce": (0, 43, 44, 45), "mac": (0, 43, 44, 45),
    "items": (0, 1, 2), "leases": (0, 1, 2), "agent": (0, 1, 256, 257)}


def _lengths(key: Any) -> tuple[int, ...]:
    return LENGTHS.get(key, (0, 1))


def _paths(obj: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*at, i))
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _edit(draw: Any, key: Any, value: Any) -> Any:
    """A new value for a field named ``key`` (the list's name for its items) that holds ``value``."""
    if key in FIELD_VALUES and draw(st.booleans()):
        return draw(st.sampled_from(FIELD_VALUES[key]))
    if isinstance(value, int) and not isinstance(value, bool):
        if draw(st.booleans()):
            return value + draw(st.sampled_from([-256, -8, -4, -2, -1, 1, 2, 4, 8, 256]))
        return draw(st.sampled_from(INT_EDGES))
    if isinstance(value, (str, list)) and draw(st.booleans()):
        n = draw(st.sampled_from(_lengths(key)))
        if isinstance(value, str):
            return (value * n)[:n] if value else "A" * n
        return (value * n)[:n] if value else [0] * n
    return draw(st.sampled_from(INT_EDGES) | json_values)


def _mutate(draw: Any, msg: dict[str, Any]) -> Any:
    msg = json.loads(json.dumps(msg))
    path = draw(st.sampled_from(_paths(msg)))
    target = _get(msg, path)
    if isinstance(target, dict) and draw(st.booleans()):
        if target and draw(st.booleans()):
            del target[draw(st.sampled_from(sorted(target)))]
        else:
            key = draw(st.sampled_from(["layout", "layout", "meta", *FIELD_NAMES]) | st.text(max_size=4))
            target[key] = _edit(draw, key, draw(st.sampled_from([0, 1, "", [], None])))
        return msg
    if isinstance(target, list) and target and draw(st.booleans()):
        del target[draw(st.integers(0, len(target) - 1))]
        return msg
    if not path:
        return draw(json_values)  # the whole message replaced
    key = next((p for p in reversed(path) if isinstance(p, str)), None)
    _get(msg, path[:-1])[path[-1]] = _edit(draw, key, target)
    return msg


def single_edits(msg: dict[str, Any]) -> Any:
    """Every message one edit away from ``msg``: each field dropped, or set to each value its table, the
    integer edges, nearby integers or the lengths around each limit give; a field added to each object;
    a descriptor's shape and strides made 31, 32 and 33 long together."""
    for path in _paths(msg):
        target = _get(msg, path)
        key = next((p for p in reversed(path) if isinstance(p, str)), None)
        if path and isinstance(path[-1], int):  # a list's item: its first two and its last, a few values each
            if 1 < path[-1] < len(_get(msg, path[:-1])) - 1:
                continue
            values: list[Any] = [-1, 1.0, True, None, P.MAX_INT + 1]
        else:
            values = [*FIELD_VALUES.get(key, ()), *INT_EDGES]
        if isinstance(target, int) and not isinstance(target, bool):
            values += [target + d for d in (-256, -8, -4, -2, -1, 1, 2, 4, 8, 256)]
        if isinstance(target, (str, list)):
            values += [(target * n)[:n] if target else ("A" * n if isinstance(target, str) else [0] * n)
                       for n in _lengths(key)]
        for v in values:
            if path:
                edited = json.loads(json.dumps(msg))
                _get(edited, path[:-1])[path[-1]] = v
                yield edited
        if path:
            edited = json.loads(json.dumps(msg))
            del _get(edited, path[:-1])[path[-1]]
            yield edited
        if isinstance(target, dict):
            for key in ("layout", "meta", "x"):
                for v in (0, None, {}):
                    edited = json.loads(json.dumps(msg))
                    _get(edited, path)[key] = v
                    yield edited
            if "shape" in target and "strides" in target:
                for n in (P.MAX_NDIM - 1, P.MAX_NDIM, P.MAX_NDIM + 1):
                    edited = json.loads(json.dumps(msg))
                    _get(edited, path).update(shape=[1] * n, strides=[0] * n)
                    yield edited


AGREEMENT = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", sorted(VALID))
def test_valid_messages_are_accepted_by_both(kind: str) -> None:
    @AGREEMENT
    @given(VALID[kind])
    def run(msg: dict[str, Any]) -> None:
        assert not schema_errors(msg, kind), schema_errors(msg, kind)
        check_agreement(kind, msg)

    run()


def _desc(**kw: Any) -> dict[str, Any]:
    return {"chunk": 3, "block_offset": 512, "block_bytes": 96, "byte_offset": 5, "shape": [2, 3],
            "strides": [9, 3], "dtype": "uint8", "ordering": "none", "event": None, "name": None, "meta": None, **kw}


#: Messages every sweep starts from besides hypothesis's own: odd offsets and strides (so that a larger itemsize
#: breaks them), every optional field present, several parts and items.
BASES: dict[str, list[dict[str, Any]]] = {
    "array": [{"kind": "array", "lease": 1, "desc": _desc(), "layout": 2},
              {"kind": "array", "lease": 1, "desc": _desc(dtype="float16", byte_offset=6, strides=[18, 6],
                                                         ordering="event", event=B64_64, meta={"a": [1]})}],
    "arrays": [{"kind": "arrays", "lease": 1, "mapping": True, "layout": 4,
                "items": [_desc(name="a"), _desc(name="b", dtype="int32", byte_offset=12, strides=[36, 12])]},
               {"kind": "arrays", "lease": 1, "mapping": False,
                "items": [_desc(), _desc(dtype="complex128", byte_offset=16, strides=[48, 16], block_bytes=128)]}],
    "chunk": [{"kind": "chunk", "chunk": 1, "size": 6, "mechanism": "posix-fd", "device_uuid": "GPU-0",
               "parts": [1, 2, 3]}],
    "repeat": [{"kind": "repeat", "lease": 1, "layout": 2, "ordering": "event", "event": B64_64, "meta": {"a": 1}}],
    "release": [{"kind": "release", "leases": [1, 2, 3]}],
    "hello": [{"kind": "hello", "protocol": 4, "library": "x", "boot_id": "b", "gpus": ["GPU-0", "GPU-1"],
               "pid": 1, "ring": 1}],
    "ring": [{"kind": "ring", "version": 1, "bytes": 45056, "slots": 256, "release_slots": 1024}],
}


@pytest.mark.parametrize("kind", sorted(VALID))
def test_every_single_edit_schema_iff_parser(kind: str) -> None:
    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(batches(most=2) if kind == "arrays" else VALID[kind])
    def run(msg: dict[str, Any]) -> None:
        for edited in single_edits(msg):
            check_agreement(kind, edited)

    for base in BASES.get(kind, []):
        assert not schema_errors(base) and _parser_accepts(PARSERS[kind], base)
        run = example(base)(run)
    run()


@pytest.mark.parametrize("kind", sorted(VALID))
def test_mutated_messages_schema_iff_parser(kind: str) -> None:
    @AGREEMENT
    @given(VALID[kind], st.data())
    def run(msg: dict[str, Any], data: Any) -> None:
        for _ in range(data.draw(st.integers(1, 2))):
            msg = _mutate(data.draw, msg) if isinstance(msg, dict) else msg
        check_agreement(kind, msg)

    run()


@pytest.mark.parametrize("msg, accepted", [
    ({"kind": "chunk", "chunk": 1, "size": 8192, "mechanism": "memfd", "device_uuid": "", "parts": [4096]}, False),
    ({"kind": "array", "lease": 1, "desc": {**{"chunk": 1, "block_offset": 0, "block_bytes": 8, "byte_offset": 0,
                                               "shape": [2], "strides": [8], "dtype": "float64", "ordering": "none",
                                               "event": None, "name": None, "meta": None}}}, False),
    ({"kind": "arrays", "lease": 1, "mapping": True, "items": [
        {"chunk": 1, "block_offset": 0, "block_bytes": 8, "byte_offset": 0, "shape": [], "strides": [],
         "dtype": "float64", "ordering": "none", "event": None, "name": "a", "meta": None}] * 2}, False),
    ({"kind": "repeat", "lease": 1, "layout": 1, "ordering": "none", "event": None,
      "meta": {"x": "é" * 11000}}, False),  # 66,011 bytes once escaped as \\u00e9, though 22,009 as UTF-8
    ({"kind": "repeat", "lease": 1, "layout": 1, "ordering": "none", "event": None, "meta": {"x": "é" * 10000}}, True),
])
def test_rules_beyond_the_schema(msg: dict[str, Any], accepted: bool) -> None:
    """Each rule docs/protocol.md lists as beyond the schema, once by hand: the schema alone accepts the message."""
    assert not schema_errors(msg)
    assert _parser_accepts(parse_message, msg) == accepted == EXTRA[msg["kind"]](msg)


def test_the_golden_vectors_messages_agree_with_the_schemas() -> None:
    """Every message of the golden vectors (spec/vectors/): the schema and the parser agree on it, and each
    message a vector's receiver accepts validates against its kind's schema."""
    vector_dir = files("dmabuf_interop.channel") / "spec" / "vectors"
    accepted = refused = 0
    for f in (p for p in vector_dir.iterdir() if p.name.endswith(".json")):
        for vector in json.loads(f.read_text())["vectors"]:
            for step in vector["steps"]:
                msg = step.get("receive")
                if msg is None:
                    continue
                kind = msg.get("kind") if isinstance(msg, dict) else None
                check_agreement(kind if kind in PARSERS else "bye", msg)
                if "expect" in step:
                    assert not schema_errors(msg) and EXTRA.get(kind, lambda m: True)(msg), (vector["name"], msg)
                    accepted += 1
                else:
                    refused += 1
    assert accepted > 50 and refused > 20, (accepted, refused)
