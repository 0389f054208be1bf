"""torch tensors in expandable segments lent in place (their pages exported, no copy). Marked ``gpu``.

The producer runs under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
with no SharedPool at all, so any tensor that were not lent in place would
be copied into a pool the channel makes on first need, which the producer
checks was never made. Producer and consumer are two unrelated subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import env_with_src

pytestmark = pytest.mark.gpu

_PEER = r"""
import json, os, sys
mode, addr, device = sys.argv[1], sys.argv[2], int(sys.argv[3])
import torch
from dmabuf_interop.channel import connect, listen, release_segments
from dmabuf_interop.channel.segments import segments_for

torch.cuda.set_device(device)
dev = f"cuda:{device}"
SIZES = {"small": 1000, "two_pages": (30 << 20) // 4, "many_pages": (300 << 20) // 4}

if mode == "producer":
    out = {}
    with listen(addr) as lst:
        print("listening", flush=True)
        with lst.accept(120) as ch:
            s = torch.cuda.current_stream()
            ts = {k: torch.full((n,), 0.0, device=dev) for k, n in SIZES.items()}
            bf = torch.arange(4096, device=dev).to(torch.bfloat16).view(64, 64).t()  # a strided view
            seg = segments_for(device)
            chunks = []
            for step in range(3):
                for t in ts.values():
                    t.add_(1.0)  # queued on s: the consumer's stream waits on the lease's event
                ch.send_many({**ts, "bf": bf}, stream=s).wait(60)
                chunks.append(len(seg))
            out["chunks_per_step"] = chunks
            out["pages"] = sorted(len(c.parts) for c in seg._chunks)
            # torch gives the pages back and maps new ones: the old chunk must not be lent again.
            del ts["many_pages"]
            torch.cuda.empty_cache()
            ts["many_pages"] = torch.full((SIZES["many_pages"],), 42.0, device=dev)
            ch.send(ts["many_pages"], stream=s).wait(60)
            out["released"] = release_segments()
            ch.send(ts["small"], stream=s).wait(60)  # lent again from a fresh chunk
            out["pools_made"] = len(ch._auto.pools.pools)  # none: every tensor was lent in place
    print(json.dumps(out), flush=True)
else:
    out = {"steps": []}
    with connect(addr, timeout=120, device=device) as ch:
        for step in range(3):
            many = ch.recv_many(120)
            got = {k: [float(t.min()), float(t.max()), t.numel()] for k, t in
                   ((k, r.as_tensor()) for k, r in many.items() if k != "bf")}
            want = {k: [step + 1.0, step + 1.0, n] for k, n in SIZES.items()}
            bf = many["bf"].as_tensor()
            ok_bf = bool(torch.equal(bf.cpu(), torch.arange(4096).to(torch.bfloat16).view(64, 64).t()))
            out["steps"].append({"ok": got == want and ok_bf, "ordering": many["small"].ordering,
                                 "on": many["small"].device, "got": got if got != want else None})
            for r in many.values():
                r.release()
        with ch.recv(120) as r:
            t = r.as_tensor()
            out["after_empty_cache"] = float(t.min()) == float(t.max()) == 42.0 and t.numel() == SIZES["many_pages"]
        with ch.recv(120) as r:
            t = r.as_tensor()
            out["after_release"] = float(t.min()) == float(t.max()) == 3.0 and t.numel() == SIZES["small"]
    print(json.dumps(out), flush=True)
"""


def _run(tmp_path: Path, pdev: int, cdev: int) -> tuple[dict, dict]:
    addr = str(tmp_path / "seg.sock")
    env = env_with_src()
    penv = {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    prod = subprocess.Popen([sys.executable, "-c", _PEER, "producer", addr, str(pdev)], env=penv,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert prod.stdout.readline().strip() == "listening", prod.stderr.read()
        cons = subprocess.run([sys.executable, "-c", _PEER, "consumer", addr, str(cdev)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert cons.returncode == 0, cons.stderr
        pout, perr = prod.communicate(timeout=120)
        assert prod.returncode == 0, perr
        return json.loads(pout.strip().splitlines()[-1]), json.loads(cons.stdout.strip().splitlines()[-1])
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait(10)


def _check(prod: dict, cons: dict, cdev: int) -> None:
    assert [s["ok"] for s in cons["steps"]] == [True] * 3, cons["steps"]
    assert all(s["on"] == cdev for s in cons["steps"])
    assert cons["steps"][0]["ordering"] in ("event", "sync")
    assert cons["after_empty_cache"] and cons["after_release"]
    # Exported at the first step only, as few chunks: tensors whose pages touch share one (the two
    # large ones lie side by side in torch's large-page segment: 30 + 300 MiB in 17 to 19 pages of 20 MiB).
    first = prod["chunks_per_step"][0]
    assert 1 <= first <= 3 and prod["chunks_per_step"] == [first] * 3
    assert 16 <= prod["pages"][-1] <= 19
    assert prod["released"] >= 1
    assert prod["pools_made"] == 0


def test_expandable_segments_lent_in_place_same_gpu(tmp_path: Path) -> None:
    prod, cons = _run(tmp_path, 0, 0)
    _check(prod, cons, 0)


@pytest.mark.gpu(count=2)
def test_expandable_segments_lent_in_place_to_the_other_gpu(tmp_path: Path) -> None:
    prod, cons = _run(tmp_path, 0, 1)
    _check(prod, cons, 1)
