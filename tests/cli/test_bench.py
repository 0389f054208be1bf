"""``dmabuf-interop bench``: it runs on tiny sizes and writes valid JSON. Timings are never asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from dmabuf_interop.cli.bench.runner import MECHANISMS, PHASES, parse_sizes, percentile, size_label
from tests.helpers import run_cli

TOP_KEYS = {"schema", "command", "argv", "started", "environment", "config", "mechanisms", "plot", "bandwidth",
            "python_overhead", "targets"}


def _load(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _check_cells(mech: dict, sizes: list[int], need_total: bool = True) -> None:
    assert [c["size"] for c in mech["cells"]] == sizes
    for cell in mech["cells"]:
        assert cell["reps"] >= 1
        assert set(cell["phases_us"]) == set(PHASES)
        for phase in ("export", "transport", "export_transport"):
            st = cell["phases_us"][phase]
            assert isinstance(st["median"], float) and isinstance(st["p90"], float)
        if need_total:
            assert isinstance(cell["phases_us"]["total"]["median"], float)


def test_memfd_bench_runs_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    out = run_cli("bench", "--mechanisms", "memfd", "--sizes", "4K,64K", "--reps", "3", "--warmup", "1",
                  "--json", str(path), "--plot", str(png))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "mechanism" in out.stdout and "memfd" in out.stdout and "targets:" in out.stdout
    assert "memfd 4 KiB: total median" in out.stderr  # progress on stderr
    data = _load(path)
    assert TOP_KEYS <= set(data)
    assert data["config"]["sizes"] == [4096, 65536]
    assert data["config"]["reps"] == 3 and data["config"]["warmup"] == 1
    assert data["command"].startswith("dmabuf-interop bench ")
    env = data["environment"]
    assert {"python", "packages", "cuda", "gpus", "clock"} <= set(env)
    assert "CLOCK_MONOTONIC" in env["clock"]
    memfd = data["mechanisms"]["memfd"]
    assert memfd["status"] == "ok" and memfd["kind"] == "ours"
    _check_cells(memfd, [4096, 65536])
    assert all(c["reps"] == 3 for c in memfd["cells"])
    assert set(data["targets"]) == {"latency", "bandwidth", "python_overhead"}
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib" in data["plot"]["skipped"] and not png.exists()
        assert "plot skipped: matplotlib is not installed" in out.stderr
    else:
        assert data["plot"]["path"] == str(png) and png.stat().st_size > 0


def test_missing_peers_are_reported_not_installed(tmp_path):
    missing = [n for n in ("torch-ipc", "cupy-ipc") if importlib.util.find_spec(MECHANISMS[n][1]) is None]
    if not missing:
        pytest.skip("torch and cupy are both installed here")
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--mechanisms", ",".join(["memfd", *missing]), "--sizes", "4K", "--reps", "1",
                  "--warmup", "0", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    data = _load(path)
    for name in missing:
        mech = data["mechanisms"][name]
        assert mech["status"] == "not installed" and mech["kind"] == "peer"
        assert mech["cells"] == []  # never a number
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(name))
        assert "not installed" in line
    assert data["targets"]["latency"]["met"] is None or "torch-ipc" not in missing


@pytest.mark.parametrize("sizes", ["4K,abc", "6", "0", "", "1T", "-4K"])
def test_bad_sizes_exit_2_with_one_line(sizes):
    out = run_cli("bench", "--sizes", sizes, "--mechanisms", "memfd")
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "--sizes" in lines[0], out.stderr


def test_bad_mechanism_and_devices_exit_2():
    for args in (("--mechanisms", "nccl"), ("--devices", "0"), ("--reps", "0")):
        out = run_cli("bench", *args)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr


def test_parse_sizes_units_and_dedup():
    assert parse_sizes("4K,1M,64M,1G") == [4096, 1 << 20, 64 << 20, 1 << 30]
    assert parse_sizes("4KiB, 4k,4096,8B") == [4096, 8]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes("65G")


def test_percentile_and_labels():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(11))), 90) == 9.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert size_label(4096) == "4 KiB" and size_label(1 << 30) == "1 GiB" and size_label(12) == "12 B"


@pytest.mark.gpu
def test_gpu_mechanisms_run_on_tiny_sizes(tmp_path):
    path = tmp_path / "bench.json"
    names = ["posix-fd", "posix-fd-cached", "dmabuf", "torch-ipc", "cuda-core-ipc", "cupy-ipc"]
    out = run_cli("bench", "--mechanisms", ",".join(names), "--sizes", "4K,64K", "--reps", "3", "--warmup", "2",
                  "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    data = _load(path)
    assert TOP_KEYS <= set(data)
    assert data["environment"]["gpus"]
    mechs = data["mechanisms"]
    for name in ("posix-fd", "posix-fd-cached"):
        assert mechs[name]["status"] == "ok", mechs[name]
        _check_cells(mechs[name], [4096, 65536])
    assert all(c["first_share_reps"] == 0 for c in mechs["posix-fd-cached"]["cells"])
    assert "breakdown_us" in mechs["posix-fd"]["cells"][0]
    dmabuf = mechs["dmabuf"]
    assert dmabuf["status"] == "ok", dmabuf
    imported = dmabuf.get("import", "ok") == "ok"
    assert imported or dmabuf["import"].startswith("unsupported ("), dmabuf.get("import")
    _check_cells(dmabuf, [4096, 65536], need_total=imported)
    for name in ("torch-ipc", "cuda-core-ipc", "cupy-ipc"):
        mech = mechs[name]
        assert mech["status"] in ("ok", "not installed"), mech
        if mech["status"] == "ok":
            _check_cells(mech, [4096, 65536])
        else:
            assert mech["cells"] == []
    bw = data["bandwidth"]
    assert bw["status"] == "ok", bw
    assert [b["size"] for b in bw["sizes"]] == [4096, 65536]
    assert all(b["verified"] and b["import"]["gbps"] > 0 and b["native"]["gbps"] > 0 for b in bw["sizes"])
    ov = data["python_overhead"]
    assert ov["posix_fd_cycle"]["library_median_us"] > 0 and ov["posix_fd_cycle"]["raw_median_us"] > 0
    assert set(data["targets"]) == {"latency", "bandwidth", "python_overhead"}
