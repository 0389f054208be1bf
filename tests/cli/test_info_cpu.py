"""CPU tests of ``dmabuf-interop info``: the real command, the documented JSON keys, the parsers.

The command runs as a real subprocess (on a GPU-less machine its CUDA child
reports the missing driver). The system-fact parsers read real files written
to ``tmp_path``. The parent's handling of a crashing or hanging child is tested
with real child processes that crash or hang.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

import pytest

from dmabuf_interop.cli import info
from tests.helpers import gpu_count, run_cli
from tests.helpers.info_doc import DOC, PROBE_RE, check_documented

@pytest.fixture(scope="module")
def report() -> dict:
    out = run_cli("info", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    return json.loads(out.stdout)


def test_json_has_every_documented_key_with_its_type(report: dict) -> None:
    check_documented(report)
    assert set(report["mechanisms"]) == set(info.MECHANISMS)
    assert report["schema_version"] == info.SCHEMA_VERSION


def test_json_without_a_gpu_gives_the_reason(report: dict) -> None:
    n, _ = gpu_count()
    if n:
        pytest.skip(f"this machine has {n} GPU(s); the no-driver report is tested where none is present")
    cuda = report["cuda"]
    assert cuda["available"] is False and cuda["device_count"] == 0 and report["gpus"] == []
    assert cuda["reason_code"] == "no-driver" and cuda["reason"].startswith("no NVIDIA driver"), cuda

    assert cuda["worker"] == "ok"
    for key in ("dmabuf-host", "dmabuf-device", "posix-fd"):
        m = report["mechanisms"][key]
        assert m["usable"] is False and m["reason"] == cuda["reason"] and m["pair"] is None
    assert report["mechanisms"]["memfd"]["usable"] is True
    assert report["system"]["cuda_bindings_built_for"] and re.match(r"^\d+\.\d+$",
                                                                   report["system"]["cuda_bindings_built_for"])


def test_text_report_exits_0_with_reason(report: dict) -> None:
    out = run_cli("info")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stdout.startswith("System\n") and "\nMechanisms\n" in out.stdout
    assert len(out.stdout.splitlines()) <= 60
    if not report["cuda"]["available"]:
        assert f"not available: {report['cuda']['reason']}" in out.stdout
        assert out.stdout.count(report["cuda"]["reason"]) == 1, "the no-driver reason is said once"
    if report["system"]["nvidia_kernel_module"] == "absent":
        assert "/proc/driver/nvidia/version absent" in out.stdout
    for key in info.MECHANISMS:
        assert re.search(rf"^  {re.escape(key)}\s+(usable|not usable|unknown)\s", out.stdout, re.M)


# --- crashing and hanging children (real processes) --------------------------------

_DRIVER_LINE = json.dumps({"kind": "driver", "ok": True, "reason": "", "count": 1, "version": "13.0"})
_GPU_LINE = json.dumps({"kind": "gpu", "ordinal": 0, "name": "X", "pci_bus_id": "0000:01:00.0",
                        "compute_capability": "9.0", "uuid": "GPU-0",
                        "attributes": {"DMA_BUF_SUPPORTED": 1, "HOST_ALLOC_DMA_BUF_SUPPORTED": "unknown"}})
_PROBES_LINE = json.dumps({"kind": "probes", "ordinal": 0, "probes": {"host_dmabuf_export": "ok",
                           "dmabuf_import": "unsupported (CUDA_ERROR_NOT_SUPPORTED)"},
                           "details": {"dmabuf_import": "cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED"}})


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", f"print({_DRIVER_LINE!r}, flush=True); print({_GPU_LINE!r}, flush=True); {code}"]


def test_crashing_child_becomes_a_reason() -> None:
    r = info.build_report(timeout=30, worker_argv=_child("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert r["cuda"]["worker"] == "probe child killed by SIGSEGV"
    assert r["cuda"]["available"] is True and r["system"]["cuda_driver_version"] == "13.0"
    probes = r["gpus"][0]["probes"]
    assert set(probes) == set(info._PROBE_ORDER[:6])
    assert all(v == "unknown (probe child killed by SIGSEGV)" for v in probes.values())
    m = r["mechanisms"]["dmabuf-device"]
    assert m["usable"] is None and "could not be tried" in m["reason"]
    assert "probe child killed by SIGSEGV" in info.format_report(r)
    check_documented(r)


def test_hanging_child_times_out_and_keeps_what_it_said() -> None:
    r = info.build_report(timeout=3, worker_argv=_child("import time; time.sleep(60)"))
    assert r["cuda"]["worker"] == "probe child timed out after 3 s"
    assert r["gpus"][0]["name"] == "X"
    json.dumps(r)


def test_child_that_stops_after_the_probes_line() -> None:
    r = info.build_report(timeout=30, worker_argv=_child(f"print({_PROBES_LINE!r})"))
    assert r["cuda"]["worker"] == "probe child exited with status 0: it stopped before reporting everything"
    g = r["gpus"][0]
    assert g["probes"]["host_dmabuf_export"] == "ok" and g["probes"]["posix_fd_export"].startswith("unknown (")
    assert g["probe_details"] == {"dmabuf_import": "cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED"}
    host = r["mechanisms"]["dmabuf-host"]  # the attribute is unknown: the working export decides
    assert host["usable"] is True and "CUDA import unsupported (CUDA_ERROR_NOT_SUPPORTED)" in host["reason"]
    check_documented(r)


def test_child_that_says_nothing() -> None:
    r = info.build_report(timeout=30, worker_argv=[sys.executable, "-c", "import sys; sys.exit('boom')"])
    assert r["cuda"] == {"available": False, "reason": "probe child exited with status 1: boom", "reason_code": "probe-failed",
                         "device_count": 0, "worker": "probe child exited with status 1: boom"}
    assert r["mechanisms"]["posix-fd"]["reason"] == r["cuda"]["reason"]


# --- system-fact parsers on real files ---------------------------------------------

CONFIG = """\
#
# Automatically generated file; DO NOT EDIT.
CONFIG_DMA_SHARED_BUFFER=y
CONFIG_UDMABUF=m
# CONFIG_DMABUF_MOVE_NOTIFY is not set
CONFIG_OTHER="x"
"""


def test_kernel_config_gzip(tmp_path: Path) -> None:
    p = tmp_path / "config.gz"
    p.write_bytes(gzip.compress(CONFIG.encode()))
    src, cfg = info.read_kernel_config([p, tmp_path / "never-read"])
    assert src == str(p)
    assert cfg == {"CONFIG_DMA_SHARED_BUFFER": "y", "CONFIG_UDMABUF": "m", "CONFIG_DMABUF_HEAPS": "no",
                   "CONFIG_DMABUF_MOVE_NOTIFY": "no"}


def test_kernel_config_plain_after_missing_and_corrupt(tmp_path: Path) -> None:
    bad = tmp_path / "config.gz"
    bad.write_bytes(b"\x1f\x8b" + b"not gzip at all")
    plain = tmp_path / "config-6.1.0"
    plain.write_text(CONFIG.replace("CONFIG_UDMABUF=m", "# CONFIG_UDMABUF is not set") + "CONFIG_DMABUF_HEAPS=y\n")
    src, cfg = info.read_kernel_config([tmp_path / "missing.gz", bad, plain])
    assert src == str(plain)
    assert cfg["CONFIG_UDMABUF"] == "no" and cfg["CONFIG_DMABUF_HEAPS"] == "y"


def test_kernel_config_unreadable_is_unknown_never_no(tmp_path: Path) -> None:
    src, cfg = info.read_kernel_config([tmp_path / "missing.gz", tmp_path / "config-missing"])
    assert src is None and cfg == {opt: "unknown" for opt in info.CONFIG_OPTIONS}
    src, cfg = info.read_kernel_config([], release="0.0.0")
    assert src is None and set(cfg.values()) == {"unknown"}


@pytest.mark.parametrize("release,expected", [
    ("5.12.0", True), ("5.11.22-generic", False), ("5.9.0", False), ("6.1.0-18-amd64", True),
    ("6.18.44-fc-v509", True), ("4.19.300", False), ("10.0", True), ("weird", None), ("", None)])
def test_kernel_at_least_5_12(release: str, expected: bool | None) -> None:
    assert info.kernel_at_least(release) is expected


def test_nvidia_driver_version_file(tmp_path: Path) -> None:
    p = tmp_path / "version"
    p.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
                 "(dvs-builder@U22-I3-AM02-24-3)  Wed Jun 11 2025\nGCC version:  gcc version 12.3.0\n")
    assert info.nvidia_driver(p) == ("580.159.04", "open")
    p.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert info.nvidia_driver(p) == ("535.104.05", "proprietary")
    assert info.nvidia_driver(tmp_path / "absent") == (None, "absent")
    assert info.nvidia_driver(tmp_path) == (None, "unknown")  # a directory: exists, unreadable as text


def test_dev_nodes(tmp_path: Path) -> None:
    assert info.dev_nodes(tmp_path) == (False, [])
    (tmp_path / "udmabuf").touch()
    (tmp_path / "dma_heap").mkdir()
    (tmp_path / "dma_heap" / "system").touch()
    (tmp_path / "dma_heap" / "cma").touch()
    assert info.dev_nodes(tmp_path) == (True, ["cma", "system"])


def test_iommu_modes(tmp_path: Path) -> None:
    cmd, units, groups = tmp_path / "cmdline", tmp_path / "iommu", tmp_path / "groups"
    cmd.write_text("ro quiet intel_iommu=on iommu=pt console=ttyS0\n")
    units.mkdir()
    (units / "dmar0").mkdir()
    r = info.iommu_facts(cmd, units, groups)
    assert r == {"mode": "passthrough", "cmdline": ["intel_iommu=on", "iommu=pt"], "units": ["dmar0"],
                 "group_types": []}
    cmd.write_text("intel_iommu=on\n")
    assert info.iommu_facts(cmd, units, groups)["mode"] == "translated"
    for n, t in ((0, "DMA-FQ"), (1, "identity")):
        (groups / str(n)).mkdir(parents=True)
        (groups / str(n) / "type").write_text(t + "\n")
    assert info.iommu_facts(cmd, units, groups)["mode"] == "translated"
    (groups / "0" / "type").write_text("identity\n")
    assert info.iommu_facts(cmd, units, groups)["mode"] == "passthrough"
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd.write_text("quiet\n")
    assert info.iommu_facts(cmd, empty, tmp_path / "none") == {"mode": "off", "cmdline": [], "units": [],
                                                                "group_types": []}
    assert info.iommu_facts(tmp_path / "no-cmdline", tmp_path / "no-class", tmp_path / "none")["mode"] == "off"
