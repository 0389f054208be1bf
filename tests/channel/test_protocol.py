"""Descriptor and message validation: fuzzed decoders, and a hostile peer on a real socket."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel import ArrayDescriptor, SharedPool, connect, listen, parse_message
from dmabuf_interop.channel.protocol import DTYPES
from dmabuf_interop.channel.wire import send_frame
from dmabuf_interop.errors import ProtocolError
from dmabuf_interop.fdpass import send_message
from tests.helpers.channels import hand_written_listener

GOOD = {"chunk": 1, "block_offset": 256, "block_bytes": 1024, "byte_offset": 8, "shape": [4, 3],
        "strides": [24, 8], "dtype": "float64", "ordering": "none", "event": None, "name": None, "meta": {"a": 1}}


def test_good_descriptor_round_trips() -> None:
    d = ArrayDescriptor.from_json(dict(GOOD))
    assert d.shape == (4, 3) and d.extent() == 8 + 3 * 24 + 2 * 8 + 8
    assert ArrayDescriptor.from_json(d.to_json()) == d


@pytest.mark.parametrize("field, value, text", [
    ("chunk", True, "must be an integer"),
    ("chunk", -1, "outside"),
    ("block_bytes", 1.5, "must be an integer"),
    ("block_offset", 260, "not a multiple of 256"),
    ("shape", [4, True], "expected integers"),
    ("strides", [-24, 8], "expected integers"),
    ("strides", [24, 4], "multiples"),
    ("shape", [400, 3], "outside its 1024-byte block"),
    ("byte_offset", 1024, "outside"),
    ("dtype", "object", "unknown dtype"),
    ("dtype", ">f8", "unknown dtype"),
    ("ordering", "maybe", "unknown ordering"),
    ("event", "AAAA", "event handle came with"),
    ("meta", [1], "must be a JSON object"),
    ("meta", {"x": "y" * 70000}, "more than"),
])
def test_bad_descriptor_fields(field: str, value: object, text: str) -> None:
    obj = dict(GOOD)
    obj[field] = value
    with pytest.raises(ProtocolError, match=text):
        ArrayDescriptor.from_json(obj)


def test_missing_and_extra_fields() -> None:
    obj = dict(GOOD)
    del obj["shape"]
    with pytest.raises(ProtocolError, match="missing"):
        ArrayDescriptor.from_json(obj)
    with pytest.raises(ProtocolError, match="unexpected"):
        ArrayDescriptor.from_json({**GOOD, "ptr": 1})


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["x"]), json_values, max_size=12))
def test_fuzz_descriptor_only_protocol_errors(obj: dict) -> None:
    try:
        d = ArrayDescriptor.from_json(obj)
    except ProtocolError:
        return
    assert d.extent() <= d.block_bytes and d.dtype in DTYPES


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({k: st.one_of(st.just(v), json_values) for k, v in GOOD.items()}))
def test_fuzz_near_valid_descriptors(obj: dict) -> None:
    try:
        d = ArrayDescriptor.from_json(obj)
    except ProtocolError:
        return
    assert all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (*d.shape, *d.strides))
    assert d.extent() <= d.block_bytes


@settings(max_examples=400)
@given(st.dictionaries(st.sampled_from(["kind", "lease", "desc", "items", "mapping", "leases", "chunk", "size",
                                        "mechanism", "device_uuid", "parts", "reason"]),
                       st.sampled_from(["hello", "chunk", "retire", "array", "arrays", "release", "bye", "refuse",
                                        "nope"]) | json_values, max_size=6))
def test_fuzz_messages_only_protocol_errors(msg: dict) -> None:
    try:
        parse_message(msg)
    except ProtocolError:
        pass


# --- a hostile listener: it completes the handshake, then misbehaves --------------------------------

def hostile(addr: str, script) -> threading.Thread:
    """A listener that completes the handshake (offering no ring), then runs ``script(conn)``."""
    return hand_written_listener(addr, lambda conn, _rings: script(conn), ring=None, make=False)


def desc(**kw) -> dict:
    return {**GOOD, "meta": None, **kw}


@pytest.mark.parametrize("name, script, text", [
    ("unknown chunk", lambda c: send_frame(c, {"kind": "array", "lease": 1, "desc": desc()}), "unknown chunk"),
    ("unknown kind", lambda c: send_frame(c, {"kind": "launch"}), "unknown message kind"),
    ("bool lease", lambda c: send_frame(c, {"kind": "array", "lease": True, "desc": desc()}), "integer"),
    ("release of a lease never lent", lambda c: send_frame(c, {"kind": "release", "leases": [7]}), "unknown lease"),
    ("hello again", lambda c: send_frame(c, {"kind": "hello", "protocol": 1, "library": "x", "boot_id": "b",
                                             "gpus": [], "pid": 1, "ring": None}), "after the handshake"),
    ("repeat of a layout never defined", lambda c: send_frame(c, {"kind": "repeat", "lease": 1, "layout": 3,
                                                                  "ordering": "none", "event": None, "meta": None}),
     "unknown layout"),
    ("repeat with an extra field", lambda c: send_frame(c, {"kind": "repeat", "lease": 1, "layout": 3, "items": [],
                                                            "ordering": "none", "event": None, "meta": None}),
     "wrong fields"),
    ("repeat with an event but sync", lambda c: send_frame(c, {"kind": "repeat", "lease": 1, "layout": 3,
                                                               "ordering": "sync", "event": "AAAA", "meta": None}),
     "event handle came with"),
])
def test_hostile_messages_close_the_channel(tmp_path: Path, name: str, script, text: str) -> None:
    addr = str(tmp_path / "h.sock")
    t = hostile(addr, script)
    with connect(addr, timeout=10) as ch:
        with pytest.raises(ProtocolError, match=text):
            ch.recv(10)
        assert ch.closed
    t.join(10)


def test_hostile_chunk_fds_are_checked_before_mapping(tmp_path: Path) -> None:
    r, w = os.pipe()

    def script(c) -> None:
        send_message(c, {"kind": "chunk", "chunk": 1, "size": 4096, "mechanism": "memfd", "device_uuid": "",
                         "parts": [4096]}, r)

    addr = str(tmp_path / "h.sock")
    t = hostile(addr, script)
    with connect(addr, timeout=10) as ch:
        with pytest.raises(ProtocolError, match="not a memfd"):
            ch.recv(10)
    t.join(10)
    os.close(r)
    os.close(w)


def _memfd_chunk(c, cid: int, size: int) -> None:
    import fcntl

    fd = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    send_message(c, {"kind": "chunk", "chunk": cid, "size": size, "mechanism": "memfd", "device_uuid": "",
                     "parts": [size]}, fd)
    os.close(fd)


def _layout_desc(block_offset: int) -> dict:
    return desc(block_offset=block_offset, block_bytes=4096, byte_offset=0, shape=[512], strides=[8], meta=None)


_REPEAT = {"kind": "repeat", "lease": 2, "layout": 1, "ordering": "none", "event": None, "meta": None}


def _reannounced_smaller(c) -> None:  # the same chunk id, retired, then announced again at 4 KiB
    _memfd_chunk(c, 1, 1 << 20)
    send_frame(c, {"kind": "arrays", "lease": 1, "items": [_layout_desc((1 << 20) - 4096)], "mapping": False,
                   "layout": 1})
    send_frame(c, {"kind": "retire", "chunk": 1})
    _memfd_chunk(c, 1, 4096)
    send_frame(c, _REPEAT)


def _single_reannounced_smaller(c) -> None:  # as above, for one array's layout
    _memfd_chunk(c, 1, 1 << 20)
    send_frame(c, {"kind": "array", "lease": 1, "desc": _layout_desc((1 << 20) - 4096), "layout": 1})
    send_frame(c, {"kind": "retire", "chunk": 1})
    _memfd_chunk(c, 1, 4096)
    send_frame(c, _REPEAT)


def _single_layout_bad_id(c) -> None:
    _memfd_chunk(c, 1, 4096)
    send_frame(c, {"kind": "array", "lease": 1, "desc": _layout_desc(0), "layout": -1})


def _single_layout_twice(c) -> None:
    _memfd_chunk(c, 1, 8192)
    send_frame(c, {"kind": "arrays", "lease": 1, "items": [_layout_desc(0)], "mapping": False, "layout": 1})
    send_frame(c, {"kind": "array", "lease": 2, "desc": _layout_desc(4096), "layout": 1})


def _block_outside(c) -> None:
    _memfd_chunk(c, 1, 4096)
    send_frame(c, {"kind": "array", "lease": 1, "desc": desc(block_offset=4096 - 256)})


def _empty_layout(c) -> None:
    _memfd_chunk(c, 1, 4096)
    # Refused as it arrives: the consumer ends the connection (a repeat sent after it met a closed socket).
    send_frame(c, {"kind": "arrays", "lease": 1, "items": [], "mapping": False, "layout": 1})


def _event_on_host(c) -> None:
    _memfd_chunk(c, 1, 4096)
    send_frame(c, {"kind": "arrays", "lease": 1, "items": [_layout_desc(0)], "mapping": False, "layout": 1})
    send_frame(c, {**_REPEAT, "ordering": "event", "event": "A" * 86 + "=="})


def _memfd(size: int) -> int:
    import fcntl

    fd = os.memfd_create("x", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _chunk_msg(**kw) -> dict:
    return {"kind": "chunk", "chunk": 1, "size": 8192, "mechanism": "memfd", "device_uuid": "", "parts": [8192],
            **kw}


def _parts_script(msg: dict, nfds: int):
    def script(c) -> None:
        fds = [_memfd(8192) for _ in range(nfds)]
        send_message(c, msg, fds)
        for fd in fds:
            os.close(fd)
    return script


@pytest.mark.parametrize("script, text, first", [
    (_parts_script(_chunk_msg(), 2), "1 part\\(s\\) carried 2 fd", False),
    (_parts_script(_chunk_msg(parts=[4096, 4096]), 2), "has one part", False),
    (_parts_script(_chunk_msg(mechanism="posix-fd", parts=[4096, 4095]), 2), "adding up to size", False),
    (_parts_script(_chunk_msg(mechanism="posix-fd", parts=[8192, 0]), 2), "positive sizes", False),
    (_parts_script(_chunk_msg(parts=[]), 1), "positive sizes", False),
    (_parts_script(_chunk_msg(parts=None), 1), "'parts' must be a list", False),
    (_block_outside, "outside chunk", False),
    (_reannounced_smaller, "retired since", True),
    (_single_reannounced_smaller, "retired since", True),
    (_single_layout_bad_id, "'layout' = -1 is outside", False),
    (_single_layout_twice, "defined twice", True),
    (_empty_layout, "at least one item", False),
    (_event_on_host, "host chunk", True),
])
def test_hostile_chunk_and_layout_messages(tmp_path: Path, script, text: str, first: bool) -> None:
    addr = str(tmp_path / "h.sock")
    t = hostile(addr, script)
    with connect(addr, timeout=10) as ch:
        if first:  # the batch that defined the layout arrives intact
            for r in ch.recv_many(10):
                assert r.as_array().shape == (512,)
                r.release()
        with pytest.raises(ProtocolError, match=text):
            ch.recv_many(10)
        assert ch.closed
    t.join(10)


@contextlib.contextmanager
def host_pair(tmp_path: Path):
    """(pool, producer channel, consumer channel) over a 64 KiB host pool, in this process."""
    addr = str(tmp_path / "s.sock")
    with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 16) as pool, listen(addr, pool=pool) as listener:
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("ch", connect(addr, timeout=10)))
        t.start()
        with listener.accept(10) as ch:
            t.join()
            try:
                yield pool, ch, got["ch"]
            finally:
                got["ch"].close()


def test_negative_strides_are_copied_c_contiguous(tmp_path: Path) -> None:
    with host_pair(tmp_path) as (pool, prod, cons):
        z = pool.empty(8, "float32")
        z[:] = np.arange(8)
        lease = prod.send(z[::-1])  # negative strides: copied, C-contiguous
        with cons.recv(5) as r:
            assert r.as_array().tolist() == list(range(7, -1, -1))
            assert r.strides == (4,)
        lease.wait(5)


def test_views_dlpack_cannot_describe_are_copied_not_lent(tmp_path: Path) -> None:
    """A view of a pool block whose start or strides are not whole items (a flat byte buffer viewed as
    int32 from byte 2; 6-byte strides) would be refused by the receiver: it is copied instead."""
    with host_pair(tmp_path) as (pool, prod, cons):
        buf = pool.empty(64, "uint8")
        buf[:] = np.arange(64, dtype=np.uint8)
        unaligned = buf[2:10].view(np.int32)
        odd = np.lib.stride_tricks.as_strided(buf[:40].view(np.int32)[:1], shape=(5,), strides=(6,))
        for a in (unaligned, odd):
            lease = prod.send(a)
            with cons.recv(5) as r:
                assert r.as_array().tolist() == a.tolist() and r.strides == (4,)
                assert r.descriptor.block_offset != pool.find(buf.ctypes.data, 64).offset  # another block
            lease.wait(5)
        assert not prod.closed and not cons.closed
