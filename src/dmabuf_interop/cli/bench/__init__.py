"""``dmabuf-interop bench``: what it costs to hand a buffer from one process to another.

For each mechanism (:mod:`.catalog`) and size the parent (:mod:`.runner`)
starts a producer and a consumer (:mod:`.peers`); both create their CUDA
context and load their kernels (:mod:`.reader`) before anything is timed,
then hand a buffer over ``--warmup`` + ``--reps`` times (:mod:`.protocol`).
The channel runs with its shared-memory ring (``channel``, ``channel-host``) and without it
(``channel-socket``, ``channel-host-socket``: ``ring=False``), and each run's JSON says whether the
connection used the ring (``Channel.ring``); a run that asked for the ring and did not get it is flagged
on stderr and in the table, never passed off as the ring's figures.
``--consumer-spin`` measures the mechanisms whose consumer can poll before it sleeps
(:data:`.catalog.SPINNING`: the channels and iceoryx2, :mod:`.iceoryx`) a second time with a spinning
consumer. Each cell also carries both sides' CPU time per hand-off, and those mechanisms the CPU time
of a consumer waiting with nothing sent. Pipelined throughput follows (:mod:`.throughput`).
With a GPU, a last pair measures read bandwidth through a POSIX-fd import
(:mod:`.bandwidth`) and the library's Python overhead (:mod:`.overhead`).
:mod:`.targets` holds every pass/fail target and judges a run, :mod:`.report`
prints the table and the verdicts, and writes ``--json`` and ``--plot``; output
paths are checked before anything is measured. Children are started and heard
through :mod:`.child`; every statistic is a :class:`.stats.Stats`.
``--workload`` runs the weight-sync workload (:mod:`.weight_sync`) instead, and
``--remote`` a tcp:// channel through NIXL against a bare NIXL READ loop (:mod:`.remote`).

Exit status: 0 when the benchmark ran (mechanisms that are not installed or
not supported are reported, not failures), 1 when a mechanism failed, 2 for a
usage error (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys
import time
from typing import Any, Callable

from .._units import GiB, KiB, MiB, seconds_argument, size_label, word_size_argument
from .catalog import CHANNELS, CUDA_FREE, INSTALL, MECHANISMS, SPINNING, THROUGHPUT
from .report import JSON_SCHEMA

__all__ = ["add_arguments", "main", "parse_sizes", "DEFAULT_SIZES"]

DEFAULT_SIZES = (4 * KiB, MiB, 64 * MiB, GiB)


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M,64M,1G"`` -> byte counts, duplicates dropped (each entry as
    :func:`~.._units.word_size_argument`).

    Raises:
        argparse.ArgumentTypeError: an empty list, or an entry :func:`~.._units.word_size_argument`
            refuses (a bad form, 0, not a multiple of 4 bytes: the read kernel reads 32-bit words).
    """
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        n = word_size_argument(part)
        if n not in out:
            out.append(n)
    return out


def _mechanisms(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(MECHANISMS)
    bad = [n for n in names if n not in MECHANISMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown mechanism {', '.join(bad) or text!r}: choose from "
                                         f"{', '.join(MECHANISMS)} (comma-separated) or all")
    return list(dict.fromkeys(names))


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"invalid count {value}: must be >= {minimum}")
        return value
    return parse


def _spin_seconds(text: str) -> float | str:
    if text == "auto":
        return "auto"  # the channels' adaptive spin (Channel.spin = "auto")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid --consumer-spin {text!r}: expected seconds") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"invalid --consumer-spin {text!r}: must be 0 to 1 seconds")
    return value


def _devices(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*([0-9]+)\s*,\s*([0-9]+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid --devices {text!r}: expected PRODUCER,CONSUMER ordinals, e.g. 0,1")
    return int(m.group(1)), int(m.group(2))


def output_path(text: str) -> str:
    """An output file that can be written: its folder exists and is writable, the path is no folder.

    Checked when the options are parsed, so a typo costs nothing, not a finished run.

    Raises:
        argparse.ArgumentTypeError: the folder is missing or unwritable, or the path is a folder.
    """
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def _plot_path(text: str) -> str:
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib, which is not installed "
                                         "(pip install 'dmabuf-interop[bench]')")
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()  # (checked here: not after a long run)
    ext = os.path.splitext(text)[1].lstrip(".").lower()
    if ext not in kinds:
        raise argparse.ArgumentTypeError(f"cannot plot to {text!r}: name a file ending in one of "
                                         f"{', '.join('.' + k for k in sorted(kinds))}")
    return output_path(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    p.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES),
                   help="comma-separated buffer sizes: bytes, 0x hex or K/M/G binary units, multiples of 4 "
                        "(default 4K,1M,64M,1G)")
    p.add_argument("--reps", type=_count(1), default=20, help="timed repetitions per size (default 20)")
    # 10, not 3: a hand-off in a fresh Python process slows the first 4 to 6 repetitions after 3 warm-ups (the
    # interpreter specialising the path, caches), which a 50-repetition p99 then measures instead of the steady state.
    p.add_argument("--warmup", type=_count(0), default=10, help="untimed repetitions first (default 10)")
    p.add_argument("--mechanisms", type=_mechanisms, default=list(MECHANISMS),
                   help=f"comma-separated, default all: {','.join(MECHANISMS)}")
    p.add_argument("--consumer-spin", type=_spin_seconds, default=0.0, metavar="SECONDS|auto",
                   help=f"also measure {', '.join(SPINNING)} with a consumer that polls for up to SECONDS before "
                        "it sleeps (the channel's Channel.spin, reported unsupported where the channel has no such "
                        "attribute; iceoryx2 polls Subscriber.receive), e.g. 50e-6; 'auto': the channels' "
                        "adaptive spin (iceoryx2 has none: its run is reported unsupported); 0 (default): blocking "
                        "consumers only")
    p.add_argument("--devices", type=_devices, default=(0, 0), metavar="P,C",
                   help="CUDA ordinals of the producer and the consumer (default 0,0)")
    p.add_argument("--json", type=output_path, metavar="PATH",
                   help="write every number and the environment as JSON")
    p.add_argument("--plot", type=_plot_path, metavar="PATH.png",
                   help="log-log plot of median hand-off latency vs size "
                        "(needs matplotlib: pip install 'dmabuf-interop[bench]')")
    p.add_argument("--timeout", type=seconds_argument, default=300.0,
                   help="seconds to wait for the next record from a benchmark process; a record comes after all "
                        "repetitions of one size, so allow for --reps (default 300)")
    p.add_argument("--remote", action="store_true",
                   help="tcp:// channel through NIXL on loopback (host memory) against a bare NIXL READ loop and "
                        "a local channel: median GB/s and spread per --sizes, --reps timed reads after --warmup "
                        "(needs NIXL; not with --workload)")
    from .weight_sync import add_arguments as add_workload_arguments

    add_workload_arguments(p)


def _note_ignored(args: argparse.Namespace) -> None:
    """One ``note:`` line on stderr for options that do not apply to the run asked for."""
    from .weight_sync import PATHS

    if getattr(args, "workload", None):
        given = [o for o, v, d in (("--sizes", args.sizes, list(DEFAULT_SIZES)),
                                   ("--mechanisms", args.mechanisms, list(MECHANISMS)),
                                   ("--consumer-spin", getattr(args, "consumer_spin", 0.0), 0.0)) if v != d]
        where = "--workload"
    elif getattr(args, "remote", False):
        given = [o for o, v in (("--mechanisms", args.mechanisms != list(MECHANISMS)),
                                ("--devices", tuple(args.devices) != (0, 0)), ("--plot", bool(args.plot)),
                                ("--consumer-spin", bool(getattr(args, "consumer_spin", 0.0))),
                                ("--small", getattr(args, "small", False)), ("--host", getattr(args, "host", False)),
                                ("--paths", tuple(getattr(args, "paths", PATHS)) != PATHS))
                 if v]
        where = "--remote"
    else:
        given = [o for o, v in (("--small", getattr(args, "small", False)), ("--host", getattr(args, "host", False)),
                                ("--paths", tuple(getattr(args, "paths", PATHS)) != PATHS))
                 if v]
        where = "without --workload"
    if given:
        print(f"dmabuf-interop: note: {', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply "
              f"{where if where.startswith('without') else 'to ' + where}; ignored", file=sys.stderr)


def _ring_use(name: str, used: bool | None, env: dict[str, Any], progress: Any, label: str) -> dict[str, Any]:
    """The JSON fields that say whether channel run ``name`` used the shared-memory ring: ``ring`` (``used``;
    ``None``: nothing reported it), and ``ring_missing`` (why not) where ``name`` asked for the ring and ran on
    the socket alone, said on stderr too; ``{}`` for other mechanisms. ``error`` where ``name`` refused the
    ring and the connection uses it all the same."""
    if name not in CHANNELS or used is None:
        return {}
    out: dict[str, Any] = {"ring": used}
    if CHANNELS[name] and not used:
        why = env["channel_ring"]["reason"] or "the two ends did not agree on it"
        out["ring_missing"] = why
        progress.say(f"{label}: WARNING: no shared-memory ring ({why}): these are the socket path's figures")
    elif used and not CHANNELS[name]:
        out["error"] = "listen and connect were given ring=False, yet the connection uses the shared-memory ring"
    return out


def _measure(name: str, cfg: dict[str, Any], runnable: list[str], env: dict[str, Any], progress: Any,
             label: str) -> dict[str, Any]:
    """One mechanism's entry of the JSON ``mechanisms`` (or ``spinning``): run in a fresh pair, or why not."""
    from .environment import installed
    from .runner import run_pair

    kind, module, what = MECHANISMS[name]
    entry: dict[str, Any] = {"kind": kind, "description": what, "cells": []}
    if not installed(module):
        hint = f" ({INSTALL[module]})" if module in INSTALL else ""
        entry.update(status="not installed", reason=f"{module} is not installed{hint}")
        progress.say(f"{label}: not installed: {module}{hint}")
    elif name not in runnable:
        entry.update(status="skipped", reason=env["cuda"]["reason"])
        progress.say(f"{label}: skipped: {env['cuda']['reason']}")
    else:
        progress.say(f"{label}: starting producer and consumer")
        t = time.monotonic()
        res = run_pair(name, cfg, progress, label=label.split("] ", 1)[-1])
        entry.update(status=res["status"], reason=res["reason"], cells=res["cells"],
                     versions=res["versions"], seconds=round(time.monotonic() - t, 1))
        if "spin" in cfg:
            entry["consumer_spin_s"] = cfg["spin"]
        for key in ("first_handoff_us", "idle"):
            if res.get(key) is not None:
                entry[key if key != "idle" else "idle_consumer"] = res[key]
        if name not in CUDA_FREE:
            entry["devices"] = {"producer": cfg["devices"][0], "consumer": cfg["devices"][1]}
        rings = [c["ring"] for c in res["cells"] if "ring" in c]
        ring = _ring_use(name, all(rings) if rings else None, env, progress, label)
        if "error" in ring:
            entry.update(status="error", reason=ring.pop("error"))
        entry.update(ring)
        imports = sorted({c["import"] for c in res["cells"] if "import" in c})
        if imports:
            entry["import"] = "; ".join(imports)
    return entry


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by the parsed ``bench`` options; returns the exit status."""
    if getattr(args, "remote", False) and getattr(args, "workload", None):
        print("dmabuf-interop: error: --remote and --workload are two different benchmarks: give one "
              "(see dmabuf-interop bench --help)", file=sys.stderr)
        return 2
    _note_ignored(args)
    if getattr(args, "remote", False):
        from .remote import bench as remote_bench

        return remote_bench(args)
    if getattr(args, "workload", None):
        from .weight_sync import main as workload_main

        return workload_main(args)
    from . import report
    from .environment import environment, installed
    from .progress import Progress
    from .runner import run_pair
    from .targets import bench_targets

    sizes: list[int] = args.sizes
    names: list[str] = args.mechanisms
    producer, consumer = args.devices
    env = environment()
    cuda_ok = env["cuda"]["available"]
    ndev = len(env["gpus"])
    if cuda_ok and any(n not in CUDA_FREE for n in names) and (producer >= ndev or consumer >= ndev):
        print(f"dmabuf-interop: error: --devices {producer},{consumer} out of range: this machine has "
              f"{ndev} CUDA device(s)", file=sys.stderr)
        return 2
    cfg = {"sizes": sizes, "reps": args.reps, "warmup": args.warmup, "devices": [producer, consumer],
           "timeout": args.timeout}
    results: dict[str, Any] = {
        "schema": JSON_SCHEMA,
        "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
        "argv": list(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": env,
        "config": {**cfg, "mechanisms": names, "size_labels": [size_label(s) for s in sizes]},
        "mechanisms": {},
        "plot": None,
    }
    runnable = [n for n in names if installed(MECHANISMS[n][1]) and (cuda_ok or n in CUDA_FREE)]
    spin: float | str = args.consumer_spin
    spinners = [n for n in names if n in SPINNING and n in runnable] if spin == "auto" or spin > 0 else []
    results["config"]["consumer_spin"] = spin
    progress = Progress((len(runnable) + len(spinners)) * len(sizes))
    progress.say(f"{len(names)} mechanism(s), sizes {','.join(size_label(s) for s in sizes)}, {args.reps} reps "
                 f"after {args.warmup} warm-ups" + (f", producer GPU {producer}, consumer GPU {consumer}"
                                                    if cuda_ok else "")
                 + (f"; then {', '.join(spinners)} with the consumer spinning "
                    f"{'adaptively (spin auto)' if spin == 'auto' else f'up to {spin:g} s'}" if spinners else ""))
    failed = False
    try:
        for i, name in enumerate(names, 1):
            entry = _measure(name, cfg, runnable, env, progress, f"[{i}/{len(names)}] {name}")
            results["mechanisms"][name] = entry
            failed = failed or entry["status"] == "error"
        results["spinning"] = {}
        for i, name in enumerate(spinners, 1):
            entry = _measure(name, {**cfg, "spin": spin}, runnable, env, progress,
                             f"[{i}/{len(spinners)}] {name}, consumer spinning")
            results["spinning"][name] = entry
            failed = failed or entry["status"] == "error"
        results["throughput"] = {}
        for name in THROUGHPUT:
            if name in runnable and results["mechanisms"][name].get("status") == "ok":
                from .throughput import measure

                progress.say(f"{name} throughput: 1 MiB blocks, pipelined")
                tput = measure(name, (producer, consumer), timeout=args.timeout)
                ring = _ring_use(name, tput.get("ring"), env, progress, f"{name} throughput")
                if "error" in ring:
                    tput = {"status": "error", "reason": ring.pop("error")}
                    failed = True
                results["throughput"][name] = {**tput, **ring}
        if cuda_ok and ("posix-fd" in names or "posix-fd-cached" in names):
            progress.say("bandwidth and Python overhead: starting producer and consumer")
            res = run_pair("_bandwidth", cfg, progress)
            results["bandwidth"] = {"status": res["status"], "reason": res["reason"], "sizes": res["bandwidth"],
                                    "kernel": "read_all: grid-stride 16-byte loads, XOR-reduced, "
                                              "timed with CUDA events; GB/s = 1e9 bytes/s"}
            results["python_overhead"] = res["overhead"]
            failed = failed or res["status"] == "error"
        else:
            why = "no CUDA driver" if not cuda_ok else "measured with posix-fd or posix-fd-cached in --mechanisms"
            results["bandwidth"] = {"status": "skipped", "reason": why, "sizes": []}
            results["python_overhead"] = None
    finally:
        progress.close()
    results["targets"] = bench_targets(results)
    report.print_table(results)
    if args.plot:
        why = report.plot(results, args.plot)
        results["plot"] = {"path": None, "skipped": why} if why else {"path": args.plot}
        progress.say(f"plot skipped: {why}" if why else f"wrote {args.plot}")
    if args.json:
        report.write_json(results, args.json)
        progress.say(f"wrote {args.json}")
    return 1 if failed else 0
