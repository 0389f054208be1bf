"""What a new user's hands give the API: peer metadata, integer-like sizes, shapes, closed buffers."""

from __future__ import annotations

import numpy as np
import pytest

from dmabuf_interop import errors, export_memfd, import_shared


def test_peer_metadata_missing_a_field_is_protocol_error_naming_it():
    with pytest.raises(errors.ProtocolError, match="'memory'"):
        import_shared(0, {"mechanism": "memfd"})
    with pytest.raises(errors.ProtocolError, match="'size' is missing"):
        import_shared(0, {"mechanism": "memfd", "memory": "memfd"})


def test_integer_like_sizes_shapes_and_closed_buffers():
    buf = export_memfd(np.int64(4096))
    assert buf.size == 4096
    with pytest.raises(errors.InvalidArgumentError, match="negative extent"):
        buf.as_array(shape=(-1, 1024))
    buf.close()
    for use in (lambda: buf.ptr, lambda: buf.fd, lambda: buf.as_array(), lambda: buf.__enter__()):
        with pytest.raises(errors.InvalidArgumentError, match="is closed"):
            use()
