"""What a run reports: the table on stdout, the targets and their verdicts, the plot, the JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

from .catalog import GPU_HANDOFF_OURS, MECHANISMS

__all__ = ["JSON_SCHEMA", "size_label", "fmt", "ratio", "targets", "print_table", "plot", "write_json"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: Version of the ``--json`` layout (2: keys of ``breakdown_us`` and of the overhead splits are driver
#: call names and observer-based parts).
JSON_SCHEMA = 2


def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"

def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"

def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not a.get("gbps") or not b.get("gbps"):
        return None
    return a["gbps"] / b["gbps"]

def _median(cell: dict[str, Any], phase: str = "total") -> float | None:
    st = cell["phases_us"].get(phase)
    return st["median"] if st else None


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Each target (latency, bandwidth, Python overhead) against this run: ``met`` is True, False or None."""
    mechs = results["mechanisms"]
    out: dict[str, Any] = {}
    # 1. latency: our fastest GPU hand-off <= 0.5 x torch-ipc at every size
    lat: dict[str, Any] = {"target": "our fastest hand-off (producer starts -> consumer has read) <= 0.5 x "
                                     "torch-ipc's, at every size", "per_size": []}
    torch = mechs.get("torch-ipc", {})
    if torch.get("status") != "ok":
        lat["met"] = None
        lat["note"] = f"not evaluated: torch-ipc {torch.get('status', 'not run')}"
    else:
        tcells = {c["size"]: c for c in torch["cells"]}
        met = True
        for size in results["config"]["sizes"]:
            t = _median(tcells[size]) if size in tcells else None
            best = None
            for name in GPU_HANDOFF_OURS:
                m = mechs.get(name, {})
                for c in m.get("cells", []):
                    v = _median(c)
                    if c["size"] == size and v is not None and (best is None or v < best[1]):
                        best = (name, v)
            if t is None or best is None:
                lat["per_size"].append({"size": size, "label": size_label(size), "ratio": None})
                met = False
                continue
            r = best[1] / t
            met = met and r <= 0.5
            lat["per_size"].append({"size": size, "label": size_label(size), "ours": best[0],
                                    "ours_us": best[1], "torch_us": t, "ratio": round(r, 4)})
        lat["met"] = met
    out["latency"] = lat
    # 2. bandwidth through the import >= 0.95 x native
    bws = [b for b in results.get("bandwidth", {}).get("sizes", []) if ratio(b.get("import"), b.get("native"))]
    bw: dict[str, Any] = {"target": "read kernel over the import >= 0.95 x the same kernel over native memory"}
    if bws:
        big = max(bws, key=lambda b: b["size"])
        bw["at_largest_size"] = {"size": big["size"], "label": size_label(big["size"]),
                                 "ratio": round(ratio(big["import"], big["native"]) or 0, 4)}
        bw["min_ratio_from_1MiB"] = min((round(ratio(b["import"], b["native"]) or 0, 4) for b in bws
                                         if b["size"] >= MiB), default=None)
        bw["met"] = bw["at_largest_size"]["ratio"] >= 0.95
    else:
        bw["met"] = None
        bw["note"] = "not measured"
    out["bandwidth"] = bw
    # 3. Python overhead: POSIX-fd cycle <= +10 %, dma-buf export+close <= 1.3 x the raw calls
    ov = results.get("python_overhead") or {}
    cyc, dma = ov.get("posix_fd_cycle"), ov.get("dmabuf_export") or {}
    po: dict[str, Any] = {"target": "library against the same driver calls in a tight loop: POSIX-fd export + "
                                    "import + release at most +10%, dma-buf export + close at most 1.3x"}
    if cyc:
        po["overhead"] = round(cyc["overhead"], 4)
        po["met"] = cyc["overhead"] <= 0.10
        if "overhead" in dma:  # an unsupported dma-buf export leaves the POSIX-fd part alone
            po["dmabuf_ratio"] = round(1.0 + dma["overhead"], 4)
            po["met"] = po["met"] and po["dmabuf_ratio"] <= 1.3
    else:
        po["met"] = None
        po["note"] = "not measured"
    out["python_overhead"] = po
    # 4. the channel: hand-off median <= 0.15 x torch-ipc's at every size, p99 <= 3 x its own median
    ch = mechs.get("channel", {})
    cl: dict[str, Any] = {"target": "channel hand-off median <= 0.15 x torch-ipc's at every size, p99 <= 3 x "
                                    "its own median", "per_size": []}
    if ch.get("status") != "ok" or torch.get("status") != "ok":
        cl["met"] = None
        cl["note"] = f"not evaluated: channel {ch.get('status', 'not run')}, torch-ipc {torch.get('status', 'not run')}"
    else:
        tcells = {c["size"]: c for c in torch["cells"]}
        met = True
        for c in ch["cells"]:
            t = _median(tcells[c["size"]]) if c["size"] in tcells else None
            st = c["phases_us"].get("total")
            if t is None or not st:
                met = False
                continue
            r, spread = st["median"] / t, st["p99"] / st["median"]
            met = met and r <= 0.15 and spread <= 3.0
            cl["per_size"].append({"size": c["size"], "label": size_label(c["size"]), "ratio": round(r, 4),
                                   "p99_over_median": round(spread, 3)})
        cl["met"] = met and bool(cl["per_size"])
    out["channel"] = cl
    # 4b. the first hand-off through a fresh channel <= 2 x torch-ipc's first share
    fh: dict[str, Any] = {"target": "first hand-off through a fresh channel (accept/connect, handshake, first chunk "
                                    "imported, read) <= 2 x torch-ipc's first share (the run's first hand-off)",
                          "channel_us": ch.get("first_handoff_us"), "torch_ipc_us": torch.get("first_handoff_us")}
    if fh["channel_us"] is None or fh["torch_ipc_us"] is None:
        fh["met"] = None
        fh["note"] = "not evaluated: channel or torch-ipc not run, or failed"
    else:
        fh["ratio"] = round(fh["channel_us"] / fh["torch_ipc_us"], 3)
        fh["met"] = fh["ratio"] <= 2.0
    out["first_handoff"] = fh
    # 5. channel throughput, 1 MiB zero-copy, pipelined: >= 20,000 hand-offs/s (device pool)
    tp = results.get("throughput", {})
    th: dict[str, Any] = {"target": "channel, 1 MiB zero-copy, one producer and one consumer, pipelined: "
                                    ">= 20,000 hand-offs/s", "measured": {k: v.get("per_second") for k, v in tp.items()}}
    dev = tp.get("channel", {})
    th["met"] = None if dev.get("status") != "ok" else dev["per_second"] >= 20000
    out["throughput"] = th
    # 6. memory over the throughput run: pool overhead <= one chunk beyond what is live; no fd or device-memory growth
    mem: dict[str, Any] = {"target": "pool capacity at most one chunk beyond the live bytes; no growth of fds or "
                                     "device memory over the throughput run", "per_mechanism": {}}
    verdicts = []
    for name, res in tp.items():
        prod = res.get("producer")
        if res.get("status") != "ok" or not prod:
            continue
        overhead = prod["pool_capacity"] - prod["live_bytes"]
        grew = max(prod["fds_grew"], res.get("consumer_fds_grew", 0), 0)
        fell = prod.get("free_device_memory_fell") or 0
        ok = overhead <= prod["chunk_bytes"] and grew == 0 and fell <= 0
        mem["per_mechanism"][name] = {"hand_offs": res["count"], "pool_overhead_bytes": overhead,
                                      "chunk_bytes": prod["chunk_bytes"], "fds_grew": grew,
                                      "free_device_memory_fell": prod.get("free_device_memory_fell"), "met": ok}
        verdicts.append(ok)
    mem["met"] = all(verdicts) if verdicts else None
    out["memory"] = mem
    return out


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("MET" if met else "NOT MET")


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
    w(f"{'mechanism':<16}{'size':>8}  " + "".join(f"{h:>15}" for h in heads) + "\n")
    for name, m in results["mechanisms"].items():
        if m["status"] != "ok" and not m.get("cells"):
            w(f"{name:<16}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
            continue
        for cell in m["cells"]:
            row = f"{name:<16}{cell['label']:>8}  "
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
            w(f"{name:<16}{'':>8}  {m['status']}: {m.get('reason') or ''}\n")
        notes = sorted({c["import"] for c in m["cells"] if c.get("import") and c["import"] != "ok"})
        for note in notes:
            w(f"{'':<16}{'':>8}  import {note}; total in parentheses is export+transport only\n")
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
    t = results["targets"]
    w("\ntargets:\n")
    lat = t["latency"]
    detail = ", ".join(f"{x['label']} {x['ratio']:.2f}x ({x['ours']})" for x in lat.get("per_size", [])
                       if x.get("ratio") is not None) or lat.get("note", "")
    w(f"  latency <= 0.5 x torch-ipc at every size: {_verdict(lat['met'])}  {detail}\n")
    b = t["bandwidth"]
    detail = (f"{b['at_largest_size']['ratio']:.3f} at {b['at_largest_size']['label']}"
              + (f" (lowest from 1 MiB up: {b['min_ratio_from_1MiB']:.3f})"
                 if b.get("min_ratio_from_1MiB") is not None else "")
              if "at_largest_size" in b else b.get("note", ""))
    w(f"  bandwidth through the import >= 0.95 x native: {_verdict(b['met'])}  {detail}\n")
    po = t["python_overhead"]
    detail = f"POSIX-fd {po['overhead'] * 100:+.1f}%" if "overhead" in po else po.get("note", "")
    if "dmabuf_ratio" in po:
        detail += f", dma-buf export {po['dmabuf_ratio']:.2f}x"
    w(f"  Python overhead (POSIX-fd <= +10%, dma-buf export <= 1.3x): {_verdict(po['met'])}  {detail}\n")
    cl = t["channel"]
    detail = ", ".join(f"{x['label']} {x['ratio']:.2f}x (p99 {x['p99_over_median']:.1f}x median)"
                       for x in cl["per_size"]) or cl.get("note", "")
    w(f"  channel <= 0.15 x torch-ipc, p99 <= 3 x median: {_verdict(cl['met'])}  {detail}\n")
    fh = t.get("first_handoff")
    if fh:
        detail = (f"channel {fmt(fh['channel_us'])} us, torch-ipc {fmt(fh['torch_ipc_us'])} us ({fh['ratio']:.2f}x)"
                  if fh["met"] is not None else fh.get("note", ""))
        w(f"  first hand-off through a fresh channel <= 2 x torch-ipc's first share: {_verdict(fh['met'])}  {detail}\n")
    th = t["throughput"]
    detail = ", ".join(f"{k} {v:,}/s" for k, v in th["measured"].items() if v) or "not measured"
    if th["met"] is None and th["measured"].get("channel-host"):
        detail += " (the target is for a device pool: channel)"
    w(f"  channel throughput >= 20,000/s (1 MiB, pipelined): {_verdict(th['met'])}  {detail}\n")
    mem = t["memory"]
    detail = "; ".join(f"{k}: overhead {v['pool_overhead_bytes'] / MiB:.1f} MiB (chunk {v['chunk_bytes'] / MiB:.1f} MiB), "
                       f"fds +{v['fds_grew']}" + (f", device memory -{v['free_device_memory_fell']} B"
                                                   if v["free_device_memory_fell"] else "")
                       + f" over {v['hand_offs']:,} hand-offs" for k, v in mem["per_mechanism"].items()) or "not measured"
    w(f"  channel pool overhead <= 1 chunk, no growth: {_verdict(mem['met'])}  {detail}\n")


def plot(results: dict[str, Any], path: str) -> str | None:
    """Write the log-log plot; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dmabuf-interop[bench]')"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, m in results["mechanisms"].items():
        pts = [(c["size"], _median(c)) for c in m.get("cells", []) if _median(c) is not None]
        label, style = name, "-"
        if not pts:
            pts = [(c["size"], _median(c, "export_transport")) for c in m.get("cells", [])]
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_json(results: dict[str, Any], path: str) -> None:
    """Write ``results`` as indented JSON to ``path`` (layout: ``docs/benchmarks.md``, :data:`JSON_SCHEMA`).

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
        fh.write("\n")
