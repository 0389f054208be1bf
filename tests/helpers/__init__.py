"""Helpers shared by the tests: the source tree on PYTHONPATH, GPU presence, the CLI, forks."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")

_PROBE = """
import sys
from dmabuf_interop import capabilities
ok, reason = capabilities.driver_status()
if ok:
    print(capabilities.device_count())
else:
    print('0 ' + reason)
"""


def env_with_src() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@functools.lru_cache(maxsize=None)
def gpu_count() -> tuple[int, str]:
    """(number of CUDA devices, reason when 0), asked of a child process."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                             env=env_with_src())
    except subprocess.TimeoutExpired:
        return 0, "probing for a CUDA driver timed out"
    first = (out.stdout.strip() or "0 " + out.stderr.strip()[-200:]).split(" ", 1)
    n = int(first[0]) if first[0].isdigit() else 0
    return n, (first[1] if len(first) > 1 else "no CUDA device")


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
