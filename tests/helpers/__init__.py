"""Helpers shared by the tests: the source tree on PYTHONPATH, GPU presence, the CLI, forks."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

_PROBE = """
from dmabuf_interop import capabilities
problem = capabilities.driver_problem()
print(capabilities.device_count() if problem is None else '0 ' + ' '.join(problem))
"""


def env_with_src() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def nvidia_gpu_present() -> bool:
    """True when the kernel shows an NVIDIA GPU (``/proc/driver/nvidia/gpus`` or ``/dev/nvidia0``),
    whatever Python packages are installed."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


@functools.lru_cache(maxsize=None)
def gpu_count() -> tuple[int, str]:
    """(number of CUDA devices, reason when 0), asked of a child process. The reason starts with
    ``no GPU here:`` or, where the kernel shows an NVIDIA GPU that CUDA cannot use from this Python
    (cuda-bindings missing, driver too old, ``CUDA_VISIBLE_DEVICES``), ``GPU here, but``."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                             env=env_with_src())
        first = (out.stdout.strip() or "0 error " + out.stderr.strip()[-200:]).split(" ", 1)
    except subprocess.TimeoutExpired:
        first = ["0", "error probing for a CUDA driver timed out"]
    n = int(first[0]) if first[0].isdigit() else 0
    if n:
        return n, ""
    code, _, text = (first[1] if len(first) > 1 else "error no CUDA device").partition(" ")
    if nvidia_gpu_present():
        what = "package missing" if code == "no-bindings" else code
        return 0, f"GPU here, but {what}: {text}"
    return 0, f"no GPU here: {text}"


def run_cli(*args: str, timeout: float = 120, extra_env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dmabuf_interop ARGS`` and capture its output."""
    env = env_with_src()
    if extra_env:
        env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "dmabuf_interop", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def fork_child(child) -> int:
    """Fork; the child runs ``child()`` and ``os._exit``s with its int return value
    (1 on an exception, whose traceback goes to stderr). Returns the pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = child()
        except BaseException:  # noqa: BLE001 - a child never returns into pytest
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    return pid
