"""What a run reports: the table on stdout, the verdicts of :mod:`.targets`, the plot, the JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from .._units import MiB, size_label
from .catalog import MECHANISMS
from .targets import (BANDWIDTH_RATIO, CHANNEL_RATIO, CHANNEL_SPIN_RATIO, CHANNEL_TAIL, DMABUF_EXPORT_RATIO,
                      FIRST_HANDOFF_RATIO, HOST_RATIO, LATENCY_RATIO, POSIX_FD_OVERHEAD, THROUGHPUT_PER_S,
                      cell_median, ratio)

__all__ = ["JSON_SCHEMA", "fmt", "print_table", "print_targets", "pyplot", "plot", "write_json"]

#: Version of the ``--json`` layout (2: keys of ``breakdown_us`` and of the overhead splits are driver
#: call names and observer-based parts).
JSON_SCHEMA = 2


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"



def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("MET" if met else "NOT MET")


def _channel_mode(fig: dict[str, Any]) -> str:
    """One consumer mode's figures of the channel target: ratio to torch-ipc, p99 spread, against posix-fd-cached."""
    pfd = fig["posix_fd_cached_us"]
    if pfd is None:
        vs = ""
    else:
        vs = f", {fmt(fig['median_us'])} {'<=' if fig['at_or_below_posix_fd_cached'] else '>'} {fmt(pfd)} us"
    return f"{fig['ratio']:.2f}x (p99 {fig['p99_over_median']:.1f}x{vs})"


def _cpu_table(results: dict[str, Any], w: Any) -> None:
    """Each run's hand-off median and p99 beside both sides' CPU time per hand-off, blocking and spinning
    consumers, and the CPU of a consumer that waited with nothing sent."""
    runs = [(name, "blocking", m) for name, m in results["mechanisms"].items()]
    spinning = results.get("spinning", {})
    runs += [(name, "spinning", m) for name, m in spinning.items()]
    runs.sort(key=lambda r: list(results["mechanisms"]).index(r[0]))  # a mechanism's two modes together
    if not any(c.get("cpu_us_per_handoff") for _, _, m in runs for c in m.get("cells", [])) and not spinning:
        return
    spin = results["config"].get("consumer_spin") or 0
    w(f"\nhand-off (total) median and p99, us; CPU us per hand-off of each side's process over the timed "
      f"repetitions (in parentheses: inside send / recv, a consumer's wait included); path: a channel's "
      f"shared-memory ring or its socket alone; consumer blocking"
      + ((", or spinning adaptively (Channel.spin = 'auto')" if spin == "auto" else
          f", or spinning up to {spin * 1e6:g} us before it sleeps") if spinning else "") + ":\n")
    w(f"{'mechanism':<20}{'consumer':>9}{'size':>8}{'median':>9}{'p99':>9}{'CPU producer':>16}{'CPU consumer':>16}"
      f"{'path':>8}\n")
    for name, mode, m in runs:
        if m["status"] != "ok" and not m.get("cells"):
            w(f"{name:<20}{mode:>9}  {m['status']}: {m.get('reason') or ''}\n")
            continue
        for c in m["cells"]:
            st = c["phases_us"].get("total") or c["phases_us"]["export_transport"]
            cpu = c.get("cpu_us_per_handoff") or {}
            sides = [f"{fmt(cpu[s]['loop'])} ({fmt(cpu[s]['handoff'])})" if s in cpu else "-"
                     for s in ("producer", "consumer")]
            path = "" if "ring" not in c else "ring" if c["ring"] else "socket"
            w(f"{name:<20}{mode:>9}{c['label']:>8}{fmt(st['median']):>9}{fmt(st['p99']):>9}"
              f"{sides[0]:>16}{sides[1]:>16}{path:>8}\n".rstrip() + "\n")
        if m["status"] != "ok":
            w(f"{name:<20}{mode:>9}  {m['status']}: {m.get('reason') or ''}\n")
        if m.get("ring_missing"):
            w(f"{name:<20}{mode:>9}  NO shared-memory ring ({m['ring_missing']}): the socket path's figures\n")
    idle = [f"{name} {mode} {m['idle_consumer']['cpu_pct']:g}%" for name, mode, m in runs if m.get("idle_consumer")]
    if idle:
        wall = next(m["idle_consumer"]["wall_s"] for _, _, m in runs if m.get("idle_consumer"))
        w(f"consumer CPU while waiting {wall:g} s with nothing sent: {', '.join(idle)}\n")


def print_table(results: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    cfg = results["config"]
    env = results["environment"]
    p, c = cfg["devices"]
    gpu = {g["ordinal"]: g["name"] for g in env.get("gpus", [])}
    where = (f"producer GPU {p} ({gpu.get(p, '?')}), consumer GPU {c} ({gpu.get(c, '?')})"
             if env.get("gpus") else "no CUDA GPU")
    w = file.write
    w(f"dmabuf-interop bench: {where}; {cfg['reps']} reps after {cfg['warmup']} warm-ups; "
      f"median/p90 in microseconds\n\n")
    cols = ("export", "transport", "import_map", "first_access", "total")
    heads = ("export", "transport", "import+map", "1st access", "total")
    w(f"{'mechanism':<20}{'size':>8}  " + "".join(f"{h:>15}" for h in heads) + "\n")
    for name, m in results["mechanisms"].items():
        if m["status"] != "ok" and not m.get("cells"):
            w(f"{name:<20}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
            continue
        for cell in m["cells"]:
            row = f"{name:<20}{cell['label']:>8}  "
            for col in cols:
                st = cell["phases_us"].get(col)
                if st is None and col in ("import_map", "first_access"):
                    row += f"{'unsupported' if 'unsupported' in cell.get('import', '') else '-':>15}"
                elif st is None and col == "total":
                    et = cell["phases_us"]["export_transport"]
                    row += f"{'(' + fmt(et['median']) + '/' + fmt(et['p90']) + ')':>15}"
                else:
                    row += f"{fmt(st['median']) + '/' + fmt(st['p90']):>15}" if st else f"{'-':>15}"
            w(row.rstrip() + "\n")
        if m["status"] != "ok":
            w(f"{name:<20}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
        if m.get("ring_missing"):
            w(f"{name:<20}{'':>8}  NO shared-memory ring ({m['ring_missing']}): the socket path's figures\n")
        notes = sorted({c["import"] for c in m["cells"] if c.get("import") and c["import"] != "ok"})
        for note in notes:
            w(f"{'':<20}{'':>8}  import {note}; total in parentheses is export+transport only\n")
    _cpu_table(results, w)
    bw = results.get("bandwidth") or {}
    if bw.get("sizes"):
        first = bw["sizes"][0]
        d, x = first["device"], first.get("peer_device")
        w(f"\nread kernel bandwidth, GB/s (median of {max(3, cfg['reps'])}):\n")
        head = f"{'size':>8}  {'import GPU' + str(d):>14}{'native GPU' + str(d):>14}{'ratio':>8}"
        if x is not None:
            head += f"{'GPU' + str(x) + ' import':>16}{'cuMemcpyPeer':>14}{'ratio':>8}"
            w(f"(GPU{x} import: a kernel on GPU{x} reads GPU{d}'s memory through the import; cuMemcpyPeer: "
              f"GPU{d} -> GPU{x}, peer access enabled, best source)\n")
        w(head + "\n")
        for b in bw["sizes"]:
            r = ratio(b.get("import"), b.get("native"))
            line = (f"{size_label(b['size']):>8}  {b['import']['gbps']:>14.1f}{b['native']['gbps']:>14.1f}"
                    f"{r:>8.3f}")
            if b.get("cross_import") and b.get("memcpy_peer"):
                line += (f"{b['cross_import']['gbps']:>16.1f}{b['memcpy_peer']['gbps']:>14.1f}"
                         f"{ratio(b['cross_import'], b['memcpy_peer']):>8.3f}")
            w(line + ("" if b.get("verified", True) else "  (pattern NOT verified)") + "\n")
    elif bw.get("status") and bw["status"] != "ok":
        w(f"\nbandwidth: {bw['status']}: {bw.get('reason') or ''}\n")
    ov = results.get("python_overhead") or {}
    if ov.get("posix_fd_cycle"):
        w(f"\nPython overhead (median of {ov['iterations']}, {size_label(ov['bytes'])}):\n")
        for key, what in (("posix_fd_cycle", "POSIX-fd export+import+release"), ("dmabuf_export", "dma-buf export+close")):
            o = ov.get(key) or {}
            if "overhead" in o:
                w(f"  {what}: library {fmt(o['library_median_us'])} us, same driver calls in a loop "
                  f"{fmt(o['raw_median_us'])} us: {o['overhead'] * 100:+.1f}% "
                  f"({sum(o['library_driver_calls'].values())} checked driver calls vs {o['raw_driver_calls']})\n")
                pw = o.get("pairwise_overhead")
                if pw:
                    w(f"    per-iteration pairs: p10 {pw['p10'] * 100:+.1f}%, median {pw['median'] * 100:+.1f}%, "
                      f"p90 {pw['p90'] * 100:+.1f}%\n")
                sp, sr = o.get("library_split_us"), o.get("raw_split_us")
                if sp:
                    w(f"    library, observed: checked driver calls {fmt(sp['driver_calls'])} us, context switch "
                      f"calls {fmt(sp['context_calls'])} us, Python and close(fd) {fmt(sp['python'])} us\n")
                if sr:
                    w(f"    loop, instrumented: close(fd) {fmt(sr['fd_close'])} us, "
                      f"driver calls + loop {fmt(sr['python'])} us\n")
            elif o:
                w(f"  {what}: {o.get('status')}\n")
    firsts = [(k, m["first_handoff_us"]) for k, m in results["mechanisms"].items() if m.get("first_handoff_us")]
    if firsts:
        w("\nfirst hand-off of each run (producer starts -> consumer has read; the channel's includes "
          "connect and handshake), us: " + ", ".join(f"{k} {fmt(v)}" for k, v in firsts) + "\n")
    print_targets(results["targets"], file)


def print_targets(t: dict[str, Any], file: Any = None) -> None:
    """The ``targets:`` lines of a run's table: each target of :func:`.targets.bench_targets` with its verdict."""
    w = (file or sys.stdout).write
    w("\ntargets:\n")
    lat = t["latency"]
    detail = ", ".join(f"{x['label']} {x['ratio']:.2f}x ({x['ours']})" for x in lat.get("per_size", [])
                       if x.get("ratio") is not None) or lat.get("note", "")
    w(f"  latency <= {LATENCY_RATIO:g} x torch-ipc at every size: {_verdict(lat['met'])}  {detail}\n")
    b = t["bandwidth"]
    detail = (f"{b['at_largest_size']['ratio']:.3f} at {b['at_largest_size']['label']}"
              + (f" (lowest from 1 MiB up: {b['min_ratio_from_1MiB']:.3f})"
                 if b.get("min_ratio_from_1MiB") is not None else "")
              if "at_largest_size" in b else b.get("note", ""))
    w(f"  bandwidth through the import >= {BANDWIDTH_RATIO:g} x native: {_verdict(b['met'])}  {detail}\n")
    po = t["python_overhead"]
    detail = f"POSIX-fd {po['overhead'] * 100:+.1f}%" if "overhead" in po else po.get("note", "")
    if "dmabuf_ratio" in po:
        detail += f", dma-buf export {po['dmabuf_ratio']:.2f}x"
    w(f"  Python overhead (POSIX-fd <= +{POSIX_FD_OVERHEAD * 100:g}%, dma-buf export <= {DMABUF_EXPORT_RATIO:g}x): "
      f"{_verdict(po['met'])}  {detail}\n")
    cl = t["channel"]
    detail = ", ".join(f"{x['label']} " + " / ".join(_channel_mode(x[m]) for m in ("blocking", "spinning") if x.get(m))
                       for x in cl["per_size"])
    detail = "; ".join(d for d in (detail, cl.get("note")) if d)
    w(f"  channel <= {CHANNEL_RATIO:g} x torch-ipc blocking, <= {CHANNEL_SPIN_RATIO:g} x spinning, p99 <= "
      f"{CHANNEL_TAIL:g} x median, at or below posix-fd-cached: {_verdict(cl['met'])}  {detail}\n")
    fh = t.get("first_handoff")
    if fh:
        detail = (f"channel {fmt(fh['channel_us'])} us, torch-ipc {fmt(fh['torch_ipc_us'])} us ({fh['ratio']:.2f}x)"
                  if fh["met"] is not None else fh.get("note", ""))
        w(f"  first hand-off through a fresh channel <= {FIRST_HANDOFF_RATIO:g} x torch-ipc's first share: "
          f"{_verdict(fh['met'])}  {detail}\n")
    ho = t.get("host")
    if ho:
        detail = ", ".join(f"{x['label']} {x['ratio']:.2f}x ({fmt(x['channel_host_us'])} us {x['channel_host_mode']} "
                           f"vs {fmt(x['iceoryx2_us'])} us {x['iceoryx2_mode']})" for x in ho["per_size"])
        detail = "; ".join(d for d in (detail, ho.get("note")) if d)
        w(f"  channel-host <= {HOST_RATIO:g} x iceoryx2 (median, spinning allowed): {_verdict(ho['met'])}  {detail}\n")
    th = t["throughput"]
    detail = ", ".join(f"{k} {v:,}/s" + (f" {_verdict(th['per_mechanism'][k])}" if k in th.get("per_mechanism", {})
                                         else "")
                       for k, v in th["measured"].items() if v) or "not measured"
    w(f"  channel throughput >= {THROUGHPUT_PER_S:,}/s (1 MiB, pipelined): {_verdict(th['met'])}  {detail}\n")
    mem = t["memory"]
    detail = "; ".join(f"{k}: overhead {v['pool_overhead_bytes'] / MiB:.1f} MiB (chunk {v['chunk_bytes'] / MiB:.1f} MiB), "
                       f"fds +{v['fds_grew']}" + (f", device memory -{v['free_device_memory_fell']} B"
                                                   if v["free_device_memory_fell"] else "")
                       + f" over {v['hand_offs']:,} hand-offs" for k, v in mem["per_mechanism"].items()) or "not measured"
    w(f"  channel pool overhead <= 1 chunk, no growth: {_verdict(mem['met'])}  {detail}\n")


def pyplot() -> tuple[Any, str | None]:
    """``(matplotlib.pyplot, None)`` on the Agg backend (no display needed), or ``(None, why not)``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'dmabuf-interop[bench]')"
    return plt, None


def save_figure(plt: Any, fig: Any, path: str) -> str | None:
    """Write ``fig`` to ``path`` and close it; returns why not (a full disk, ``/dev/full``, a format matplotlib
    lacks), so that the caller records it and still writes the run's JSON."""
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as exc:
        return f"could not write {path}: {exc}"
    finally:
        plt.close(fig)
    return None


def plot(results: dict[str, Any], path: str) -> str | None:
    """Write the log-log plot; returns why not when matplotlib is missing or the file cannot be written (the
    caller records it, and writes the JSON still)."""
    plt, why = pyplot()
    if plt is None:
        return why
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, m in results["mechanisms"].items():
        pts = [(c["size"], cell_median(c)) for c in m.get("cells", []) if cell_median(c) is not None]
        label, style = name, "-"
        if not pts:
            pts = [(c["size"], cell_median(c, "export_transport")) for c in m.get("cells", [])]
            label, style = f"{name} (export+transport only: import unsupported)", "--"
        if not pts:
            continue
        kind = MECHANISMS[name][0]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o" if kind == "ours" else "s",
                label=f"{label} [{kind}]")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("buffer size (bytes)")
    ax.set_ylabel("median hand-off latency (µs)")
    gpus = results["environment"].get("gpus") or []
    ax.set_title("Producer starts sharing -> consumer has read 4 bytes"
                 + (f" ({gpus[0]['name']})" if gpus else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(plt, fig, path)


def write_json(results: dict[str, Any], path: str) -> None:
    """Write ``results`` as indented JSON to ``path`` (layout: ``docs/benchmarks.md``, :data:`JSON_SCHEMA`).

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
        fh.write("\n")
