"""The typed share descriptor, the error tree across process boundaries, Transaction, the name registry."""

from __future__ import annotations

import concurrent.futures
import errno
import multiprocessing
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmabuf_interop import errors
from dmabuf_interop.buffers import Transaction
from dmabuf_interop.descriptor import ShareDescriptor
from dmabuf_interop.kinds import MECHANISM_NAMES, MEMORY_KINDS, MechanismName
from dmabuf_interop.mechanisms import NEEDS, get_mechanism, import_shared
from dmabuf_interop.mechanisms.memfd import export_memfd

UUID = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"
GOOD = {"mechanism": "posix-fd", "memory": "vmm", "size": 4096, "offset": 0, "export_size": 2 << 20,
        "exporter_device": 1, "device_uuid": UUID, "fallback": None}


def test_descriptor_round_trips_through_json():
    desc = ShareDescriptor.from_json(GOOD)
    assert desc.to_json() == GOOD
    assert ShareDescriptor.from_json(desc.to_json()) == desc


@pytest.mark.parametrize("field,value,words", [
    ("size", "4096", "'size' must be an integer"),
    ("size", 4096.0, "'size' must be an integer"),
    ("size", True, "'size' must be an integer"),
    ("size", 0, "'size' must be > 0"),
    ("offset", -1, "'offset' must be >= 0"),
    ("offset", 2 << 20, "exceed 'export_size'"),
    ("mechanism", "pickle", "'mechanism'"),
    ("memory", 7, "'memory'"),
    ("device_uuid", "GPU-1", "'device_uuid'"),
    ("device_uuid", "", "'device_uuid' is empty"),
    ("fallback", 3, "'fallback'"),
    ("exporter_device", -2, "'exporter_device'"),
])
def test_descriptor_names_the_bad_field(field, value, words):
    with pytest.raises(errors.ProtocolError, match=words):
        ShareDescriptor.from_json({**GOOD, field: value})


@pytest.mark.parametrize("missing", ["size", "offset", "export_size", "mechanism"])
def test_descriptor_missing_field(missing):
    bad = dict(GOOD)
    del bad[missing]
    with pytest.raises(errors.ProtocolError, match=repr(missing)):
        ShareDescriptor.from_json(bad)


def test_import_shared_with_a_partial_dict_is_a_protocol_error_not_key_error():
    with export_memfd(4096) as exp:
        with pytest.raises(errors.ProtocolError, match="'size'"):
            import_shared(exp.fd, {"mechanism": "memfd", "memory": "memfd"})
        with import_shared(exp.fd, exp.describe().to_json()) as imp:
            assert imp.size == 4096


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(GOOD) + ["other"]), _json, max_size=9))
def test_descriptor_fuzz_accepts_only_valid(obj):
    """Any JSON object either validates into a descriptor that satisfies every rule, or is a ProtocolError."""
    try:
        desc = ShareDescriptor.from_json(obj)
    except errors.ProtocolError:
        return
    assert desc.mechanism in MECHANISM_NAMES and desc.memory in MEMORY_KINDS
    assert all(type(v) is int for v in (desc.size, desc.offset, desc.export_size, desc.exporter_device))
    assert desc.size > 0 and desc.offset >= 0 and desc.offset + desc.size <= desc.export_size


ERRORS = [
    errors.DmaBufError("plain"),
    errors.NotSupportedError("no peer access"),
    errors.CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", 2, "64 GiB"),
    errors.CudaNotSupportedError("cuImportExternalMemory", "CUDA_ERROR_NOT_SUPPORTED", 801),
    errors.NoDriverError("cuInit", "CUDA_ERROR_NO_DEVICE", 100, "", reason="no-device"),
    errors.ForkedAfterInitError("cuCtxGetCurrent", "CUDA_ERROR_NOT_INITIALIZED", 3, "forked"),
    errors.InvalidArgumentError("size must be > 0 bytes, got 0"),
    errors.NotADmaBufError("fd 3 is not a dma-buf"),
    errors.AlignmentError("misaligned"),
    errors.SyscallError("mmap", OSError(errno.EPERM, "Operation not permitted")),
    errors.SyscallError("mmap", OverflowError("length too large")),
    errors.SyscallError("memfd_create", errno.EMFILE),
    errors.SyscallError("bind", OSError(errno.ENOENT, "No such file or directory"), "/run/user/1000/w.sock"),
    errors.FdPassError("x"),
    errors.PeerClosedError("peer closed"),
    errors.ProtocolError("bad frame"),
    errors.FdLimitError("dropped"),
    errors.WaitTimeoutError("timed out"),
    errors.ForkedResourceError("this channel", 4242),
    errors.ClosedError("this end closed the channel"),
]


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b) and str(a) == str(b)
    for attr in ("call", "result", "code", "detail", "reason", "errno", "strerror", "filename", "owner_pid"):
        assert getattr(a, attr, None) == getattr(b, attr, None), attr


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_class_message_and_attributes(err):
    _same(err, pickle.loads(pickle.dumps(err)))


def _raise(i: int) -> None:
    raise ERRORS[i]


def test_errors_cross_a_process_pool():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        for i, err in enumerate(ERRORS):
            with pytest.raises(type(err)) as info:
                pool.submit(_raise, i).result(timeout=120)
            _same(err, info.value)


def test_error_tree_callers_branch_on():
    refusal = errors.CudaNotSupportedError("cuImportExternalMemory", "CUDA_ERROR_NOT_SUPPORTED")
    assert isinstance(refusal, errors.CudaError) and isinstance(refusal, errors.NotSupportedError)
    assert not isinstance(errors.NotSupportedError("x"), errors.CudaError)
    assert isinstance(errors.WaitTimeoutError("t"), TimeoutError)  # the builtin, not shadowed
    assert not hasattr(errors, "TimeoutError")
    assert isinstance(errors.SyscallError("x", 5), OSError)


def test_transaction_undoes_in_reverse_and_reraises_the_original():
    done: list[str] = []
    with pytest.raises(KeyError):
        with Transaction() as tx:
            tx.push(done.append, "first")
            tx.push(lambda: (_ for _ in ()).throw(RuntimeError("undo fails")))  # dropped
            tx.push(done.append, "last")
            raise KeyError("step failed")
    assert done == ["last", "first"]


def test_transaction_commit_hands_over_the_undos():
    done: list[str] = []
    with Transaction() as tx:
        tx.push(done.append, "a")
        undo = tx.commit()
    assert done == [] and len(undo) == 1
    undo[0]()
    assert done == ["a"]


def test_one_registry_names_every_mechanism():
    assert set(NEEDS) == set(MECHANISM_NAMES)
    for name in MechanismName:
        assert get_mechanism(name).name == name
    with pytest.raises(errors.InvalidArgumentError, match="choose from dmabuf, posix-fd, memfd"):
        get_mechanism("cuda-ipc")


def test_a_closed_buffer_refuses_every_use():
    exp = export_memfd(4096)
    imp = import_shared(exp.fd, exp.describe())
    for buf in (imp, exp):
        buf.close()
        buf.close()  # idempotent
        for use in (lambda: buf.ptr, lambda: buf.as_array(), lambda: buf.__enter__()):
            with pytest.raises(errors.InvalidArgumentError, match="closed"):
                use()
    with pytest.raises(errors.InvalidArgumentError, match="closed"):
        exp.fd  # noqa: B018


def test_host_buffers_own_their_mapping_and_view_it():
    with export_memfd(4096) as exp, import_shared(exp.fd, exp.describe()) as imp:
        exp.as_array("int32")[:] = 7
        assert int(imp.as_array("int32", (4, 256))[3, 255]) == 7
        with pytest.raises(errors.InvalidArgumentError, match="negative extent"):
            imp.as_array("int32", (-1, 1024))
        with pytest.raises(errors.InvalidArgumentError, match="needs 8192 bytes"):
            imp.as_array("int32", (2048,))
