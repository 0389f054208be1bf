"""Shared test set-up: the ``gpu`` marker skips, with the reason, where no CUDA GPU is usable.

GPU presence is asked of a subprocess (:func:`tests.helpers.gpu_count`), so the
pytest process itself does not initialise CUDA (several CPU tests fork, and
CUDA does not survive fork()). A skip says ``no GPU here`` or ``GPU here, but
package missing`` (or the driver problem). With ``--require-gpu`` or
``DMABUF_INTEROP_REQUIRE_GPU=1`` every such skip is a failure instead, so a GPU
run that tested nothing is not green; a test that needs more GPUs than the machine
has (``gpu(count=2)`` on one GPU) still skips, with that reason.

The ``nixl`` marker does the same for tests of ``tcp://`` channels where NIXL is
not installed; ``--require-nixl`` or ``DMABUF_INTEROP_REQUIRE_NIXL=1`` (CI sets
it) makes such a skip a failure.

The ``ring`` marker does the same for tests of the shared-memory ring where its C extension
(``dmabuf_interop._atomic``) is not built or the kernel lacks the memfd seals it needs;
``--require-ring`` or ``DMABUF_INTEROP_REQUIRE_RING=1`` (CI sets it) makes such a skip a failure.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import gpu_count
from tests.helpers.remote import nixl_missing

_NO_GPU = pytest.StashKey[str]()
_NO_NIXL = pytest.StashKey[str]()
_NO_RING = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--require-gpu", action="store_true",
                     help="fail, instead of skipping, every gpu test that cannot run here "
                          "(also: DMABUF_INTEROP_REQUIRE_GPU=1)")
    parser.addoption("--require-nixl", action="store_true",
                     help="fail, instead of skipping, every nixl test where NIXL is not installed "
                          "(also: DMABUF_INTEROP_REQUIRE_NIXL=1)")
    parser.addoption("--require-ring", action="store_true",
                     help="fail, instead of skipping, every ring test where the shared-memory ring is unavailable "
                          "(also: DMABUF_INTEROP_REQUIRE_RING=1)")


def _required(config: pytest.Config, what: str) -> bool:
    env = f"DMABUF_INTEROP_REQUIRE_{what.upper()}"
    return bool(config.getoption(f"--require-{what}")) or os.environ.get(env, "") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_nixl = nixl_missing()
    for item in (i for i in items if no_nixl and i.get_closest_marker("nixl")):
        if _required(config, "nixl"):
            item.stash[_NO_NIXL] = no_nixl
        else:
            item.add_marker(pytest.mark.skip(reason=no_nixl))
    ring_items = [i for i in items if i.get_closest_marker("ring")]
    if ring_items:
        from dmabuf_interop.channel._ring import ring_unavailable

        no_ring = ring_unavailable()
        for item in ring_items if no_ring else ():
            if _required(config, "ring"):
                item.stash[_NO_RING] = no_ring
            else:
                item.add_marker(pytest.mark.skip(reason=no_ring))
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    n, reason = gpu_count()
    for item in gpu_items:
        marker = item.get_closest_marker("gpu")
        need = marker.kwargs.get("count", 1) if marker else 1
        if n == 0:
            why = reason
        elif n < need:
            # A machine with fewer GPUs than a test needs is not a broken set-up: a skip even with --require-gpu,
            # so the README's GPU command passes on a one-GPU machine (its one-GPU tests still must run).
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, this machine has {n}"))
            continue
        else:
            continue
        if _required(config, "gpu"):
            item.stash[_NO_GPU] = why
        else:
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_runtest_setup(item: pytest.Item) -> None:
    why = item.stash.get(_NO_GPU, None)
    if why is not None:
        pytest.fail(f"GPU required (--require-gpu / DMABUF_INTEROP_REQUIRE_GPU=1) but: {why}", pytrace=False)
    why = item.stash.get(_NO_NIXL, None)
    if why is not None:
        pytest.fail(f"NIXL required (--require-nixl / DMABUF_INTEROP_REQUIRE_NIXL=1) but: {why}", pytrace=False)
    why = item.stash.get(_NO_RING, None)
    if why is not None:
        pytest.fail(f"the shared-memory ring required (--require-ring / DMABUF_INTEROP_REQUIRE_RING=1) but: {why}",
                    pytrace=False)
