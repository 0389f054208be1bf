"""What a user gets from ``pip install .``: NVRTC, type information, licence files; the tests run ``src/``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dmabuf_interop
from dmabuf_interop import kernels
from dmabuf_interop.errors import CudaNotSupportedError

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_the_tests_import_the_source_tree_not_an_installed_copy():
    assert Path(dmabuf_interop.__file__).resolve().is_relative_to(ROOT / "src"), dmabuf_interop.__file__


def test_nvrtc_is_a_dependency_and_named_where_it_is_missing():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert kernels.NVRTC_PACKAGE in deps
    try:
        kernels.require_nvrtc()
    except CudaNotSupportedError as exc:
        assert kernels.NVRTC_PACKAGE in str(exc) and "\n" not in str(exc)
    # else: NVRTC loads here, as it does after `pip install .`


def test_the_compiled_driver_calls_are_built_where_cython_and_cuda_h_were():
    """``pip install`` builds ``_driver_hot`` (its build requirements bring Cython, cuda-bindings' .pxd files and
    cuda.h); ``DMABUF_INTEROP_REQUIRE_DRIVER_HOT=1`` (CI sets it) makes its absence a failure."""
    import os

    from dmabuf_interop import _driver

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(r.startswith("Cython") for r in requires) and any(r.startswith("nvidia-cuda-runtime") for r in requires)
    try:
        from dmabuf_interop import _driver_hot
    except ImportError as exc:
        if os.environ.get("DMABUF_INTEROP_REQUIRE_DRIVER_HOT") == "1":
            pytest.fail(f"dmabuf_interop._driver_hot required but not importable: {exc}")
        pytest.skip(f"dmabuf_interop._driver_hot is not built here: {exc}")
    try:
        _driver.bindings()  # (cuda.bindings imports without a driver; it loads libcuda at the first call)
    except Exception:  # noqa: BLE001 - no cuda-bindings here: nothing of it to check
        pass
    else:
        assert _driver._hot is _driver_hot
    assert issubclass(_driver_hot.DriverCallFailed, Exception)
    assert {"make_current", "stream_idle", "stream_synchronize"} <= set(dir(_driver_hot))


def test_package_metadata_and_files():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"] and (ROOT / "src/dmabuf_interop/py.typed").exists()
    assert project["urls"] and "matplotlib>=3.5" in project["optional-dependencies"]["bench"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    assert "NVIDIA" in notice and "BSD-3-Clause" in notice


def test_changelog_names_the_current_version_and_the_renamed_imports():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(dmabuf_interop.__version__)}\b", text, re.M)
    for old in ("dmabuf_interop.driver", "dmabuf_interop.vmm", "dmabuf_interop.exporter", "TimeoutError"):
        assert old in text


@pytest.mark.parametrize("doc", ["README.md", "docs/info.md", "CHANGELOG.md", "NOTICE"])
def test_docs_speak_of_the_product_alone(doc):
    text = (ROOT / doc).read_text()
    assert not re.search(r"\b(issue|session|ticket)s? ?\d*\b", text, re.I), doc


def test_without_a_compiler_the_build_leaves_both_compiled_parts_out_and_succeeds(tmp_path):
    """Both compiled parts are optional: ``build_ext`` with no working C or C++ compiler warns and succeeds (a
    ``cythonize``d Extension drops ``optional``; setup.py sets it again). ``CUDA_HOME`` names a ``cuda.h`` so that
    setup.py goes as far as compiling ``_driver_hot`` wherever Cython and cuda-bindings are importable."""
    import importlib.util
    import os
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.cpp"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "cuda" / "include").mkdir(parents=True)
    (tmp_path / "cuda" / "include" / "cuda.h").write_text("/* never compiled: no compiler */\n")
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false", "LDCXXSHARED": "false",
           "CUDA_HOME": str(tmp_path / "cuda")}
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'building extension "dmabuf_interop._atomic" failed' in out.stderr
    if importlib.util.find_spec("Cython") and importlib.util.find_spec("cuda.bindings"):
        assert 'building extension "dmabuf_interop._driver_hot" failed' in out.stderr
    # (else setup.py leaves _driver_hot out before any compiler is asked)
    assert not list((tmp_path / "src").rglob("*.so"))
