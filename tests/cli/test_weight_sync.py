"""Weight sync (``bench --workload``) and the weight-sync example: real trainer/engine processes.

CPU: host pools with the small shapes. GPU (run on 2 GPUs): the same with device pools, both placements.
Timings are never asserted; checksums, statuses and the JSON layout are.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dmabuf_interop.cli.bench.weight_sync import model_shapes, payload_bytes
from tests.helpers import env_with_src, run_cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "weight_sync"


def test_shapes_follow_the_public_configs():
    dense = model_shapes("ws-8b")
    assert len(dense) == 399 and len({n for n, _ in dense}) == 399
    assert round(payload_bytes(dense) / 1e9, 1) == 16.4
    assert max(2 * math.prod(s) for _, s in dense) == 2 * 151936 * 4096  # embedding and lm_head, untied
    assert ("model.layers.0.self_attn.k_proj.weight", (1024, 4096)) in dense
    moe = model_shapes("ws-moe")
    assert len(moe) == 18867 and round(payload_bytes(moe) / 1e9) == 61
    assert ("model.layers.47.mlp.experts.127.down_proj.weight", (2048, 768)) in moe
    small = model_shapes("ws-8b", small=True)  # the same layout over 2 layers
    assert [n for n, _ in small] == [n for n, _ in dense][:23] + [n for n, _ in dense][-2:]


@pytest.mark.parametrize("workload", ["ws-8b", "ws-moe"])
def test_host_workload_runs_in_real_processes(tmp_path, workload):
    path = tmp_path / "ws.json"
    plot = ["--plot", str(tmp_path / "ws.png")] if importlib.util.find_spec("matplotlib") else []
    out = run_cli("bench", "--workload", workload, "--small", "--host", "--reps", "4", "--warmup", "1",
                  "--json", str(path), *plot)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and "targets:" in out.stdout
    data = json.loads(path.read_text())
    assert data["config"]["workload"] == workload and data["config"]["host"] is True
    (pl,) = data["placements"]
    rows = {r["path"]: r for r in pl["rows"]}
    gpu_only = {"expandable-segments", "torch-reductions", "ipc-buckets"}  # said so, not left out silently
    assert set(rows) == {"hand-off", "copy", "vllm-backend", "copy-limit"} | gpu_only
    assert all(rows[n]["status"] == "unsupported" and "GPU memory only" in rows[n]["reason"] for n in gpu_only)
    for name in ("hand-off", "copy", "vllm-backend"):
        r = rows[name]
        assert r["status"] == "ok" and r["bad_checksums"] == 0 and r["ms"]["n"] == 4
        for side in ("trainer", "engine"):
            assert r[side]["fds_after"] <= r[side]["fds_before"]  # no fd growth over the steps
            assert r[side]["cpu_ms_per_step"] >= 0
    assert rows["copy-limit"]["ms"]["p50"] > 0
    assert all(t["met"] is None for t in data["targets"])  # the targets are for GPUs


def test_paths_selects_what_runs(tmp_path):
    path = tmp_path / "ws.json"
    out = run_cli("bench", "--workload", "ws-moe", "--small", "--host", "--reps", "2", "--warmup", "1",
                  "--paths", "hand-off,copy-limit", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(path.read_text())
    assert data["config"]["paths"] == ["hand-off", "copy-limit"] and data["config"]["variants"] == ["hand-off"]
    assert [r["path"] for r in data["placements"][0]["rows"]] == ["hand-off", "copy-limit"]
    assert all(t["met"] is None for t in data["targets"])  # host pools; and no peer, no peer ratio
    bad = run_cli("bench", "--workload", "ws-8b", "--small", "--host", "--paths", "hand-off,nope")
    assert bad.returncode == 2 and "unknown path(s) nope" in bad.stderr


def test_host_example_runs_in_two_processes(tmp_path):
    addr = str(tmp_path / "w.sock")
    env = env_with_src()
    trainer = subprocess.Popen([sys.executable, str(EXAMPLE / "trainer.py"), "--host", "--address", addr,
                                "--steps", "3"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert "waiting for an engine" in trainer.stdout.readline()
        engine = subprocess.run([sys.executable, str(EXAMPLE / "engine.py"), "--host", "--address", addr,
                                 "--steps", "3"], capture_output=True, text=True, timeout=60, env=env)
        rest, _ = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert [ln for ln in engine.stdout.splitlines() if "loaded" in ln] == [
        f"engine: loaded version {v}: ok" for v in (1, 2, 3)]
    assert trainer.returncode == 0 and "trainer: done" in rest


def _gpu_run(tmp_path, *args: str) -> dict:
    path = tmp_path / "ws.json"
    out = run_cli("bench", "--workload", *args, "--reps", "5", "--warmup", "2", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(path.read_text())


def _check_gpu_rows(pl: dict) -> None:
    rows = {r["path"]: r for r in pl["rows"]}
    for name in ("hand-off", "copy", "torch-reductions", "ipc-buckets", "expandable-segments"):
        assert rows[name]["status"] == "ok", rows[name]
        assert not rows[name].get("bad_checksums"), rows[name]
    assert rows["expandable-segments"]["in_place"] is True  # torch's pages lent, nothing copied
    assert rows["copy-limit"]["ms"]["p50"] > 0
    for name in ("hand-off", "copy"):
        for side in ("trainer", "engine"):
            m = rows[name][side]
            assert m["fds_after"] <= m["fds_before"]
            assert m["free_after"] >= m["free_before"] - (64 << 20)  # no growth beyond allocator noise


@pytest.mark.gpu
def test_gpu_small_same_gpu(tmp_path):
    data = _gpu_run(tmp_path, "ws-8b", "--small", "--devices", "0,0")
    (pl,) = data["placements"]
    _check_gpu_rows(pl)


@pytest.mark.gpu(count=2)
def test_gpu_small_both_placements(tmp_path):
    data = _gpu_run(tmp_path, "ws-moe", "--small", "--devices", "0,1")
    assert [p["placement"] for p in data["placements"]] == ["A", "B"]
    for pl in data["placements"]:
        _check_gpu_rows(pl)
    assert {t["met"] for t in data["targets"]} <= {True, False, None}


@pytest.mark.gpu
def test_gpu_example_runs_in_two_processes(tmp_path):
    pytest.importorskip("torch")
    addr = str(tmp_path / "w.sock")
    env = env_with_src()
    trainer = subprocess.Popen([sys.executable, str(EXAMPLE / "trainer.py"), "--address", addr, "--steps", "3"],
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert "waiting for an engine" in trainer.stdout.readline()
        engine = subprocess.run([sys.executable, str(EXAMPLE / "engine.py"), "--address", addr, "--steps", "3"],
                                capture_output=True, text=True, timeout=120, env=env)
        trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert "engine: loaded version 3: ok" in engine.stdout


def test_a_child_killed_by_a_signal_is_reported_as_such_not_as_echild() -> None:
    import socket
    import subprocess
    import sys

    from dmabuf_interop.cli.bench.child import Child, finish

    def child(code: str) -> Child:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
        theirs.close()
        return Child("peer", proc, ours)

    died = child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    waiting = child("import time; time.sleep(60)")
    results = [died.result(30), {"status": "ok"}]
    finish([died, waiting], 30, results)  # reaps both, kills the one left waiting
    assert results[0]["status"] == "error"
    assert "killed by SIGKILL (out of memory?)" in results[0]["reason"], results[0]
    assert died.proc.returncode == -9 and waiting.proc.returncode == -9


@pytest.mark.parametrize("workload", ["ws-8b", "ws-moe"])
def test_a_step_is_cut_into_batches_that_keep_the_order_and_end_with_the_checksums(workload: str) -> None:
    from dmabuf_interop.channel.protocol import MAX_LAYOUTS
    from dmabuf_interop.cli.bench.weight_sync import (COPY_BUCKETS, COPY_FIRST_SHARE, HANDOFF_BUCKET_ITEMS,
                                                       HANDOFF_FIRST_ITEMS, SUMS, _buckets, model_shapes, payload_bytes)

    shapes = model_shapes(workload)
    state = {n: object() for n, _ in shapes}
    state[SUMS] = object()
    handoff, copy = _buckets(state, shapes, "hand-off"), _buckets(state, shapes, "copy")
    for parts in (handoff, copy):
        assert [n for part in parts for n in part] == [n for n, _ in shapes] + [SUMS]
        assert all(part[n] is state[n] for part in parts for n in part)
    assert len(handoff[0]) == min(HANDOFF_FIRST_ITEMS, len(shapes) + 1)  # a small first batch: the engine starts early
    assert all(len(part) == HANDOFF_BUCKET_ITEMS for part in handoff[1:-1])
    assert len(handoff) == 1 + -(-max(0, len(shapes) - HANDOFF_FIRST_ITEMS) // HANDOFF_BUCKET_ITEMS)
    assert 1 < len(copy) <= COPY_BUCKETS + 1
    # copy: a small first batch, so the engine's first copy starts after a short hand-off
    sizes = dict(shapes)
    first = [2 * math.prod(sizes[n]) for n in copy[0]]
    total = payload_bytes(shapes)
    assert sum(first[:-1]) < total * COPY_FIRST_SHARE <= sum(first) < total / COPY_BUCKETS
    assert len(handoff) + len(copy) <= MAX_LAYOUTS  # every layout of a run stays known to the engine
