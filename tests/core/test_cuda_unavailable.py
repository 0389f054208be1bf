"""Why CUDA is unavailable, told apart: no driver, no cuda-bindings, no visible GPU, old driver; and a
GPU run that cannot run its tests is a failure under --require-gpu. Subprocesses with real environments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import SRC, env_with_src, gpu_count

_HIDE_BINDINGS = "import sys; sys.modules['cuda'] = None\n"  # this interpreter then lacks cuda-bindings

_PROBLEM = "from dmabuf_interop import capabilities; print(json.dumps(capabilities.driver_problem()))"


def _python(code: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = env_with_src()
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_missing_cuda_bindings_is_its_own_reason_in_the_library_and_the_demos():
    out = _python(_HIDE_BINDINGS + _PROBLEM)
    code, text = json.loads(out.stdout)
    assert code == "no-bindings" and text.startswith("cuda-bindings is not installed for "), text
    demo = _python(_HIDE_BINDINGS + "from dmabuf_interop.cli import main\n"
                   "sys.exit(main(['--mechanism', 'posix-fd']))")
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.splitlines()[0].startswith("CUDA is not usable here: cuda-bindings is not installed")


def test_no_driver_is_its_own_reason():
    n, _ = gpu_count()
    if n:
        pytest.skip(f"this machine has {n} GPU(s)")
    code, text = json.loads(_python(_PROBLEM).stdout)
    assert code in ("no-driver", "no-device"), text
    if code == "no-driver":
        assert text.startswith("no NVIDIA driver on this machine")


def test_require_gpu_turns_every_gpu_skip_into_a_failure():
    n, reason = gpu_count()
    if n:
        pytest.skip(f"this machine has {n} GPU(s): its gpu tests run")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
            f"{SRC}/../tests/mechanisms/test_gpu_core.py"]
    plain = subprocess.run(args + ["-rs"], capture_output=True, text=True, timeout=300, env=env_with_src())
    assert plain.returncode == 0 and "no GPU here:" in plain.stdout, plain.stdout[-2000:]
    for extra, env in ((["--require-gpu"], {}), ([], {"DMABUF_INTEROP_REQUIRE_GPU": "1"})):
        strict = subprocess.run(args + extra, capture_output=True, text=True, timeout=300,
                                env={**env_with_src(), **env})
        assert strict.returncode != 0, strict.stdout[-2000:]
        assert "GPU required" in strict.stdout and " passed" not in strict.stdout and "skipped" not in strict.stdout


@pytest.mark.gpu
def test_require_gpu_skips_a_two_gpu_test_on_one_gpu_and_runs_the_rest():
    # One GPU made visible: the two-GPU tests are a property of the machine (a skip), the others must run.
    args = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", "--require-gpu",
            f"{SRC}/../tests/channel/test_channel_gpu.py", "-k", "other_gpu or late_kernel_write"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600,
                         env={**env_with_src(), "CUDA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stdout[-2000:]
    assert "needs 2 GPUs, this machine has 1" in out.stdout and "GPU required" not in out.stdout, out.stdout[-2000:]
    assert " passed" in out.stdout and "2 skipped" in out.stdout, out.stdout[-2000:]


@pytest.mark.gpu
def test_no_visible_gpu_names_cuda_visible_devices():
    for value in ("", "GPU-00000000-0000-0000-0000-000000000000"):
        code, text = json.loads(_python(_PROBLEM, {"CUDA_VISIBLE_DEVICES": value}).stdout)
        assert code == "no-device" and f"CUDA_VISIBLE_DEVICES={value!r}" in text, text
        info = subprocess.run([sys.executable, "-m", "dmabuf_interop", "info", "--json"], capture_output=True,
                              text=True, timeout=240, env={**env_with_src(), "CUDA_VISIBLE_DEVICES": value})
        cuda = json.loads(info.stdout)["cuda"]
        assert cuda["reason_code"] == "no-device" and "CUDA_VISIBLE_DEVICES" in cuda["reason"], cuda
        demo = subprocess.run([sys.executable, "-m", "dmabuf_interop", "--mechanism", "posix-fd"],
                              capture_output=True, text=True, timeout=120,
                              env={**env_with_src(), "CUDA_VISIBLE_DEVICES": value})
        assert demo.returncode == 0 and "CUDA_VISIBLE_DEVICES" in demo.stdout.splitlines()[0], demo.stdout


@pytest.mark.gpu
def test_this_driver_is_new_enough_for_these_bindings():
    out = _python("from dmabuf_interop import _driver as d\n"
                  "print(json.dumps([d.driver_version(), d.required_driver_version(), d.bindings().CUDA_VERSION]))")
    have, need, built = json.loads(out.stdout)
    assert need == built // 1000 * 1000 and have >= need
