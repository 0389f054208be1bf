"""The environment a benchmark ran in: host, GPUs, driver, package versions, source commit."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["environment", "installed"]


def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cupy_version() -> str | None:
    from importlib import metadata

    if importlib.util.find_spec("cupy") is None:
        return None
    for dist in metadata.packages_distributions().get("cupy", []):
        try:
            return f"{metadata.version(dist)} ({dist})"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False

def environment() -> dict[str, Any]:
    """Host, GPUs, driver and package versions (asks the driver; creates no CUDA context)."""
    from ... import _driver as driver, capabilities

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "clock": f"time.monotonic_ns ({time.get_clock_info('monotonic').implementation})",
        "packages": {
            "dmabuf-interop": _dist_version("dmabuf-interop") or _package_version(),
            "cuda-bindings": _dist_version("cuda-bindings", "cuda-python"),
            "cuda-core": _dist_version("cuda-core", "cuda_core"),
            "numpy": _dist_version("numpy"),
            "torch": _dist_version("torch") if installed("torch") else None,
            "cupy": _cupy_version(),
            "matplotlib": _dist_version("matplotlib") if installed("matplotlib") else None,
            "iceoryx2": _dist_version("iceoryx2") if installed("iceoryx2") else None,
        },
        "cpus": len(os.sched_getaffinity(0)),  # the CPUs this process may run on (spinning consumers need one each)
    }
    try:
        with open("/proc/cpuinfo") as fh:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
    except OSError:
        env["cpu"] = None
    try:
        with open("/proc/driver/nvidia/version") as fh:
            env["nvidia_driver"] = fh.readline().strip()
    except OSError:
        env["nvidia_driver"] = None
    env["source"] = _git_revision()
    env["channel_ring"] = _ring()
    ok, reason = capabilities.driver_status()
    env["cuda"] = {"available": ok, "reason": reason or None}
    if ok:
        env["cuda"]["driver_api_version"] = driver.driver_version()
        env["gpus"] = [{"ordinal": i, "name": driver.device_name(i), "pci_bus_id": driver.device_pci_bus_id(i)}
                       for i in range(driver.device_count())]
    else:
        env["gpus"] = []
    return env


def _ring() -> dict[str, Any]:
    """Whether this interpreter can offer the channel's shared-memory ring, and why not (the same package
    runs the benchmark's children)."""
    from ...channel._ring import ring_unavailable

    why = ring_unavailable()
    return {"available": why is None, "reason": why}


def _git_revision() -> dict[str, Any] | None:
    """The commit of the source tree this ran from, and whether the package had local changes; None
    outside git, or when this file is not tracked there (a copy of the package in some other folder)."""
    here = Path(__file__).resolve()
    package = here.parents[2]  # .../dmabuf_interop
    git = ["git", "-C", str(package.parent)]
    try:
        tracked = subprocess.run([*git, "ls-files", "--error-unmatch", "--", str(here)], capture_output=True,
                                 text=True, timeout=10)
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", str(package)], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if tracked.returncode != 0 or head.returncode != 0 or dirty.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "src_modified": bool(dirty.stdout.strip())}


def _package_version() -> str:
    from ... import __version__

    return f"{__version__} (source tree)"
