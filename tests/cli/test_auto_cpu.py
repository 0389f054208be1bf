"""The default run (``--mechanism auto``) and the sample's verbatim path on a machine without a CUDA driver."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import gpu_count, run_cli

GOLDEN = Path(__file__).parent / "golden"

needs_no_driver = pytest.mark.skipif(gpu_count()[0] > 0, reason="a CUDA device is present: see test_gpu_cli.py")


@needs_no_driver
def test_default_run_falls_back_to_memfd_in_under_2_s():
    start = time.monotonic()
    out = run_cli(timeout=60)
    elapsed = time.monotonic() - start
    assert out.returncode == 0 and out.stderr == "", out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Passed over dmabuf: device dmabuf export: cuInit -> "), lines[0]
    assert lines[1].startswith("Passed over posix-fd: posix fd export: cuInit -> "), lines[1]
    assert lines[2] == "Running the demos with memfd, the first mechanism that works end to end here."
    assert lines[3] == "Host shared memory (memfd_create + mmap, no GPU)"
    assert out.stdout.count("verified (0 mismatches)") == 2
    assert "  host shared memory involves no GPU. Skipping." in lines
    assert lines[-1] == "Done"
    assert elapsed < 2, f"{elapsed:.2f} s"


@needs_no_driver
def test_default_run_reasons_are_the_librarys():
    """The passed-over lines are mechanisms.why_not's, and the order is mechanisms.PREFERENCE."""
    import subprocess
    import sys

    from tests.helpers import env_with_src

    code = ("from dmabuf_interop.mechanisms import choose; m, r = choose(0); "
            "print(m.name); print(*r, sep='\\n')")
    lib = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_src(),
                         timeout=60).stdout.splitlines()
    cli = run_cli(timeout=60).stdout.splitlines()
    assert lib[0] == "memfd"
    assert cli[:len(lib) - 1] == [f"Passed over {why}" for why in lib[1:]]


@needs_no_driver
@pytest.mark.parametrize("args", [("--mechanism", "dmabuf"), ("run", "--mechanism", "dmabuf")])
def test_sample_path_output_is_unchanged(args):
    """``--mechanism dmabuf`` prints what the sample's path printed before ``auto``, line by line."""
    out = run_cli(*args, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    expected = (GOLDEN / "dmabuf_no_driver.txt").read_text().splitlines()
    got = out.stdout.splitlines()
    for n, (g, e) in enumerate(zip(got, expected), 1):
        assert g == e, f"line {n}: {g!r} != {e!r}"
    assert len(got) == len(expected)
