"""Running tcp:// (NIXL) channel peers as subprocesses pinned to loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-shared-secret-0123456789"


def nixl_missing() -> str | None:
    """Why NIXL cannot be used here, or ``None`` (looked up without importing it)."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        if importlib.util.find_spec(name) is not None:
            return None
    return "NIXL is not installed: pip install 'dmabuf-interop[nixl]' (see docs/remote.md)"


def peer_env(tls: str = "tcp", token: str = TOKEN, **extra: str) -> dict[str, str]:
    """The environment of a peer: UCX pinned to ``tls`` on loopback, the token, ``src`` first on the path.

    ``UCX_NET_DEVICES`` filters network transports only; ``cuda_copy`` and ``cuda_ipc`` are not among them.
    """
    env = dict(os.environ)
    path = [str(ROOT / "src"), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(UCX_TLS=tls, UCX_NET_DEVICES="lo", DMABUF_INTEROP_TOKEN=token, NIXL_LOG_LEVEL="WARN",
               PYTHONPATH=os.pathsep.join(path))  # the caller's entries too: NIXL may be installed there
    env.update(extra)
    return env


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.remote_peer", *args], cwd=ROOT,
                            env=env or peer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_producer(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a producer mode on a free loopback port; returns the process and its ``tcp://`` address."""
    p = start(args[0], "tcp://127.0.0.1:0", *args[1:], env=env)
    line = p.stdout.readline()
    if not line.startswith("listening "):
        p.kill()
        out, err = p.communicate(timeout=30)
        raise AssertionError(f"producer did not start: {line}{out}{err}")
    return p, line.split()[1]


def result(p: subprocess.Popen, timeout: float = 120) -> dict[str, Any]:
    """The last JSON object a peer printed at the start of a line (it must exit 0). Text after it on
    the same line is ignored: UCX's own log lines, written from NIXL's threads, can land there."""
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"peer exited {p.returncode}: {out}\n{err[-4000:]}"
    line = [line for line in out.splitlines() if line.startswith("{")][-1]
    return json.JSONDecoder().raw_decode(line)[0]
