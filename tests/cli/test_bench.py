"""``dmabuf-interop bench``: runs on tiny sizes, checks its outputs first, speaks a validated protocol.

Timings are never asserted. The memfd mechanism needs no GPU, so its producer
and consumer run for real here; the GPU mechanisms are ``gpu``-marked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dmabuf_interop.cli._units import MAX_SIZE, parse_size, size_label
from dmabuf_interop.cli.bench import parse_sizes
from dmabuf_interop.cli.bench.catalog import MECHANISMS
from dmabuf_interop.cli.bench.protocol import SPEC, check, make
from dmabuf_interop.cli.bench.runner import PHASES
from dmabuf_interop.cli.bench.stats import percentile
from dmabuf_interop.cli.bench.targets import THROUGHPUT_PER_S
from dmabuf_interop.errors import ProtocolError
from dmabuf_interop.fdpass import recv_message, send_message
from tests.helpers import env_with_src, run_cli

TOP_KEYS = {"schema", "command", "argv", "started", "environment", "config", "mechanisms", "plot", "bandwidth",
            "python_overhead", "targets"}
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _load(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def _check_cells(mech: dict, sizes: list[int], need_total: bool = True) -> None:
    assert [c["size"] for c in mech["cells"]] == sizes
    for cell in mech["cells"]:
        assert cell["reps"] >= 1
        assert set(cell["phases_us"]) == set(PHASES)
        for phase in ("export", "transport", "export_transport"):
            stat = cell["phases_us"][phase]
            assert isinstance(stat["median"], float) and isinstance(stat["p90"], float)
        if need_total:
            assert isinstance(cell["phases_us"]["total"]["median"], float)


# --- a real run ----------------------------------------------------------------------------

def test_memfd_bench_runs_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--mechanisms", "memfd", "--sizes", "4K,0x10000", "--reps", "3", "--warmup", "1",
                  "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert "mechanism" in out.stdout and "memfd" in out.stdout and "targets:" in out.stdout
    # stderr is no terminal here: one progress line per cell
    assert "bench: memfd 4 KiB: total median" in out.stderr and "bench: memfd 64 KiB: total median" in out.stderr
    data = _load(path)
    assert TOP_KEYS <= set(data) and data["schema"] == 2
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
    assert set(data["targets"]) == {"latency", "bandwidth", "python_overhead", "channel", "first_handoff",
                                    "host", "throughput", "memory"}
    assert memfd["first_handoff_us"] > 0  # the run's very first hand-off, reported apart from the cells
    assert data["plot"] is None


def test_channel_host_bench_runs_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--mechanisms", "channel-host", "--sizes", "4K,1M", "--reps", "5",
                  "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    data = _load(path)
    assert data["config"]["mechanisms"] == ["channel-host"] and data["config"]["sizes"] == [4096, 1 << 20]
    mech = data["mechanisms"]["channel-host"]
    assert mech["status"] == "ok" and mech["kind"] == "ours", mech
    assert "devices" not in mech  # CUDA-free: a host pool
    _check_cells(mech, [4096, 1 << 20])
    for cell in mech["cells"]:
        assert cell["reps"] == 5
        assert all(len(v) == 5 for v in cell["samples_us"].values())
        # the pool was exported before t0: a hand-off exports nothing
        assert cell["samples_us"]["export"] == [0.0] * 5
        for phase in ("transport", "import_map", "first_access"):
            assert all(x >= 0 for x in cell["samples_us"][phase])
        assert cell["phases_us"]["total"]["median"] >= cell["phases_us"]["transport"]["median"]
    # the first hand-off goes through a fresh channel: connect and handshake are in it, so it is the slowest
    assert mech["first_handoff_us"] >= max(c["phases_us"]["total"]["median"] for c in mech["cells"])
    assert "first hand-off of each run" in out.stdout
    # pipelined throughput over a host pool, and its line among the targets
    tput = data["throughput"]["channel-host"]
    assert tput["status"] == "ok" and tput["per_second"] > 0 and tput["size"] == 1 << 20, tput
    assert data["targets"]["throughput"]["measured"] == {"channel-host": tput["per_second"]}
    assert data["targets"]["throughput"]["per_mechanism"] == {"channel-host": tput["per_second"] >= THROUGHPUT_PER_S}
    assert f"channel throughput >= {THROUGHPUT_PER_S:,}/s" in out.stdout
    mem = data["targets"]["memory"]["per_mechanism"]["channel-host"]
    assert mem["hand_offs"] == tput["count"] and mem["fds_grew"] == 0 and mem["met"] is True, mem
    assert 0 <= mem["pool_overhead_bytes"] <= mem["chunk_bytes"]


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_is_written(tmp_path):
    png = tmp_path / "bench.png"
    out = run_cli("bench", "--mechanisms", "memfd", "--sizes", "4K", "--reps", "1", "--warmup", "0",
                  "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 0


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed")
def test_a_plot_path_matplotlib_cannot_write_is_a_usage_error_before_the_run(tmp_path):
    """A name without an image format matplotlib writes is refused as the options are parsed, not after the run
    (which it used to end with an internal error, and no JSON)."""
    out = run_cli("bench", "--mechanisms", "memfd", "--sizes", "4K", "--reps", "1", "--warmup", "0",
                  "--plot", str(tmp_path / "bench.txt"), "--json", str(tmp_path / "b.json"))
    assert out.returncode == 2 and "cannot plot to" in out.stderr and ".png" in out.stderr, out.stderr
    assert not (tmp_path / "b.json").exists()


def test_missing_peers_are_reported_not_installed(tmp_path):
    missing = [n for n in ("torch-ipc", "cupy-ipc", "iceoryx2") if importlib.util.find_spec(MECHANISMS[n][1]) is None]
    if not missing:
        pytest.skip("torch, cupy and iceoryx2 are all installed here")
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
        if name == "iceoryx2":  # the reason says how to get it
            assert "pip install iceoryx2" in mech["reason"] and "pip install iceoryx2" in line
    assert data["targets"]["latency"]["met"] is None


# --- usage errors, reported before anything is measured -------------------------------------

def _usage_error(*args: str) -> str:
    t = time.monotonic()
    out = run_cli("bench", "--mechanisms", "memfd", "--reps", "50", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and time.monotonic() - t < 30  # no pair was started
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize("sizes", ["4K,abc", "6", "0", "", "5T", "-4K", "0o10", "0b100", "4_096", "+4096", "4097G"])
def test_bad_sizes_exit_2_with_one_line(sizes):
    assert "--sizes" in _usage_error("--sizes", sizes)


def test_json_into_a_missing_folder_is_a_usage_error(tmp_path):
    line = _usage_error("--json", str(tmp_path / "no" / "such" / "bench.json"))
    assert "--json" in line and "does not exist" in line


def test_json_onto_a_folder_is_a_usage_error(tmp_path):
    assert "is a folder" in _usage_error("--json", str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_json_into_a_read_only_folder_is_a_usage_error(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert "permission denied" in _usage_error("--json", str(folder / "bench.json"))
    finally:
        folder.chmod(0o700)


@pytest.mark.skipif(HAVE_MATPLOTLIB, reason="matplotlib is installed")
def test_plot_without_matplotlib_is_a_usage_error(tmp_path):
    line = _usage_error("--plot", str(tmp_path / "bench.png"))
    assert "--plot" in line and "matplotlib" in line and "dmabuf-interop[bench]" in line


def test_bad_mechanism_devices_and_reps_exit_2():
    for args in (("--mechanisms", "nccl"), ("--devices", "0"), ("--reps", "0"), ("--consumer-spin", "-1e-6"),
                 ("--consumer-spin", "2"), ("--consumer-spin", "fast"), ("--consumer-spin", "AUTO")):
        out = run_cli("bench", *args)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr


# --- the size parser ----------------------------------------------------------------------

def test_parse_size_forms():
    for text, value in (("4096", 4096), ("0x1000", 4096), ("4K", 4096), ("4KiB", 4096), ("4k", 4096),
                        ("4KB", 4096), ("1M", 1 << 20), ("2G", 2 << 30), ("4096G", MAX_SIZE), ("4T", MAX_SIZE)):
        assert parse_size(text) == value, text
    for text in ("0o10", "0b100", "4_096", "+4096", "-1", "", "1.5M", "4097G", "5T", "٤", " 8"):
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(text)


@given(st.integers(min_value=1, max_value=MAX_SIZE))
def test_parse_size_reads_back_decimal_and_hex(n):
    assert parse_size(str(n)) == n and parse_size(hex(n)) == n


@given(st.integers(min_value=1, max_value=4096), st.sampled_from([("K", 10), ("MiB", 20), ("G", 30)]))
def test_parse_size_units_are_binary(k, unit):
    suffix, shift = unit
    assert parse_size(f"{k}{suffix}") == k << shift


def test_parse_sizes_list_dedup_and_multiple_of_4():
    assert parse_sizes("4K,1M,64M,1G") == [4096, 1 << 20, 64 << 20, 1 << 30]
    assert parse_sizes("4KiB, 4k,4096,8") == [4096, 8]
    with pytest.raises(Exception, match="multiple of 4"):
        parse_sizes("6")


def test_percentile_and_labels():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(11))), 90) == 9.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert size_label(4096) == "4 KiB" and size_label(1 << 30) == "1 GiB" and size_label(12) == "12 B"


# --- the process protocol -----------------------------------------------------------------

CONFIG = {"mechanism": "memfd", "sizes": [4096], "reps": 1, "warmup": 0, "devices": [0, 0], "timeout": 10.0}


def test_every_kind_builds_and_checks():
    samples = {
        "config": CONFIG, "hello": {"role": "producer", "status": "ok", "versions": {}, "pid": 1},
        "rec": {"t": [1, None, None], "steps": {"cuMemCreate": 5}}, "first": {"t": [1, 2, 3]},
        "cell": {"size": 4096, "import": "ok"},
        "bw": {"result": {"size": 4096, "device": 0}}, "overhead": {"result": {}}, "done": {"role": "consumer"},
        "error": {"reason": "x", "unsupported": False}, "ready": {"size": 4096}, "handoff": {"rep": 0},
        "ack": {"rep": 0}, "pool": {}, "channel": {"address": "/tmp/x.sock"},
        "idle": {"cpu_ns": 10, "wall_ns": 1_000_000_000}, "service": {"name": "dmabuf-interop-bench/1/4096"},
    }
    assert set(samples) == set(SPEC)
    for kind, fields in samples.items():
        msg = make(kind, **fields)
        assert check(json.loads(json.dumps(msg)), kind) == msg


@pytest.mark.parametrize("msg, why", [
    ({"kind": "ack"}, "lacks 'rep'"),
    ({"kind": "ack", "rep": True}, "type bool"),
    ({"kind": "ack", "rep": "0"}, "type str"),
    ({"kind": "nope"}, "expected"),
    ({"rep": 0}, "expected"),
    ({"kind": "rec", "t": [1, 2]}, "three"),
    ({"kind": "rec", "t": [1.5, 2, 3]}, "three"),
    ({"kind": "rec", "t": [1, 2, 3], "steps": {"cuMemCreate": "fast"}}, "steps"),
    ({"kind": "hello", "role": "producer", "status": "great"}, "status"),
    ({"kind": "done", "role": "root"}, "role"),
    ({"kind": "bw", "result": {}}, "size"),
    ({**CONFIG, "kind": "config", "sizes": [4096, -1]}, "sizes"),
    ({**CONFIG, "kind": "config", "devices": [0]}, "devices"),
    ({**CONFIG, "kind": "config", "reps": 0}, "reps"),
    ({**CONFIG, "kind": "config", "spin": -1e-6}, "spin"),
    ({**CONFIG, "kind": "config", "spin": 5}, "spin"),
    ({"kind": "cell", "size": 4096, "cpu": {"loop_ns": -1}}, "cpu"),
    ({"kind": "cell", "size": 4096, "cpu": {"user_ns": 1}}, "cpu"),
    ({"kind": "idle", "cpu_ns": -1}, "nanoseconds"),
    ({"kind": "idle", "wall_ns": 1.5}, "type float"),
    ({"kind": "service"}, "lacks 'name'"),
])
def test_malformed_messages_are_protocol_errors(msg, why):
    kinds = (msg["kind"],) if msg.get("kind") in SPEC else ("ack",)
    with pytest.raises(ProtocolError, match=why):
        check(msg, *kinds)


def _peer(role: str, config: dict) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Start a real benchmark child on socketpairs, send ``config`` on CTL, collect its reports."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    ours, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    fds = [s.fileno() for s in theirs]
    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop.cli.bench.peers", role, *map(str, fds)],
                            pass_fds=fds, env=env_with_src(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for s in theirs:
        s.close()
    for s in ours[1:]:
        s.close()  # no consumer: the child's PC and AUX peers are gone
    reports = []
    try:
        send_message(ours[0], config)
        while True:
            try:
                reports.append(recv_message(ours[0], 30, max_fds=0)[0])
            except Exception:  # noqa: BLE001 - EOF: the child is done
                break
        out, err = proc.communicate(timeout=30)
    finally:
        ours[0].close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), reports


def test_a_child_refuses_a_malformed_config_in_one_line():
    done, reports = _peer("consumer", {"kind": "config", **CONFIG, "sizes": ["4K"]})
    assert done.returncode == 2 and reports == []
    assert done.stderr.strip().count("\n") == 0 and "config: sizes" in done.stderr, done.stderr


def test_a_child_reports_an_unknown_mechanism_as_a_set_up_error():
    done, reports = _peer("producer", make("config", **{**CONFIG, "mechanism": "nccl"}))
    assert done.returncode == 1, done.stderr
    (hello,) = reports
    assert check(hello, "hello")["status"] == "error" and "unknown mechanism 'nccl'" in hello["reason"]


def test_a_producer_whose_consumer_is_gone_reports_an_error():
    """The consumer never answers (its socket closes): the producer says so on CTL and exits 1."""
    done, reports = _peer("producer", make("config", **CONFIG))
    assert done.returncode == 1, done.stderr
    kinds = [check(r, "hello", "error")["kind"] for r in reports]
    assert kinds == ["hello", "error"] and "PeerClosedError" in reports[1]["reason"]


# --- GPU ----------------------------------------------------------------------------------

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
    # the breakdown comes from set_observer: keys are driver call names
    breakdown = mechs["posix-fd"]["cells"][0]["breakdown_us"]
    assert "cuMemExportToShareableHandle" in breakdown["producer_export"]
    assert "cuMemImportFromShareableHandle" in breakdown["consumer_import_map"]
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
    cyc = data["python_overhead"]["posix_fd_cycle"]
    assert cyc["library_median_us"] > 0 and cyc["raw_median_us"] > 0
    assert cyc["library_driver_calls"]["cuMemCreate"] == 1 and cyc["library_driver_calls"]["cuMemMap"] == 2
    split = cyc["library_split_us"]
    assert set(split) == {"total", "driver_calls", "context_calls", "python"} and split["driver_calls"] > 0
    assert set(cyc["raw_split_us"]) == {"total", "fd_close", "python"}
    dma = data["python_overhead"]["dmabuf_export"]
    assert "overhead" in dma or dma["status"].startswith("unsupported")
    po = data["targets"]["python_overhead"]
    assert po["met"] in (True, False) and ("dmabuf_ratio" in po) == ("overhead" in dma)


@pytest.mark.gpu
def test_gpu_channel_bench_runs(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--mechanisms", "channel,channel-socket,channel-host", "--sizes", "4K,1M", "--reps", "3",
                  "--warmup", "2", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    data = _load(path)
    mechs = data["mechanisms"]
    for name in ("channel", "channel-socket", "channel-host"):
        assert mechs[name]["status"] == "ok", mechs[name]
        _check_cells(mechs[name], [4096, 1 << 20])
    assert mechs["channel"]["devices"] == mechs["channel-socket"]["devices"] == {"producer": 0, "consumer": 0}
    tput = data["throughput"]
    assert tput["channel"]["status"] == "ok" and tput["channel"]["per_second"] > 0, tput
    # the device pool's channel with its shared-memory ring where this machine has it, and without it
    ring = data["environment"]["channel_ring"]["available"]
    assert mechs["channel"]["ring"] is ring and tput["channel"]["ring"] is ring
    assert mechs["channel-socket"]["ring"] is False and tput["channel-socket"]["ring"] is False
    assert all(c["ring"] is False for c in mechs["channel-socket"]["cells"])


@pytest.mark.gpu(count=2)
def test_gpu_channel_cross_device_pair(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--devices", "0,1", "--mechanisms", "channel", "--sizes", "4K", "--reps", "2",
                  "--warmup", "2", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    mech = _load(path)["mechanisms"]["channel"]
    assert mech["status"] == "ok", mech
    assert mech["devices"] == {"producer": 0, "consumer": 1}
    _check_cells(mech, [4096])


@pytest.mark.gpu(count=2)
def test_gpu_cross_device_pair(tmp_path):
    path = tmp_path / "bench.json"
    out = run_cli("bench", "--devices", "0,1", "--mechanisms", "posix-fd,posix-fd-cached,cuda-core-ipc",
                  "--sizes", "4K", "--reps", "2", "--warmup", "2", "--json", str(path), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    data = _load(path)
    for name in ("posix-fd", "posix-fd-cached"):
        assert data["mechanisms"][name]["status"] == "ok"
        assert data["mechanisms"][name]["devices"] == {"producer": 0, "consumer": 1}
    b = data["bandwidth"]["sizes"][0]
    assert b["peer_device"] == 1 and b["cross_import"]["gbps"] > 0 and "memcpy_peer" in b


@pytest.mark.nixl
def test_remote_bench_on_loopback(tmp_path) -> None:
    path = tmp_path / "remote.json"
    out = run_cli("bench", "--remote", "--sizes", "64K,1M", "--reps", "3", "--warmup", "1", "--json", str(path),
                  extra_env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NIXL INFO" not in out.stdout  # NIXL's agent log stays off the report
    assert "tcp:// channel vs bare NIXL READ vs local channel" in out.stdout and "1 MiB" in out.stdout
    report = _load(path)
    assert report["ucx_tls"] == "tcp" and report["ucx_net_devices"] == "lo" and report["overhead_target_pct"] == 10
    assert [r["bytes"] for r in report["rows"]] == [64 << 10, 1 << 20]
    for row in report["rows"]:
        assert row["reps"] == 3 and row["channel_gbs"] > 0 and row["nixl_gbs"] > 0 and row["local_gbs"] > 0


LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@pytest.mark.nixl
def test_remote_bench_shows_progress_on_stderr() -> None:
    out = run_cli("bench", "--remote", "--sizes", "64K,128K", "--reps", "3", "--warmup", "1", extra_env=LOOPBACK)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("bench: ")]
    assert lines and "sizes 64 KiB,128 KiB, 3 reps after 1 warm-up(s)" in lines[0], out.stderr
    for what in ("tcp:// channel", "bare NIXL READ", "local channel"):
        assert any(ln.startswith(f"bench: [") and what in ln and "starting" in ln for ln in lines), (what, lines)
        for label in ("64 KiB", "128 KiB"):  # one line per size, as the default bench gives per cell
            assert any(f"{what} {label}: median" in ln and "GB/s" in ln and "spread" in ln for ln in lines), lines


@pytest.mark.nixl
def test_remote_bench_reports_the_spread_and_what_the_local_column_measures(tmp_path) -> None:
    path = tmp_path / "remote.json"
    out = run_cli("bench", "--remote", "--sizes", "64K", "--reps", "5", "--warmup", "1", "--json", str(path),
                  extra_env=LOOPBACK)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no bytes move" in out.stdout and "spread" in out.stdout, out.stdout
    (row,) = _load(path)["rows"]
    assert set(row["spread_pct"]) == {"channel", "nixl", "local"}, row
    assert all(v >= 0 for v in row["spread_pct"].values()) and row["overhead_uncertainty_pct"] >= 0
    assert row["met"] in (True, False, None)
    assert f"{row['spread_pct']['channel']:.0f}%" in out.stdout  # the table shows what the JSON holds


def test_remote_verdict_is_unclear_while_the_spread_covers_the_target() -> None:
    from dmabuf_interop.cli.bench.stats import Stats
    from dmabuf_interop.cli.bench.targets import OVERHEAD_TARGET_PCT, remote_verdict

    def reads(median: float, width: float, n: int = 20) -> Stats:
        return Stats.of([median - width / 2 + width * i / (n - 1) for i in range(n)])

    nixl = reads(1.0, 0.02)
    clear_ok, clear_bad = reads(0.99, 0.02), reads(0.70, 0.02)
    assert remote_verdict(clear_ok, nixl)[2] is True
    assert remote_verdict(clear_bad, nixl)[2] is False
    near = reads(1 - OVERHEAD_TARGET_PCT / 100, 0.6, n=3)  # at the target, reads spread over 60%
    overhead, uncertainty, met = remote_verdict(near, reads(1.0, 0.6, n=3))
    assert abs(overhead - OVERHEAD_TARGET_PCT) < 1 and uncertainty > 5 and met is None


def test_remote_bench_refuses_a_workload_and_notes_what_it_ignores(tmp_path) -> None:
    out = run_cli("bench", "--remote", "--workload", "ws-8b", "--reps", "1")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
    assert "--workload" in out.stderr and "--remote" in out.stderr and "error" in out.stderr
    # options that have no meaning for --remote are named (they were ignored without a word)
    plot = ["--plot", str(tmp_path / "p.png")] if HAVE_MATPLOTLIB else []
    out = run_cli("bench", "--remote", *plot, "--devices", "0,1", "--paths", "copy", "--sizes", "4K", "--reps", "1",
                  "--warmup", "0", extra_env=LOOPBACK)
    assert out.returncode == 0, out.stdout + out.stderr
    ignored = "--devices, --plot, --paths" if plot else "--devices, --paths"
    assert f"note: {ignored} do not apply to --remote; ignored" in out.stderr, out.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.nixl
def test_interrupted_remote_bench_exits_quietly() -> None:
    """Ctrl-C during the reads: the exit line is the last thing written, and no process is left."""
    import signal

    env = {**env_with_src(), **LOOPBACK}
    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop", "bench", "--remote", "--sizes", "1M",
                             "--reps", "100000", "--timeout", "30"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    try:
        deadline = time.monotonic() + 20
        while b"tcp:// channel: starting" not in seen and time.monotonic() < deadline:  # the reads begin
            if select.select([proc.stderr], [], [], 1)[0]:
                chunk = os.read(proc.stderr.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = seen.decode() + err
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == "dmabuf-interop: interrupted", err[-3000:]
    lines = err.strip().splitlines()  # progress, then the exit line: no traceback, no UCX warning
    assert all(ln.startswith("bench: ") for ln in lines[:-1]), err[-3000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left


def test_options_that_do_not_apply_get_one_note_line():
    out = run_cli("bench", "--small", "--mechanisms", "memfd", "--sizes", "4K", "--reps", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    assert "note: --small does not apply without --workload; ignored" in out.stderr
    out = run_cli("bench", "--paths", "copy", "--mechanisms", "memfd", "--sizes", "4K", "--reps", "1", "--warmup", "0")
    assert out.returncode == 0, out.stderr
    assert "note: --paths does not apply without --workload; ignored" in out.stderr
    out = run_cli("bench", "--workload", "ws-8b", "--small", "--host", "--sizes", "4K", "--reps", "1",
                  "--warmup", "0", "--consumer-spin", "1e-5")
    assert out.returncode == 0, out.stderr
    assert "note: --sizes, --consumer-spin do not apply to --workload; ignored" in out.stderr


@pytest.mark.parametrize("to_group", [True, False], ids=["ctrl-c", "sigint-to-parent"])
def test_interrupted_bench_ends_its_children_at_once_without_tracebacks(to_group: bool) -> None:
    import signal

    from tests.helpers import env_with_src

    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop", "bench", "--mechanisms", "channel-host",
                             "--sizes", "4K", "--reps", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_with_src(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(3)  # the producer and consumer are handing off
        t = time.monotonic()
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and took < 10, (proc.returncode, took, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "dmabuf-interop: interrupted"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left


def test_source_revision_names_the_commit_and_local_changes_of_the_package_that_ran(tmp_path) -> None:
    import shutil

    import dmabuf_interop

    repo = tmp_path / "repo"
    shutil.copytree(os.path.dirname(dmabuf_interop.__file__), repo / "src" / "dmabuf_interop",
                    ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()

    def revision(src) -> object:
        code = "import json; from dmabuf_interop.cli.bench.environment import _git_revision; print(json.dumps(_git_revision()))"
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(src)},
                             cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout)

    assert revision(repo / "src") == {"commit": head, "src_modified": False}
    with open(repo / "src" / "dmabuf_interop" / "errors.py", "a") as f:
        f.write("# a local change\n")
    assert revision(repo / "src") == {"commit": head, "src_modified": True}
    (repo / ".gitignore").write_text("copy/\n")
    shutil.copytree(repo / "src", repo / "copy" / "src")  # an untracked copy inside the work tree: not this commit
    assert revision(repo / "copy" / "src") is None
