"""``dmabuf-interop info``: whether dma-buf sharing works on this machine, and why not.

The report has three parts (the JSON keys are documented in ``docs/info.md``):

* **system** - pure-Python facts gathered in this process with no CUDA: the
  kernel release (``os.uname``), ``/proc/driver/nvidia/version``, the kernel
  config (``/proc/config.gz`` or ``/boot/config-<release>``), ``/dev/udmabuf``,
  ``/dev/dma_heap/*``, the IOMMU mode and the installed package versions;
* **gpus** - per device: name, PCI bus id, compute capability, UUID, the
  capability attributes and the active probes of :mod:`.capabilities`;
* **mechanisms** - dma-buf from host memory, dma-buf from device memory,
  POSIX fd and memfd: usable or not, the one reason that decides it, and the
  cross-GPU pair with its peer access.

Every CUDA call runs in a child process (``python -m dmabuf_interop.cli.info
--worker``) with a timeout. The child prints one JSON object per line as it
goes, so a crash or a hang keeps what was reported before it; the parent turns
the failure into a reason and never prints a traceback.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ..kinds import PROBE_KEYS

__all__ = ["main", "build_report", "system_facts", "gather_cuda", "parse_kernel_config", "read_kernel_config",
           "kernel_at_least", "nvidia_driver", "dev_nodes", "iommu_facts", "CONFIG_OPTIONS", "MECHANISMS"]

SCHEMA_VERSION = 1
#: Kernel options reported (``y``, ``m``, ``no``, another value, or ``unknown`` when no config is readable).
CONFIG_OPTIONS = ("CONFIG_DMA_SHARED_BUFFER", "CONFIG_UDMABUF", "CONFIG_DMABUF_HEAPS", "CONFIG_DMABUF_MOVE_NOTIFY")
#: Mechanism keys, in report order: ``--mechanism`` names, dma-buf split by ``--memory``.
MECHANISMS = ("dmabuf-host", "dmabuf-device", "posix-fd", "memfd")
_PROBE_ORDER = PROBE_KEYS


# --- system facts (this process, no CUDA) ------------------------------------------

def kernel_at_least(release: str, want: tuple[int, int] = (5, 12)) -> bool | None:
    """Whether a ``uname -r`` release such as ``6.18.44-fc`` is at least ``want``; ``None`` if unparsable."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return None if m is None else (int(m.group(1)), int(m.group(2))) >= want


def parse_kernel_config(text: str) -> dict[str, str]:
    """The :data:`CONFIG_OPTIONS` in a kernel ``.config`` text.

    ``CONFIG_X=y`` gives ``"y"`` (or the value), ``# CONFIG_X is not set``
    gives ``"no"``, and an option absent from the config gives ``"no"`` too:
    Kconfig leaves out symbols whose dependencies are off.
    """
    out = {opt: "no" for opt in CONFIG_OPTIONS}
    for line in text.splitlines():
        m = re.match(r"(CONFIG_\w+)=(.*)$", line.strip())
        if m and m.group(1) in out:
            out[m.group(1)] = m.group(2).strip('"')
    return out


def read_kernel_config(paths: Sequence[str | os.PathLike[str]] | None = None,
                       release: str | None = None) -> tuple[str | None, dict[str, str]]:
    """``(source path, options)`` from the first readable of ``/proc/config.gz`` (gzip) and
    ``/boot/config-<release>``; ``(None, all "unknown")`` when none is readable (never ``"no"``)."""
    if paths is None:
        paths = ("/proc/config.gz", f"/boot/config-{release or os.uname().release}")
    for path in paths:
        try:
            raw = Path(path).read_bytes()
            text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode(errors="replace")
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        return str(path), parse_kernel_config(text)
    return None, {opt: "unknown" for opt in CONFIG_OPTIONS}


def nvidia_driver(path: str | os.PathLike[str] = "/proc/driver/nvidia/version") -> tuple[str | None, str]:
    """``(driver version, "open" | "proprietary" | "absent" | "unknown")`` from the first line of
    ``/proc/driver/nvidia/version``; the open module's line says ``Open Kernel Module``;
    ``absent``: the file does not exist (no NVIDIA kernel module loaded); ``unknown``: unreadable."""
    try:
        first = Path(path).read_text(errors="replace").splitlines()[0]
    except FileNotFoundError:
        return None, "absent"
    except (OSError, IndexError):
        return None, "unknown"
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", first)
    return (m.group(1) if m else None), ("open" if "Open Kernel Module" in first else "proprietary")


def dev_nodes(dev: str | os.PathLike[str] = "/dev") -> tuple[bool, list[str]]:
    """``(/dev/udmabuf exists, sorted names in /dev/dma_heap)``."""
    heap_dir = Path(dev) / "dma_heap"
    try:
        heaps = sorted(p.name for p in heap_dir.iterdir())
    except OSError:
        heaps = []
    return (Path(dev) / "udmabuf").exists(), heaps


def iommu_facts(cmdline: str | os.PathLike[str] = "/proc/cmdline",
                class_dir: str | os.PathLike[str] = "/sys/class/iommu",
                groups_dir: str | os.PathLike[str] = "/sys/kernel/iommu_groups") -> dict[str, Any]:
    """The IOMMU mode from the kernel command line (``iommu=``, ``intel_iommu=``,
    ``amd_iommu=``, ``iommu.passthrough=``), ``/sys/class/iommu`` and the default
    domain types in ``/sys/kernel/iommu_groups/*/type`` (``identity`` = passthrough,
    ``DMA``/``DMA-FQ`` = translated; large dma-buf registrations can fail under translation)."""
    try:
        tokens = Path(cmdline).read_text().split()
    except OSError:
        tokens = []
    params = [t for t in tokens if t.split("=", 1)[0] in ("iommu", "intel_iommu", "amd_iommu", "iommu.passthrough")]
    try:
        units = sorted(p.name for p in Path(class_dir).iterdir())
    except OSError:
        units = []
    types: set[str] = set()
    for t in sorted(Path(groups_dir).glob("*/type")) if Path(groups_dir).is_dir() else []:
        try:
            types.add(t.read_text().strip())
        except OSError:
            pass
    values = {t.split("=", 1)[0]: t.split("=", 1)[1] if "=" in t else "" for t in params}
    if types:
        mode = "passthrough" if types == {"identity"} else ("translated" if any(t.startswith("DMA") for t in types)
                                                            else "/".join(sorted(types)))
    elif values.get("iommu") == "pt" or values.get("iommu.passthrough") in ("1", "on", "y"):
        mode = "passthrough"
    elif "off" in (values.get("iommu"), values.get("intel_iommu"), values.get("amd_iommu")) or not units:
        mode = "off"
    else:
        mode = "translated"
    return {"mode": mode, "cmdline": params, "units": units, "group_types": sorted(types)}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def system_facts(release: str | None = None) -> dict[str, Any]:
    """Everything in ``system`` that needs no CUDA (the CUDA versions are filled in from the child)."""
    release = release or os.uname().release
    version, module = nvidia_driver()
    source, config = read_kernel_config(release=release)
    udmabuf, heaps = dev_nodes()
    return {"kernel_release": release, "kernel_at_least_5_12": kernel_at_least(release),
            "nvidia_driver_version": version, "nvidia_kernel_module": module, "cuda_driver_version": None,
            "cuda_bindings_version": _dist_version("cuda-bindings"), "cuda_bindings_built_for": None,
            "cuda_core_version": _dist_version("cuda-core"), "udmabuf": udmabuf, "dma_heaps": heaps,
            "kernel_config_source": source, "kernel_config": config, "iommu": iommu_facts()}


# --- the CUDA child ----------------------------------------------------------------

def _cuda_version(v: int) -> str:
    """13000 -> ``"13.0"`` (``cuDriverGetVersion`` / ``CUDA_VERSION`` encoding)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def _safe(fn: Any, default: Any = "unknown") -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - one fact failing must not end the report
        return default


def _worker() -> int:
    """The child: one JSON line per fact on stdout, cheap and safe ones first, probes last.

    Lines, in order: ``bindings`` (``cuda.bindings.driver.CUDA_VERSION``),
    ``driver`` (:func:`.capabilities.driver_status`, ``cuDriverGetVersion``,
    ``cuDeviceGetCount``), one ``gpu`` per device (``cuDeviceGetName``,
    ``cuDeviceGetPCIBusId``, ``cuDeviceGetUuid``, ``cuDeviceGetAttribute``), one
    ``pair`` per CUDA mechanism (:meth:`.mechanisms.Mechanism.pair`,
    ``cuDeviceCanAccessPeer``), one ``probes`` per device
    (:func:`.mechanisms.probes.probe_device`), then ``done``.
    """
    from .. import capabilities
    from ..mechanisms import get_mechanism
    from ..mechanisms.probes import probe_device

    _emit("bindings", built_for=_safe(lambda: _cuda_version(capabilities.bindings_version()), None))
    problem = capabilities.driver_problem()
    ok = problem is None
    n = capabilities.device_count() if ok else 0
    _emit("driver", ok=ok, reason="" if ok else problem[1], reason_code="" if ok else problem[0], count=n,
          version=_safe(lambda: _cuda_version(capabilities.driver_version()), None) if ok else None)
    for i in range(n):
        facts = _safe(lambda: capabilities.device_facts(i), None)
        attrs = {a: _safe(lambda: capabilities.attribute(i, a), None) for a in capabilities.ATTRIBUTES}
        _emit("gpu", ordinal=i, name=facts.name if facts else "unknown",
              pci_bus_id=facts.pci_bus_id if facts else "unknown",
              compute_capability=facts.compute_capability if facts else "unknown.unknown",
              uuid=facts.uuid if facts else "unknown",
              attributes={a: "unknown" if v is None else v for a, v in attrs.items()})
    for key, name, memory in (("dmabuf-host", "dmabuf", "host"), ("dmabuf-device", "dmabuf", "device"),
                              ("posix-fd", "posix-fd", "host")):
        pair = _safe(lambda: get_mechanism(name, memory).pair(), None) if n > 1 else None
        peer = _safe(lambda: capabilities.can_access_peer(pair[1], pair[0]), None) if pair else None
        _emit("pair", mechanism=key, pair=list(pair) if pair else None, peer_access=peer)
    for i in range(n):
        try:
            got = probe_device(i, (i + 1) % n if n > 1 else None)
        except Exception as exc:  # noqa: BLE001
            _emit("probes", ordinal=i, probes={k: f"unknown ({type(exc).__name__}: {exc})" for k in _PROBE_ORDER[:6]},
                  details={})
            continue
        details = {k: (f"{p.call} -> {p.result}" + (f" ({p.detail})" if p.detail else "")) if p.call else p.detail
                   for k, p in got.items() if p.status != "ok"}
        _emit("probes", ordinal=i, probes={k: str(p) for k, p in got.items()}, details=details)
    _emit("done")
    return 0


def gather_cuda(timeout: float = 60.0, argv: Sequence[str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run the CUDA child (``argv``, default ``python -m dmabuf_interop.info --worker``).

    Returns ``(the JSON lines it printed, "")`` or, when it timed out, was
    killed by a signal or exited non-zero, the lines it managed to print and
    the reason.
    """
    argv = list(argv or [sys.executable, "-m", "dmabuf_interop.cli.info", "--worker"])
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        raw = exc.stdout or ""
        out, rc, err = raw.decode(errors="replace") if isinstance(raw, bytes) else raw, None, ""
    except OSError as exc:
        return [], f"probe child could not start: {exc}"
    lines = []
    for line in out.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    done = any(d.get("kind") == "done" for d in lines)
    if rc is None:
        return lines, f"probe child timed out after {timeout:g} s"
    if rc < 0:
        try:
            return lines, f"probe child killed by {signal.Signals(-rc).name}"
        except ValueError:
            return lines, f"probe child killed by signal {-rc}"
    if rc != 0 or not done:
        last = next((s for s in reversed(err.strip().splitlines()) if s.strip()), "")
        last = last or ("" if rc else "it stopped before reporting everything")
        return lines, f"probe child exited with status {rc}" + (f": {last[:200]}" if last else "")
    return lines, ""


# --- the report --------------------------------------------------------------------

def _no_cuda(cuda: dict[str, Any]) -> tuple[bool | None, str]:
    """Not usable when the driver said so; unknown (``None``) when the probe child
    crashed or timed out before it could say anything."""
    return (False if cuda.get("worker", "ok") == "ok" else None), cuda["reason"]


def _decide(memory: str, cuda: dict[str, Any], gpus: list[dict[str, Any]], system: dict[str, Any],
            ) -> tuple[bool | None, str]:
    """The one deciding reason for dma-buf from ``memory`` (``host``/``device``) memory."""
    if not cuda["available"]:
        return _no_cuda(cuda)
    attr = "HOST_ALLOC_DMA_BUF_SUPPORTED" if memory == "host" else "DMA_BUF_SUPPORTED"
    probe_key, alloc = ("host_dmabuf_export", "cuMemAllocHost") if memory == "host" else \
        ("device_dmabuf_export", "cuMemAlloc")
    if not gpus:
        return None, "no GPU was reported"
    gpu = next((g for g in gpus if g["attributes"].get(attr) == 1), gpus[0])
    value, probe = gpu["attributes"].get(attr, "unknown"), gpu["probes"].get(probe_key, "unknown")
    where = f"GPU {gpu['ordinal']}"
    if probe == "ok":
        imp = gpu["probes"].get("dmabuf_import", "unknown")
        tail = "" if imp == "ok" else f"; CUDA import {imp}: CUDA-to-CUDA sharing needs posix-fd"
        return True, f"{where} exports {alloc} memory as a dma-buf{tail}"
    if system["kernel_at_least_5_12"] is False:
        return False, f"kernel {system['kernel_release']} is older than 5.12, which CUDA dma-buf export needs"
    if system["kernel_config"]["CONFIG_DMA_SHARED_BUFFER"] == "no":
        return False, "the kernel is built without CONFIG_DMA_SHARED_BUFFER"
    if system["nvidia_kernel_module"] == "proprietary" and probe.startswith("unsupported"):
        return False, "the proprietary NVIDIA kernel module is loaded; dma-buf export needs the open kernel module"
    if value == 0:
        return False, f"{where} reports {attr}=0 (export: {probe})"
    if probe.startswith("unsupported"):
        return False, f"{where} reports {attr}={value} but the export call answers {probe}"
    return None, f"{where} reports {attr}={value}; the export could not be tried: {probe}"


def _decide_posix(cuda: dict[str, Any], gpus: list[dict[str, Any]]) -> tuple[bool | None, str]:
    if not cuda["available"]:
        return _no_cuda(cuda)
    if not gpus:
        return None, "no GPU was reported"
    attr = "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
    gpu = next((g for g in gpus if g["attributes"].get(attr) == 1), gpus[0])
    exp, imp = gpu["probes"].get("posix_fd_export", "unknown"), gpu["probes"].get("posix_fd_import", "unknown")
    if exp == "ok" and imp == "ok":
        return True, f"GPU {gpu['ordinal']} exports and imports cuMemCreate memory as a POSIX fd"
    if gpu["attributes"].get(attr) == 0:
        return False, f"GPU {gpu['ordinal']} reports {attr}=0"
    bad = exp if exp != "ok" else imp
    return (False if bad.startswith("unsupported") else None), \
        f"GPU {gpu['ordinal']}: POSIX-fd {'export' if exp != 'ok' else 'import'} {bad}"


def _memfd() -> tuple[bool, str]:
    """One page exported and imported in this process, as the demos do: host shared memory
    needs no GPU (nor ``/proc``)."""
    from ..errors import DmaBufError
    from ..mechanisms.memfd import export_memfd, import_memfd

    try:
        with export_memfd(4096) as exported, import_memfd(exported.fd, 4096):
            pass
    except DmaBufError as exc:
        return False, f"memfd export and import failed: {exc}"
    return True, "memfd_create and mmap work (host shared memory, no GPU involved)"


def build_report(timeout: float = 60.0, worker_argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole report as the JSON-ready dict documented in ``docs/info.md``."""
    system = system_facts()
    lines, failure = gather_cuda(timeout, worker_argv)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in lines:
        by_kind.setdefault(d.get("kind", ""), []).append(d)
    drv = (by_kind.get("driver") or [None])[0]
    system["cuda_bindings_built_for"] = (by_kind.get("bindings") or [{}])[0].get("built_for")
    if drv is None:
        cuda = {"available": False, "reason": failure or "probe child reported nothing", "reason_code": "probe-failed",
                "device_count": 0}
    else:
        system["cuda_driver_version"] = drv.get("version")
        cuda = {"available": bool(drv["ok"]), "reason": drv.get("reason", ""), "reason_code": drv.get("reason_code", ""),
                "device_count": int(drv["count"])}
    cuda["worker"] = failure or "ok"
    missing = f"unknown ({failure})" if failure else "unknown"
    probes = {d["ordinal"]: d["probes"] for d in by_kind.get("probes", [])}
    details = {d["ordinal"]: d.get("details", {}) for d in by_kind.get("probes", [])}
    gpus = []
    for d in by_kind.get("gpu", []):
        g = {k: d[k] for k in ("ordinal", "name", "pci_bus_id", "compute_capability", "uuid", "attributes")}
        keys = _PROBE_ORDER if cuda["device_count"] > 1 else _PROBE_ORDER[:6]
        g["probes"] = {k: probes.get(d["ordinal"], {}).get(k, missing) for k in keys}
        g["probe_details"] = details.get(d["ordinal"], {})
        gpus.append(g)
    pairs = {d["mechanism"]: d for d in by_kind.get("pair", [])}
    mechs: dict[str, dict[str, Any]] = {}
    for key in MECHANISMS:
        if key == "memfd":
            usable, reason = _memfd()
        elif key == "posix-fd":
            usable, reason = _decide_posix(cuda, gpus)
        else:
            usable, reason = _decide(key.split("-")[1], cuda, gpus, system)
        p = pairs.get(key, {})
        mechs[key] = {"usable": usable, "reason": reason, "pair": p.get("pair"), "peer_access": p.get("peer_access")}
    report = {"schema_version": SCHEMA_VERSION, "system": system, "cuda": cuda, "gpus": gpus, "mechanisms": mechs}
    from .info_nixl import nixl_report  # the NIXL section: docs/remote.md

    report["nixl"] = nixl_report(report, timeout)
    return report


def _yn(v: bool | None) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def _pack(label: str, items: list[str], width: int = 110) -> list[str]:
    """``label`` then ``items`` two spaces apart, wrapped between items at ``width``."""
    lines, cur = [], f"  {label:<11}"
    for item in items:
        if len(cur) + 2 + len(item) > width and cur.strip() != label:
            lines.append(cur)
            cur = " " * 13
        cur += ("  " if not cur.endswith(" ") else " ") + item
    return lines + [cur]


def format_report(r: dict[str, Any]) -> str:
    """The one-screen text form of :func:`build_report`'s dict."""
    s, c = r["system"], r["cuda"]
    drv = s["nvidia_driver_version"] or "unknown"
    mod = {"open": "open kernel module", "proprietary": "proprietary kernel module",
           "absent": "/proc/driver/nvidia/version absent"}.get(
        s["nvidia_kernel_module"], "/proc/driver/nvidia/version not readable")
    cfg = " ".join(f"{k[7:]}={v}" for k, v in s["kernel_config"].items())
    io = s["iommu"]
    rows = [("kernel", f"{s['kernel_release']} (>= 5.12: {_yn(s['kernel_at_least_5_12'])})"),
            ("NVIDIA driver", f"{drv} ({mod})"),
            ("CUDA driver", s["cuda_driver_version"] or "unknown"),
            ("cuda-bindings", f"{s['cuda_bindings_version'] or 'not installed'} "
                              f"(built for CUDA {s['cuda_bindings_built_for'] or 'unknown'})"),
            ("cuda-core", s["cuda_core_version"] or "not installed"),
            ("/dev/udmabuf", "present" if s["udmabuf"] else "absent"),
            ("/dev/dma_heap", ", ".join(s["dma_heaps"]) or "absent"),
            ("kernel config", f"{cfg} ({s['kernel_config_source'] or 'no config readable'})"),
            ("IOMMU", f"{io['mode']} (cmdline: {' '.join(io['cmdline']) or 'none'}; "
                      f"/sys/class/iommu: {' '.join(io['units']) or 'empty'})")]
    out = ["System"] + [f"  {k:<15} {v}" for k, v in rows]
    if not c["available"]:
        out.append(f"  {'CUDA':<15} not available: {c['reason']}")
    elif c["worker"] != "ok":
        out.append(f"  {'probe child':<15} {c['worker']}")
    for g in r["gpus"]:
        out += ["", f"GPU {g['ordinal']}: {g['name']}  PCI {g['pci_bus_id']}  CC {g['compute_capability']}  "
                    f"{g['uuid']}"]
        out += _pack("attributes", [f"{k}={v}" for k, v in g["attributes"].items()])
        out += _pack("probes", [f"{k}={v}" for k, v in g["probes"].items()])
    out += ["", "Mechanisms"]
    for key, m in r["mechanisms"].items():
        state = {True: "usable", False: "not usable", None: "unknown"}[m["usable"]]
        # The no-driver reason is printed once, on the CUDA line above.
        reason = "CUDA not available (above)" if not c["available"] and m["reason"] == c["reason"] else m["reason"]
        line = f"  {key:<14} {state:<11} {reason}"
        out.append(line)
        if key != "memfd" and c["available"]:
            pair = m["pair"]
            cross = (f"GPU {pair[0]} -> GPU {pair[1]}, peer access {_yn(m['peer_access'])}" if pair else
                     "no pair" + (" (needs 2 GPUs)" if c["device_count"] < 2 else " satisfies the attributes"))
            out.append(f"  {'':<14} {'':<11} cross-GPU: {cross}")
    return "\n".join(out)


def main(json_output: bool = False, timeout: float = 60.0) -> int:
    """``dmabuf-interop info [--json]``: print the report; 0 unless the report itself cannot be printed."""
    report = build_report(timeout)
    from .info_nixl import format_nixl

    text = format_report(report) + "\n\n" + format_nixl(report["nixl"])
    print(json.dumps(report, indent=2) if json_output else text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        raise SystemExit(_worker())
    raise SystemExit(main("--json" in sys.argv[1:]))
