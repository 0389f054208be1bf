"""``dmabuf-interop bench`` on host memory: iceoryx2 beside ``channel-host``, spinning consumers, CPU time per
hand-off, the idle consumer, host throughput and the host target.

The runs are real (tiny sizes, few repetitions). Latencies are never asserted; the idle consumer's CPU share
is, since a consumer that blocks must not keep a CPU busy. The iceoryx2 runs skip where it is not installed
(CI does not install it).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from dmabuf_interop.cli.bench.targets import HOST_RATIO, host_target
from tests.helpers import run_cli

HAVE_ICEORYX2 = importlib.util.find_spec("iceoryx2") is not None
needs_iceoryx2 = pytest.mark.skipif(not HAVE_ICEORYX2, reason="iceoryx2 is not installed (pip install iceoryx2)")
#: A blocking consumer waiting 1 s with nothing sent: far below this share of one CPU (a polling one is near 100).
IDLE_CPU_PCT = 10.0


def _bench(tmp_path, *args: str) -> tuple[dict, str]:
    path = tmp_path / "bench.json"
    out = run_cli("bench", *args, "--json", str(path), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    with open(path) as fh:
        return json.load(fh), out.stdout


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
        assert "channel-host     spinning  unsupported" in stdout
    assert "consumer CPU while waiting" in stdout and "channel-host blocking" in stdout
    host = data["targets"]["host"]
    assert host["met"] is None and "iceoryx2 not run" in host["note"], host
    assert f"channel-host <= {HOST_RATIO:g} x iceoryx2" in stdout


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
    assert "iceoryx2         spinning" in stdout and "iceoryx2 blocking" in stdout


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
