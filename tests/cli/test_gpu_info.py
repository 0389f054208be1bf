"""GPU tests of ``dmabuf-interop info``: the report against the measured H200 table of issue 2.

Structural checks run on any GPU. The measured values are asserted only on
H200s with an R580 driver: the driver version comes from
``/proc/driver/nvidia/version`` and, where that file is not readable, from
the CUDA version 13.0 that the R580 branch reports.
"""

from __future__ import annotations

import json
import re

import pytest

from dmabuf_interop import capabilities
from dmabuf_interop.cli import info
from tests.helpers import run_cli
from tests.helpers.info_doc import PROBE_RE, check_documented

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report() -> dict:
    out = run_cli("info", "--json", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    return json.loads(out.stdout)


def _measured_h200(report: dict) -> bool:
    s = report["system"]
    r580 = (s["nvidia_driver_version"] or "").startswith("580.") or (
        s["nvidia_driver_version"] is None and s["cuda_driver_version"] == "13.0")
    return r580 and all("H200" in g["name"] for g in report["gpus"])


def test_structure(report: dict) -> None:
    cuda = report["cuda"]
    assert cuda["available"] is True and cuda["worker"] == "ok" and cuda["reason"] == ""
    assert cuda["device_count"] == len(report["gpus"]) >= 1
    assert re.match(r"^\d+\.\d+$", report["system"]["cuda_driver_version"])
    check_documented(report)
    for i, g in enumerate(report["gpus"]):
        assert g["ordinal"] == i and g["uuid"].startswith("GPU-") and re.match(r"^\d+\.\d+$", g["compute_capability"])
        assert set(g["attributes"]) == set(capabilities.ATTRIBUTES)
        expected = set(info._PROBE_ORDER if cuda["device_count"] > 1 else info._PROBE_ORDER[:6])
        assert set(g["probes"]) == expected
        assert all(PROBE_RE.match(v) for v in g["probes"].values()), g["probes"]
    for m in report["mechanisms"].values():
        assert m["reason"]
        if m["pair"] is not None:
            assert m["pair"][0] != m["pair"][1] and isinstance(m["peer_access"], bool)


def test_text_report(report: dict) -> None:
    out = run_cli("info", timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    for g in report["gpus"]:
        assert f"GPU {g['ordinal']}: {g['name']}" in out.stdout


def test_matches_measured_h200_table(report: dict) -> None:
    if not _measured_h200(report):
        pytest.skip("the measured table is for H200 GPUs with an R580 driver; this machine differs")
    for g in report["gpus"]:
        a, p = g["attributes"], g["probes"]
        assert a["DMA_BUF_SUPPORTED"] == 1 and a["HOST_ALLOC_DMA_BUF_SUPPORTED"] == 0
        assert a["DMA_BUF_MMAP_SUPPORTED"] == "unknown"
        assert a["HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"] == 1 and a["GPU_DIRECT_RDMA_SUPPORTED"] == 1
        expected = {"host_dmabuf_export": "unsupported (CUDA_ERROR_INVALID_VALUE)", "device_dmabuf_export": "ok",
                    "vmm_dmabuf_export": "ok", "dmabuf_import": "unsupported (CUDA_ERROR_NOT_SUPPORTED)",
                    "posix_fd_export": "ok", "posix_fd_import": "ok", "posix_fd_import_peer": "ok"}
        wrong = {k: (p[k], g["probe_details"].get(k)) for k, v in expected.items() if k in p and p[k] != v}
        assert not wrong, f"GPU {g['ordinal']} probes differ from the measured table: {wrong}"
    m = report["mechanisms"]
    assert m["posix-fd"]["usable"] is True
    assert m["dmabuf-host"]["usable"] is False and "HOST_ALLOC_DMA_BUF_SUPPORTED=0" in m["dmabuf-host"]["reason"]
    assert m["dmabuf-device"]["usable"] is True and "CUDA_ERROR_NOT_SUPPORTED" in m["dmabuf-device"]["reason"]
    assert m["dmabuf-host"]["pair"] is None
    if report["cuda"]["device_count"] >= 2:
        assert m["posix-fd"]["pair"] == [0, 1] and m["posix-fd"]["peer_access"] is True
        assert m["dmabuf-device"]["pair"] == [0, 1]
