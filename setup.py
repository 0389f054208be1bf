"""The one compiled part: ``dmabuf_interop._atomic`` (atomics for the channel's shared-memory ring).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built (no C compiler,
no Python headers, a big-endian target) the package installs without it, and channels speak the socket
protocol alone (``dmabuf_interop.channel._ring.ring_unavailable()`` says why).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dmabuf_interop._atomic",
            sources=["src/dmabuf_interop/_atomic.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
