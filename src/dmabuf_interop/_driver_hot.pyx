# cython: language_level=3, boundscheck=False, wraparound=False
"""The driver calls of a hand-off's steady state, compiled against ``cuda.bindings.cydriver``.

:mod:`dmabuf_interop._driver` owns the driver calls; it uses these where one exists and it has no observer. Each is
one CUDA driver call (or two) reached through cuda-python's Cython layer, with no Python objects made: the
``cuda.bindings.driver`` wrappers build a handle object, a result enum and a tuple per call and let the GIL go, which
costs a send 3 to 5 us per call in a process woken for it (one H200). Optional: built only where Cython and
cuda-bindings' ``.pxd`` files are there at build time.

A failed call raises :class:`DriverCallFailed` with the call's name and its ``CUresult`` as an int; ``_driver``
turns it into the library's typed error.
"""

from libc.stdint cimport uintptr_t

from cuda.bindings cimport cydriver


class DriverCallFailed(Exception):
    """``args``: the driver call's name and the ``CUresult`` it returned, as an int."""


def make_current(uintptr_t ctx):
    """``cuCtxGetCurrent``, and ``cuCtxSetCurrent(ctx)`` when another context (or none) is current.

    Raises:
        DriverCallFailed: either call failed.
    """
    cdef cydriver.CUcontext cur
    cdef cydriver.CUresult err = cydriver.cuCtxGetCurrent(&cur)
    if err != cydriver.CUDA_SUCCESS:
        raise DriverCallFailed("cuCtxGetCurrent", <int>err)
    if <uintptr_t>cur != ctx:
        err = cydriver.cuCtxSetCurrent(<cydriver.CUcontext>ctx)
        if err != cydriver.CUDA_SUCCESS:
            raise DriverCallFailed("cuCtxSetCurrent", <int>err)


def stream_idle(uintptr_t stream):
    """``cuStreamQuery(stream)``: True when all work queued on it has completed, False while some is pending.

    Raises:
        DriverCallFailed: any other result.
    """
    cdef cydriver.CUresult err = cydriver.cuStreamQuery(<cydriver.CUstream>stream)
    if err == cydriver.CUDA_SUCCESS:
        return True
    if err == cydriver.CUDA_ERROR_NOT_READY:
        return False
    raise DriverCallFailed("cuStreamQuery", <int>err)


def stream_synchronize(uintptr_t stream):
    """``cuStreamSynchronize(stream)``, the GIL released while it waits.

    Raises:
        DriverCallFailed: it failed.
    """
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuStreamSynchronize(<cydriver.CUstream>stream)
    if err != cydriver.CUDA_SUCCESS:
        raise DriverCallFailed("cuStreamSynchronize", <int>err)
