"""GPU tests of the main job: ``dmabuf-interop`` run as a user runs it."""

from __future__ import annotations

import pytest

import subprocess
import sys

from tests.helpers import env_with_src, gpu_count, run_cli

pytestmark = pytest.mark.gpu


def _attr(name: str) -> int | None:
    """Ask a child process, keeping pytest itself free of CUDA state."""
    out = subprocess.run([sys.executable, "-c",
                          f"from dmabuf_interop import capabilities as c; print(c.attribute(0, {name!r}))"],
                         capture_output=True, text=True, env=env_with_src(), timeout=120)
    return None if out.stdout.strip() == "None" else int(out.stdout.strip())


def test_sample_path_passes_or_skips_with_hint():
    out = run_cli("--mechanism", "dmabuf")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Device 0: ") and "Compute Capability" in lines[0]
    if _attr("HOST_ALLOC_DMA_BUF_SUPPORTED") == 1:
        assert "Done" in lines
    else:
        assert lines[1] == ("Device 0 does not report CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED. "
                            "Skipping sample.")
        assert lines[-1].startswith("Hint: ") and "--mechanism" in lines[-1]
        assert "Traceback" not in out.stderr


def test_default_run_shares_memory_for_real():
    """``auto``: the sample's path, or one line per mechanism passed over, then verified sections."""
    out = run_cli()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Device 0: ") and "Compute Capability" in lines[0]
    if _attr("HOST_ALLOC_DMA_BUF_SUPPORTED") == 0:
        assert lines[1] == ("Device 0 does not report CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED. "
                            "Skipping sample.")
        chosen = next(line for line in lines if line.startswith("Running the demos with "))
        assert all(line.startswith("Passed over ") for line in lines[2:lines.index(chosen)])
    assert out.stdout.count("verified (0 mismatches)") >= 2
    assert "Skipping sample." not in out.stdout.split("Same-process round-trip", 1)[1]
    assert lines[-1] == "Done" and "Hint:" not in out.stdout


@pytest.mark.gpu(count=2)
def test_default_run_on_h200_pair_is_three_posix_fd_sections():
    """On H200 with driver 580: host memory is gated out, dma-buf import answers NOT_SUPPORTED, POSIX fd runs."""
    if _attr("HOST_ALLOC_DMA_BUF_SUPPORTED") != 0:
        pytest.skip("this GPU exports pinned host memory: the sample's path runs")
    out = run_cli()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[2] == "Passed over dmabuf: dmabuf import: cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED"
    assert lines[3] == "Running the demos with posix-fd, the first mechanism that works end to end here."
    assert out.stdout.count("verified (0 mismatches)") == 3
    assert "parent: on device 1, received POSIX fd" in out.stdout


def test_posix_fd_runs_all_sections():
    out = run_cli("--mechanism", "posix-fd")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.count("verified (0 mismatches)") == (3 if gpu_count()[0] >= 2 else 2), text
    assert "exported as POSIX fd" in text
    assert "received POSIX fd" in text
    assert text.rstrip().endswith("Done")
    if gpu_count()[0] < 2:
        assert "no GPU pair supports POSIX-fd handles with peer access. Skipping." in text


@pytest.mark.gpu(count=2)
def test_posix_fd_cross_gpu_uses_two_devices():
    out = run_cli("--mechanism", "posix-fd")
    assert out.returncode == 0, out.stdout + out.stderr
    section = out.stdout.split("Cross-GPU sharing across processes", 1)[1]
    assert "child:  on device 0, allocated" in section
    assert "parent: on device 1, received POSIX fd" in section
    assert "parent: verified (0 mismatches)" in section


def test_device_memory_dmabuf_exports_then_import_answers():
    out = run_cli("--mechanism", "dmabuf", "--memory", "device")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "producer: allocated 16384 bytes, exported as dma-buf fd" in text
    assert "child:  allocated 16384 bytes, exported as dma-buf fd" in text
    if "import not supported" in text:
        assert "cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED" in text
        assert text.rstrip().splitlines()[-1].startswith("Hint: ")
    else:
        assert text.count("verified (0 mismatches)") >= 2


def test_device_out_of_range_is_a_usage_error():
    out = run_cli("--mechanism", "posix-fd", "--device", "64")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "out of range" in out.stderr


def test_posix_fd_child_killed_mid_protocol_is_reported():
    out = run_cli("--mechanism", "posix-fd", "--timeout", "20",
                  extra_env={"DMABUF_INTEROP_FAULT": "child-sigkill-before-send"}, timeout=120)
    assert out.returncode == 1
    assert "killed by SIGKILL" in out.stdout
    assert "Traceback" not in out.stderr
