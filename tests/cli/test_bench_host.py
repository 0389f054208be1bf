"""``dmabuf-interop bench`` on host memory: iceoryx2 beside ``channel-host``, the channel with and without its
shared-memory ring, spinning consumers, CPU time per hand-off, the idle consumer, host throughput and the host
target.

The runs are real (tiny sizes, few repetitions). Latencies are never asserted; the idle consumer's CPU share
is, since a consumer that blocks must not keep a CPU busy. The iceoryx2 runs skip where it is not installed
(CI does not install it).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from dmabuf_interop.cli.bench.targets import HOST_RATIO, host_target
from tests.helpers import SRC, run_cli

HAVE_ICEORYX2 = importlib.util.find_spec("iceoryx2") is not None
needs_iceoryx2 = pytest.mark.skipif(not HAVE_ICEORYX2, reason="iceoryx2 is not installed (pip install iceoryx2)")
#: A blocking consumer waiting 1 s with nothing sent: far below this share of one CPU (a polling one is near 100).
IDLE_CPU_PCT = 10.0


def _bench(tmp_path, *args: str, extra_env: dict[str, str] | None = None, stderr: list[str] | None = None
           ) -> tuple[dict, str]:
    path = tmp_path / "bench.json"
    out = run_cli("bench", *args, "--json", str(path), timeout=300, extra_env=extra_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    if stderr is not None:
        stderr.append(out.stderr)
    with open(path) as fh:
        return json.load(fh), out.stdout


def _rows(stdout: str, name: str, mode: str) -> list[str]:
    """The CPU table's rows of run ``name`` (``blocking`` or ``spinning``)."""
    head = f"{name:<20}{mode:>9}"
    return [ln for ln in stdout.splitlines() if ln.startswith(head) and ln[len(head):][:8].strip().endswith("iB")]


def _check_cpu(entry: dict, sizes: list[int]) -> None:
    assert [c["size"] for c in entry["cells"]] == sizes
    for cell in entry["cells"]:
        cpu = cell["cpu_us_per_handoff"]
        assert set(cpu) == {"producer", "consumer"}
        for side in cpu.values():  # inside send / recv is part of the timed loop
            assert 0 < side["handoff"] <= side["loop"], cpu
        assert cell["phases_us"]["total"]["p99"] >= cell["phases_us"]["total"]["median"]


def _check_idle(entry: dict) -> None:
    idle = entry["idle_consumer"]
    assert idle["wall_s"] >= 0.9 and 0 <= idle["cpu_pct"] < IDLE_CPU_PCT, idle


def test_channel_host_cpu_idle_and_spin(tmp_path):
    """CPU per hand-off and the idle consumer's CPU for the blocking run; the spinning run either sets
    ``Channel.spin`` or is reported unsupported with the reason (a channel without the attribute)."""
    data, stdout = _bench(tmp_path, "--mechanisms", "channel-host", "--sizes", "4K", "--reps", "3", "--warmup", "1",
                          "--consumer-spin", "2e-5")
    assert data["config"]["consumer_spin"] == 2e-5 and data["environment"]["cpus"] >= 1
    blocking = data["mechanisms"]["channel-host"]
    assert blocking["status"] == "ok", blocking
    _check_cpu(blocking, [4096])
    _check_idle(blocking)
    spinning = data["spinning"]["channel-host"]
    if spinning["status"] == "ok":
        assert spinning["consumer_spin_s"] == 2e-5
        _check_cpu(spinning, [4096])
    else:
        assert spinning["status"] == "unsupported" and "no spin attribute" in spinning["reason"], spinning
        assert spinning["cells"] == []
        assert f"{'channel-host':<20}{'spinning':>9}  unsupported" in stdout
    assert "consumer CPU while waiting" in stdout and "channel-host blocking" in stdout
    host = data["targets"]["host"]
    assert host["met"] is None and "iceoryx2 not run" in host["note"], host
    assert f"channel-host <= {HOST_RATIO:g} x iceoryx2" in stdout


def test_consumer_spin_auto_runs_the_channels_adaptive_spin(tmp_path):
    data, stdout = _bench(tmp_path, "--mechanisms", "channel-host", "--sizes", "4K", "--reps", "3", "--warmup", "1",
                          "--consumer-spin", "auto")
    assert data["config"]["consumer_spin"] == "auto"
    spun = data["spinning"]["channel-host"]
    assert spun["status"] == "ok" and spun["consumer_spin_s"] == "auto", spun
    _check_cpu(spun, [4096])
    assert "spinning adaptively (Channel.spin = 'auto')" in stdout


@needs_iceoryx2
def test_iceoryx2_has_no_adaptive_spin(tmp_path):
    data, _ = _bench(tmp_path, "--mechanisms", "iceoryx2", "--sizes", "4K", "--reps", "2", "--warmup", "0",
                     "--consumer-spin", "auto")
    spun = data["spinning"]["iceoryx2"]
    assert spun["status"] == "unsupported" and "no adaptive spin" in spun["reason"], spun
    assert data["mechanisms"]["iceoryx2"]["status"] == "ok"


def test_no_spinning_run_without_consumer_spin(tmp_path):
    data, stdout = _bench(tmp_path, "--mechanisms", "memfd", "--sizes", "4K", "--reps", "2", "--warmup", "0")
    assert data["spinning"] == {} and data["config"]["consumer_spin"] == 0
    _check_cpu(data["mechanisms"]["memfd"], [4096])  # every mechanism reports its CPU per hand-off
    assert "idle_consumer" not in data["mechanisms"]["memfd"]
    assert " spinning " not in stdout.split("targets:")[0]


@needs_iceoryx2
def test_iceoryx2_beside_channel_host(tmp_path):
    data, stdout = _bench(tmp_path, "--mechanisms", "channel-host,iceoryx2", "--sizes", "4K,64K", "--reps", "3",
                          "--warmup", "1", "--consumer-spin", "2e-5")
    assert data["environment"]["packages"]["iceoryx2"]
    iox = data["mechanisms"]["iceoryx2"]
    assert iox["status"] == "ok" and iox["kind"] == "peer" and iox["versions"]["iceoryx2"], iox
    assert "devices" not in iox  # CUDA-free
    _check_cpu(iox, [4096, 65536])
    _check_idle(iox)
    for cell in iox["cells"]:
        assert cell["reps"] == 3 and all(x >= 0 for x in cell["samples_us"]["total"])
    spun = data["spinning"]["iceoryx2"]
    assert spun["status"] == "ok" and spun["consumer_spin_s"] == 2e-5, spun
    _check_cpu(spun, [4096, 65536])
    assert set(data["spinning"]) == {"channel-host", "iceoryx2"}
    tput = data["throughput"]["iceoryx2"]
    assert tput["status"] == "ok" and tput["per_second"] > 0 and tput["size"] == 1 << 20, tput
    assert data["targets"]["throughput"]["measured"]["iceoryx2"] == tput["per_second"]
    assert "iceoryx2" not in data["targets"]["throughput"]["per_mechanism"]  # a peer's figure, not judged
    host = data["targets"]["host"]
    assert [x["label"] for x in host["per_size"]] == ["4 KiB", "64 KiB"]
    for x in host["per_size"]:
        assert x["ratio"] == pytest.approx(x["channel_host_us"] / x["iceoryx2_us"], rel=1e-2)
        assert x["iceoryx2_mode"] in ("blocking", "spinning")
    assert host["met"] is (all(x["ratio"] <= HOST_RATIO for x in host["per_size"]))
    assert f"{'iceoryx2':<20}{'spinning':>9}" in stdout and "iceoryx2 blocking" in stdout


def _entry(medians: dict[int, float]) -> dict:
    return {"status": "ok", "cells": [{"size": s, "phases_us": {"total": {"median": m, "p99": 2 * m}}}
                                      for s, m in medians.items()]}


def test_host_target_takes_each_mechanism_at_its_faster_mode():
    results = {"config": {"sizes": [4096, 1 << 20]},
               "mechanisms": {"channel-host": _entry({4096: 60.0, 1 << 20: 70.0}),
                              "iceoryx2": _entry({4096: 40.0, 1 << 20: 40.0})},
               "spinning": {"channel-host": _entry({4096: 9.0, 1 << 20: 80.0}),
                            "iceoryx2": _entry({4096: 5.0, 1 << 20: 30.0})}}
    t = host_target(results)
    assert [(x["channel_host_mode"], x["iceoryx2_mode"], x["ratio"]) for x in t["per_size"]] == [
        ("spinning", "spinning", 1.8), ("blocking", "spinning", round(70 / 30, 3))]
    assert t["met"] is False
    results["spinning"]["channel-host"] = {"status": "unsupported", "reason": "no spin", "cells": []}
    t = host_target(results)
    assert t["met"] is False and "unsupported" in t["note"]
    del results["spinning"]
    t = host_target(results)  # no spinning run: blocking medians shown, no verdict
    assert t["met"] is None and [x["ratio"] for x in t["per_size"]] == [1.5, 1.75]
    results["mechanisms"]["iceoryx2"] = {"status": "not installed", "reason": "iceoryx2 is not installed", "cells": []}
    t = host_target(results)
    assert t["met"] is None and t["per_size"] == [] and "iceoryx2 not installed" in t["note"]


@pytest.mark.ring
def test_channel_with_and_without_the_ring(tmp_path):
    """``channel-host`` uses the shared-memory ring and ``channel-host-socket`` does not, in the latency cells,
    the table and the throughput runs; the socket variant has no spinning run (a spin polls the ring)."""
    data, stdout = _bench(tmp_path, "--mechanisms", "channel-host,channel-host-socket", "--sizes", "4K,64K",
                          "--reps", "3", "--warmup", "1", "--consumer-spin", "2e-5")
    assert data["environment"]["channel_ring"] == {"available": True, "reason": None}
    mechs = data["mechanisms"]
    for name, ring in (("channel-host", True), ("channel-host-socket", False)):
        entry = mechs[name]
        assert entry["status"] == "ok" and entry["kind"] == "ours" and entry["ring"] is ring, entry
        assert "ring_missing" not in entry and "devices" not in entry
        assert [c["ring"] for c in entry["cells"]] == [ring, ring]
        _check_cpu(entry, [4096, 65536])
        _check_idle(entry)  # a blocking consumer idles on the socket path too
        rows = _rows(stdout, name, "blocking")
        assert len(rows) == 2 and all(r.endswith("ring" if ring else "socket") for r in rows), rows
        tput = data["throughput"][name]
        assert tput["status"] == "ok" and tput["per_second"] > 0 and tput["ring"] is ring, tput
        assert tput["producer"]["fds_grew"] <= 0 and tput["consumer_fds_grew"] <= 0, tput  # no growth
    assert set(data["spinning"]) == {"channel-host"}
    assert data["spinning"]["channel-host"]["ring"] is True
    assert all(r.endswith("ring") for r in _rows(stdout, "channel-host", "spinning"))
    th = data["targets"]["throughput"]
    assert set(th["measured"]) == {"channel-host", "channel-host-socket"}
    assert set(th["per_mechanism"]) == {"channel-host"}  # the socket path's figure is shown, not judged
    assert "NO shared-memory ring" not in stdout


_HIDE_ATOMIC = """
import sys

class _Hide:  # the ring's C extension, as if it were not built
    def find_spec(self, name, path=None, target=None):
        if name == "dmabuf_interop._atomic":
            raise ImportError("hidden by the test")

sys.meta_path.insert(0, _Hide())
"""


def test_a_run_without_the_ring_it_asked_for_says_so(tmp_path):
    """The extension hidden in every process of the run: ``channel-host`` still runs, on the socket alone,
    and the JSON, stderr, the table and the host verdict all say that these are the socket path's figures."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDE_ATOMIC)
    err: list[str] = []
    data, stdout = _bench(tmp_path, "--mechanisms", "channel-host", "--sizes", "4K", "--reps", "2", "--warmup", "1",
                          extra_env={"PYTHONPATH": f"{site}{os.pathsep}{SRC}"}, stderr=err)
    ring = data["environment"]["channel_ring"]
    assert ring["available"] is False and "not built" in ring["reason"], ring
    entry = data["mechanisms"]["channel-host"]
    assert entry["status"] == "ok" and entry["ring"] is False and entry["ring_missing"] == ring["reason"], entry
    assert [c["ring"] for c in entry["cells"]] == [False]
    tput = data["throughput"]["channel-host"]
    assert tput["status"] == "ok" and tput["ring"] is False and tput["ring_missing"] == ring["reason"], tput
    assert "channel-host: WARNING: no shared-memory ring" in err[0]
    assert "channel-host throughput: WARNING: no shared-memory ring" in err[0]
    assert f"{'channel-host':<20}{'':>8}  NO shared-memory ring" in stdout
    assert all(r.endswith("socket") for r in _rows(stdout, "channel-host", "blocking"))


@pytest.mark.ring
def test_the_floor_script_runs_a_short_loop_between_two_processes():
    """``scripts/handoff_floor.py``, the reference the host hand-off is read against (docs/benchmarks.md)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import env_with_src

    script = Path(__file__).resolve().parents[2] / "scripts" / "handoff_floor.py"
    out = subprocess.run([sys.executable, str(script), "--count", "200", "--skip", "20"], env=env_with_src(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("floor: median ") and line.endswith(" 180 hand-offs"), line


def test_an_interrupted_channel_run_leaves_nothing_in_the_file_system(tmp_path):
    """The bench channel listens on an abstract address: peers killed by the parent (Ctrl-C here) leave no socket
    folder behind in the temporary directory."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.helpers import env_with_src

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**env_with_src(), "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop", "bench", "--mechanisms", "channel-host",
                             "--sizes", "4K,1M", "--reps", "100000", "--warmup", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "channel-host" not in (proc.stderr.readline() or "channel-host"):
        pass  # (progress on stderr: the channel run has begun)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    assert proc.wait(60) == 130
    proc.stderr.close()
    assert not [p.name for p in Path(tmp).iterdir() if p.name.startswith("dmabuf-interop-bench-")]
