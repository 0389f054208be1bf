"""The compiled parts, both optional: ``dmabuf_interop._atomic`` (atomics for the channel's shared-memory ring, in C)
and ``dmabuf_interop._driver_hot`` (the driver calls of a hand-off's steady state, in Cython against
``cuda.bindings.cydriver``).

Everything else is in pyproject.toml. Where ``_atomic`` cannot be built (no C compiler, no Python headers, a
big-endian target) the package installs without it, and channels speak the socket protocol alone
(``dmabuf_interop.channel._ring.ring_unavailable()`` says why). Where ``_driver_hot`` cannot be built (no Cython,
no cuda-bindings ``.pxd`` files or no ``cuda.h`` at build time) ``dmabuf_interop._driver`` makes those calls through
``cuda.bindings.driver``, a few microseconds slower each.
"""

import glob
import os
import sys

from setuptools import Extension, setup

_WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
             "-Wno-cast-function-type"]
extensions = [
    Extension("dmabuf_interop._atomic", sources=["src/dmabuf_interop/_atomic.c"],
              extra_compile_args=["-O2", "-std=gnu11", *_WARNINGS], optional=True),
]


def _cuda_include() -> str | None:
    """The folder of ``cuda.h``, which cuda-bindings' ``cydriver.pxd`` includes for the driver's types (the calls go
    through cuda.bindings, nothing links libcuda): ``$CUDA_HOME`` or ``$CUDA_PATH``, the ``nvidia-cuda-runtime`` wheel
    (a build requirement), else a CUDA toolkit in /usr/local."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates = [os.path.join(r, "include") for r in roots if r]
    candidates += [os.path.join(p, "nvidia", "cu13", "include") for p in sys.path if p]
    candidates += ["/usr/local/cuda/include", *sorted(glob.glob("/usr/local/cuda-13*/include"), reverse=True)]
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "cuda.h"))), None)


try:
    from Cython.Build import cythonize

    import cuda.bindings  # noqa: F401 - its cydriver.pxd is what _driver_hot compiles against
except ImportError:
    cythonize = None
include = _cuda_include()
if cythonize is not None and include is not None:
    hot = cythonize(
        [Extension("dmabuf_interop._driver_hot", sources=["src/dmabuf_interop/_driver_hot.pyx"], include_dirs=[include],
                   extra_compile_args=["-O2"], language="c++")],
        compiler_directives={"language_level": 3}, quiet=True)
    for ext in hot:
        ext.optional = True  # set after cythonize, whose Extensions drop it: no C++ compiler must not fail the install
    extensions += hot

setup(ext_modules=extensions)
