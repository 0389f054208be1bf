"""Shared test set-up: the ``gpu`` marker skips, with the reason, where no CUDA GPU is present.

GPU presence is asked of a subprocess (:func:`tests.helpers.gpu_count`), so the
pytest process itself does not initialise CUDA (several CPU tests fork, and
CUDA does not survive fork()).
"""

from __future__ import annotations

import pytest

from tests.helpers import gpu_count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu_items:
        return
    n, reason = gpu_count()
    for item in gpu_items:
        marker = item.get_closest_marker("gpu")
        need = marker.kwargs.get("count", 1) if marker else 1
        if n == 0:
            item.add_marker(pytest.mark.skip(reason=f"no GPU: {reason}"))
        elif n < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, this machine has {n}"))
