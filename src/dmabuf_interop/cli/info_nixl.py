"""The NIXL section of ``dmabuf-interop info``: transfer engine, UCX transports, RDMA devices.

Every NIXL call runs in a child (``python -m dmabuf_interop.cli.info_nixl --worker``)
with a timeout and ``UCX_PROTO_INFO=y``: the child creates two agents, reads
1 MiB of host memory from one to the other (and of device memory where a GPU
is present, after registering it as ``"VRAM"``), and UCX's protocol tables on
its standard output say which transports a ``READ`` used. The RDMA part reads
``/sys/class/infiniband`` and needs no NIXL.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["nixl_report", "format_nixl", "rdma_devices", "rdma_core_version"]

_DISTS = ("nixl-cu13", "nixl-cu12", "nixl")


def rdma_devices(root: str = "/sys/class/infiniband") -> list[dict[str, Any]]:
    """RDMA devices: ``[{"name", "ports": [{"port", "state", "link_layer"}]}]`` from ``/sys/class/infiniband``."""
    out = []
    for dev in sorted(Path(root).glob("*")) if os.path.isdir(root) else []:
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            def read(name: str) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return "unknown"
            ports.append({"port": port.name, "state": read("state"), "link_layer": read("link_layer")})
        out.append({"name": dev.name, "ports": ports})
    return out


def rdma_core_version() -> str | None:
    """rdma-core's version from the installed ``libibverbs.so.1.<abi>.<rdma-core>.0`` file name, or ``None``."""
    for pattern in ("/usr/lib*/libibverbs.so.1.*", "/usr/lib/*/libibverbs.so.1.*", "/lib/*/libibverbs.so.1.*"):
        for path in sorted(glob.glob(pattern)):
            parts = os.path.basename(path).split(".")
            if len(parts) >= 5 and parts[4].isdigit():
                return parts[4] + (f".{parts[5]}" if len(parts) > 6 and parts[5].isdigit() else "")
    return None


def _worker(probe_vram: bool) -> int:
    """Child: one JSON line of facts; UCX's protocol tables go to stdout around it."""
    facts: dict[str, Any] = {}
    try:
        from ..channel.remote import nixl_module

        nixl = nixl_module()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(json.dumps({"error": str(exc)}), flush=True)
        return 0
    import numpy as np

    a = nixl.nixl_agent("dmabuf-interop-info-a", nixl.nixl_agent_config(backends=["UCX"]))
    b = nixl.nixl_agent("dmabuf-interop-info-b", nixl.nixl_agent_config(backends=["UCX"]))
    facts["plugins"] = list(a.plugin_list)
    facts["ucx_mem_types"] = list(a.get_backend_mem_types("UCX")) if "UCX" in a.backends else []

    def read(src: tuple[int, int, int], dst: tuple[int, int, int], mem: str) -> str:
        ra = a.register_memory([(*src, "")], mem)
        rb = b.register_memory([(*dst, "")], mem)
        try:
            b.add_remote_agent(a.get_agent_metadata())
            h = b.initialize_xfer("READ", b.get_xfer_descs([dst], mem), b.get_xfer_descs([src], mem), a.name)
            state = b.transfer(h)
            for _ in range(2_000_000):
                if state != "PROC":
                    break
                state = b.check_xfer_state(h)
            h.release()
            return "ok" if state == "DONE" else f"READ state {state}"
        finally:
            b.deregister_memory(rb)
            a.deregister_memory(ra)

    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    try:
        facts["host_read"] = read((src.ctypes.data, src.nbytes, 0), (dst.ctypes.data, dst.nbytes, 0), "DRAM")
    except Exception as exc:  # noqa: BLE001
        facts["host_read"] = f"{type(exc).__name__}: {exc}"
    if not probe_vram:  # why CUDA is unavailable is the CUDA line's to say, once
        facts["vram_register"] = "not tried: CUDA not available"
        print(json.dumps(facts), flush=True)
        return 0
    try:
        from ..channel.pool import SharedPool

        with SharedPool(0, chunk_bytes=4 << 20, max_bytes=4 << 20) as pool:
            s, d = pool.alloc(1 << 20), pool.alloc(1 << 20)
            facts["vram_register"] = read((s.ptr, s.size, 0), (d.ptr, d.size, 0), "VRAM")
    except Exception as exc:  # noqa: BLE001 - no GPU, no VRAM support: the reason is the report
        facts["vram_register"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(facts), flush=True)
    return 0


def nixl_report(report: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """The ``nixl`` section: ``installed``, ``version``, ``plugins``, ``ucx_mem_types``, ``host_read``,
    ``vram_register``, ``read_transports`` (UCX's, as ``UCX_PROTO_INFO`` shows them), ``ucx_env``, ``rdma``.

    ``report`` (from :func:`.info.build_report`) supplies the GPUs' ``DMA_BUF_SUPPORTED`` and the
    kernel module kind for the dma-buf-to-NIC verdict.
    """
    version = None
    for dist in _DISTS:
        try:
            version = f"{dist} {importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    out: dict[str, Any] = {"installed": version is not None, "version": version, "error": None, "plugins": [],
                           "ucx_mem_types": [], "host_read": None, "vram_register": None, "read_transports": [],
                           "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    if version is not None:
        env = dict(os.environ, UCX_PROTO_INFO="y", NIXL_LOG_LEVEL="WARN")
        try:
            probe_vram = (report or {}).get("cuda", {}).get("available", True)
            cmd = [sys.executable, "-m", "dmabuf_interop.cli.info_nixl", "--worker"]
            cmd += [] if probe_vram else ["--no-vram"]
            p = subprocess.run(cmd, env=env,
                               capture_output=True, text=True, timeout=timeout)
            lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            out.update(lines[-1] if lines else {"error": f"worker exited {p.returncode}: {p.stderr[-300:]}"})
            from ..channel.remote import ucx_read_transports

            out["read_transports"] = ucx_read_transports(p.stdout)
        except subprocess.TimeoutExpired:
            out["error"] = f"worker did not finish within {timeout} s"
    gpus = (report or {}).get("gpus", [])
    module = (report or {}).get("system", {}).get("nvidia_kernel_module", "unknown")
    dmabuf = any(g.get("attributes", {}).get("DMA_BUF_SUPPORTED") == 1 for g in gpus)
    devices = rdma_devices()
    if not devices:
        verdict = "no RDMA device in /sys/class/infiniband"
    elif not dmabuf:
        verdict = "no GPU reports DMA_BUF_SUPPORTED"
    elif module != "open":
        verdict = f"the {module} kernel module: GPU dma-buf to a NIC needs the open kernel module"
    else:
        verdict = "yes: export_device fd -> ibv_reg_dmabuf_mr (docs/remote.md)"
    out["rdma"] = {"devices": devices, "rdma_core": rdma_core_version(), "gpu_dmabuf_to_nic": verdict}
    return out


def format_nixl(n: dict[str, Any]) -> str:
    """The text form of :func:`nixl_report`."""
    lines = ["NIXL (tcp:// channels)"]
    if not n["installed"]:
        lines.append("  not installed: pip install 'dmabuf-interop[nixl]' (docs/remote.md)")
    elif n["error"]:
        lines.append(f"  {n['version']}: {n['error']}")
    else:
        lines.append(f"  {n['version']}; plugins: {', '.join(n.get('plugins', []))}")
        lines.append(f"  UCX memory types: {', '.join(n.get('ucx_mem_types', []))}; host READ: {n.get('host_read')}; "
                     f"VRAM register+READ: {n.get('vram_register')}")
        env = " ".join(f"{k}={v}" for k, v in n["ucx_env"].items()) or "no UCX_* set"
        lines.append(f"  READ transports here ({env}): {', '.join(n.get('read_transports', [])) or 'none shown'}")
    r = n["rdma"]
    devs = ", ".join(f"{d['name']} ({'/'.join(p['state'] + ' ' + p['link_layer'] for p in d['ports'])})"
                     for d in r["devices"]) or "none"
    lines.append(f"  RDMA devices: {devs}; rdma-core {r['rdma_core'] or 'not found'}")
    lines.append(f"  GPU memory to a NIC through dma-buf: {r['gpu_dmabuf_to_nic']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(_worker("--no-vram" not in sys.argv[2:]))
    print(format_nixl(nixl_report()))
