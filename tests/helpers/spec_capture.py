"""Every channel message this process encodes or decodes, recorded as it passes the framing layer.

``captured()`` wraps the framing's encoder and decoder (the real ones run; nothing is faked), so a test
can run real handshakes and channels and then check each message against the spec's schemas.

    python -m tests.helpers.spec_capture remote    a tcp:// (NIXL) listener and connector in this process,
                                                  a host pool, one batch; prints the messages as JSON lines
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import threading
from typing import Any, Iterator

from dmabuf_interop import fdpass
from dmabuf_interop.channel import _lending as lending_module
from dmabuf_interop.channel import _releases as releases_module
from dmabuf_interop.channel import wire


@contextlib.contextmanager
def captured() -> Iterator[list[dict[str, Any]]]:
    """The messages framed or unframed while the block runs (each once per side that handled it)."""
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()
    encode, decode = fdpass.encode_message, fdpass.decode_message

    def encode_spy(obj: dict[str, Any], *args: Any, **kwargs: Any) -> bytes:
        data = encode(obj, *args, **kwargs)
        with lock:
            seen.append(json.loads(data[4:]))  # as it goes on the wire
        return data

    def decode_spy(frame: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        obj = decode(frame, *args, **kwargs)
        with lock:
            seen.append(copy.deepcopy(obj))
        return obj

    def template_spy(encode: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> bytes:
            data = encode(*args, **kwargs)
            with lock:
                seen.append(json.loads(data[4:]))
            return data
        return spy

    # The places the framing looks the functions up: fdpass itself, wire's TCP path, and the modules that
    # frame their messages from wire's templates (whose fallback is wire's encoder: such a message may be
    # seen twice).
    targets = [(fdpass, "encode_message", encode_spy), (wire, "encode_message", encode_spy),
               (fdpass, "decode_message", decode_spy),
               (lending_module, "encode_repeat", template_spy(wire.encode_repeat)),
               (releases_module, "encode_release", template_spy(wire.encode_release))]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    for mod, name, fn in targets:
        setattr(mod, name, fn)
    try:
        yield seen
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _remote() -> None:
    import numpy as np

    from dmabuf_interop.channel import SharedPool, connect, listen

    token = "spec-capture-shared-secret-0123456789"
    with captured() as seen, SharedPool(chunk_bytes=1 << 20, max_bytes=1 << 20) as pool:
        with listen("tcp://127.0.0.1:0", pool=pool, token=token) as listener:
            got: dict[str, Any] = {}

            def consumer() -> None:
                with connect(listener.address, timeout=30, token=token) as ch:
                    batch = ch.recv_many(30)
                    got["sum"] = float(sum(r.as_array().sum() for r in batch.values()))
                    for r in batch.values():
                        r.release()
                    got["one"] = ch.recv(30).as_array().tolist()

            t = threading.Thread(target=consumer)
            t.start()
            with listener.accept(30) as ch:
                a = pool.empty(16, "float32")
                a[:] = 1.0
                ch.send_many({"a": a, "b": np.arange(4, dtype=np.int64)}).wait(30)
                ch.send(np.arange(3, dtype=np.int16))
                t.join(30)
    assert got == {"sum": 22.0, "one": [0, 1, 2]}, got
    for msg in seen:
        print(json.dumps(msg))


if __name__ == "__main__":
    if sys.argv[1:] != ["remote"]:
        sys.exit(__doc__)
    _remote()
