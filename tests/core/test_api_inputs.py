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


@pytest.mark.parametrize("dtype, shape, text", [("float33", None, "'float33' is not a NumPy dtype"),
                                                (object, None, "dtype object cannot view raw memory"),
                                                ("S0", None, "dtype |S0 cannot view raw memory"),
                                                ("int32", (2.0,), "shape extent must be an integer")])
def test_as_array_refuses_what_cannot_view_raw_memory_with_invalid_argument(dtype, shape, text):
    # These raised NumPy's TypeError, its ValueError ("cannot create an OBJECT array from memory buffer")
    # or ZeroDivisionError ("S0": no bytes per element), where InvalidArgumentError is documented.
    with export_memfd(4096) as buf:
        with pytest.raises(errors.InvalidArgumentError, match=text):
            buf.as_array(dtype, shape)
        assert buf.as_array("int32", 5).shape == (5,)  # an int shape is one dimension, as in NumPy
        assert buf.as_array("int32", np.array([2, 3])).shape == (2, 3)
