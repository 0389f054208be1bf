"""The channel target of ``dmabuf-interop bench``: each consumer mode against torch-ipc, its own median and
posix-fd-cached, from a run's JSON alone (no process started)."""

from __future__ import annotations

import io

from dmabuf_interop.cli.bench import report
from dmabuf_interop.cli.bench.targets import CHANNEL_RATIO, CHANNEL_SPIN_RATIO, bench_targets, channel_target

K4, M1 = 4096, 1 << 20


def _entry(cells: dict[int, tuple[float, float]]) -> dict:
    """A mechanism's JSON entry: size -> (median, p99) of the total hand-off, µs."""
    return {"status": "ok", "cells": [{"size": s, "phases_us": {"total": {"median": m, "p99": p}}}
                                      for s, (m, p) in cells.items()]}


def _results() -> dict:
    return {"config": {"sizes": [K4, M1]},
            "mechanisms": {"torch-ipc": _entry({K4: (400.0, 500.0), M1: (400.0, 500.0)}),
                           "posix-fd-cached": _entry({K4: (60.0, 80.0), M1: (60.0, 80.0)}),
                           "channel": _entry({K4: (55.0, 90.0), M1: (58.0, 100.0)})},
            "spinning": {"channel": _entry({K4: (40.0, 60.0), M1: (45.0, 70.0)})}}


def test_met_when_both_modes_meet_every_figure() -> None:
    t = channel_target(_results())
    assert t["met"] is True and "note" not in t
    row = t["per_size"][0]
    assert row["blocking"]["ratio"] == 55 / 400 and row["spinning"]["ratio"] == 40 / 400
    assert row["ratio"] == row["blocking"]["ratio"]  # the blocking figures stay at the top level
    assert row["blocking"]["at_or_below_posix_fd_cached"] and row["spinning"]["posix_fd_cached_us"] == 60.0


def test_each_figure_can_miss_on_its_own() -> None:
    r = _results()
    r["mechanisms"]["channel"] = _entry({K4: (61.0, 90.0), M1: (58.0, 100.0)})  # above posix-fd-cached
    assert channel_target(r)["met"] is False
    r = _results()
    r["spinning"]["channel"] = _entry({K4: (40.0, 130.0), M1: (45.0, 70.0)})  # p99 over 3x its median
    assert channel_target(r)["met"] is False
    r = _results()
    r["mechanisms"]["torch-ipc"] = _entry({K4: (250.0, 300.0), M1: (400.0, 500.0)})
    t = channel_target(r)  # 40 / 250 spinning is over 0.15x; 55 / 250 blocking is within 0.25x
    assert t["met"] is False
    assert t["per_size"][0]["spinning"]["ratio"] > CHANNEL_SPIN_RATIO >= 0
    assert t["per_size"][0]["blocking"]["ratio"] <= CHANNEL_RATIO


def test_no_verdict_without_the_spinning_run_or_posix_fd_cached() -> None:
    r = _results()
    del r["spinning"]
    t = channel_target(r)
    assert t["met"] is None and "no spinning run" in t["note"] and t["per_size"][0]["spinning"] is None
    r = _results()
    del r["mechanisms"]["posix-fd-cached"]
    t = channel_target(r)
    assert t["met"] is None and "posix-fd-cached not run" in t["note"]
    assert t["per_size"][0]["blocking"]["at_or_below_posix_fd_cached"] is None
    r["mechanisms"]["channel"] = _entry({K4: (150.0, 160.0), M1: (58.0, 100.0)})  # a miss is a miss all the same
    assert channel_target(r)["met"] is False
    r = _results()
    r["mechanisms"]["torch-ipc"] = {"status": "not installed", "cells": []}
    t = channel_target(r)
    assert t["met"] is None and t["per_size"] == [] and "torch-ipc not installed" in t["note"]


def test_the_table_prints_both_modes() -> None:
    r = _results()
    r.update(throughput={}, bandwidth={"sizes": []}, python_overhead=None)
    out = io.StringIO()
    report.print_targets(bench_targets(r), out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("  channel <="))
    assert ": MET " in line
    assert "4 KiB 0.14x (p99 1.6x, 55.0 <= 60.0 us) / 0.10x (p99 1.5x, 40.0 <= 60.0 us)" in line
