"""The "dmabuf" backend in vLLM's order without vLLM: ``examples/vllm_backend/`` as two real processes.

The trainer process drives ``TrainerEngine`` (what ``DmabufTrainerWeightTransferEngine`` runs) through a
socket client standing for vLLM's HTTP client; the engine process answers with ``WorkerEngine`` (what
``DmabufWeightTransferEngine`` runs) and checks, after each ``finish_weight_update``, that every
parameter holds the version. CPU: a toy model over host pools (parameters in the pool: the bench's
``vllm-backend`` path, run by ``tests/cli/test_weight_sync.py``). GPU: Qwen3-8B's 399 tensors (16.4 GB
bf16) on one GPU, with the trainer's tensors copied into the pool, lent from it, and in buckets through
a pool a quarter of the model's size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import env_with_src

pytest.importorskip("torch", reason="the example moves torch tensors")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_backend"


def run_pair(tmp_path: Path, common: tuple[str, ...], extra: tuple[str, ...] = (), timeout: float = 300
             ) -> tuple[dict, dict]:
    """Engine and trainer with the ``common`` options; ``extra`` for the trainer alone."""
    ctl, addr = tmp_path / "ctl.sock", tmp_path / "w.sock"
    env = env_with_src()
    engine = subprocess.Popen([sys.executable, str(EXAMPLE / "engine.py"), "--control", str(ctl), "--json", *common],
                              cwd=EXAMPLE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ctl.exists():
            assert engine.poll() is None, engine.communicate()[1]
            assert time.monotonic() < deadline, "the engine never listened"
            time.sleep(0.05)
        trainer = subprocess.run([sys.executable, str(EXAMPLE / "trainer.py"), "--control", str(ctl), "--address",
                                  str(addr), "--json", *common, *extra], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                                 timeout=timeout)
        out, err = engine.communicate(timeout=timeout)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert engine.returncode == 0, out + err
    return json.loads(trainer.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [(), ("--max-bytes", "1200000")], ids=["staged", "buckets"])
def test_the_example_pair_on_host_pools(tmp_path, extra):
    tr, en = run_pair(tmp_path, ("--host",), ("--steps", "3", *extra))
    assert [c["version"] for c in en["checked"]] == [1, 2, 3] and all(c["ok"] for c in en["checked"])
    assert len(tr["send_ms"]) == 3 and tr["tensors"] == 4


def test_the_trainer_without_an_engine_says_so_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLE / "trainer.py"), "--control", str(tmp_path / "none.sock"),
                          "--host"], cwd=EXAMPLE, env=env_with_src(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"trainer: no engine at {tmp_path / 'none.sock'} (No such file or "
                                               f"directory): start engine.py first"]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [(), ("--in-pool",), ("--max-bytes", str(4 << 30))], ids=["staged", "in-pool", "buckets"])
def test_ws_8b_in_vllm_order_on_one_gpu(tmp_path, extra):
    tr, en = run_pair(tmp_path, ("--shapes", "ws-8b", "--device", "0"), ("--steps", "3", *extra), timeout=540)
    assert tr["tensors"] == 399 and round(tr["bytes"] / 1e9, 1) == 16.4
    assert [c["version"] for c in en["checked"]] == [1, 2, 3] and all(c["ok"] for c in en["checked"])
    print(f"ws-8b {extra or 'staged'}: send_weights ms {[round(t, 1) for t in tr['send_ms']]}")
