"""The "dmabuf" backend against vLLM 0.33's own weight-transfer classes, on the CPU (host pools).

vLLM is installed without its dependencies (``pip install --no-deps vllm==0.33.0`` and the few packages
``vllm.distributed.weight_transfer`` imports: see ``.ci/run``); it imports with torch 2.13 (CPU) although
its wheel asks for torch 2.14. Where vLLM does not import, these tests skip with the reason.

The client stands for vLLM's HTTP/Ray clients: it calls the worker engines' methods as vLLM's worker
does. vLLM's ``WeightTransferEngine.update_weights`` ends with ``torch.accelerator.synchronize()``,
which raises on a machine without an accelerator, so here (and only where none is available) the client
calls what ``update_weights`` calls before it: ``receive_weights(parse_update_info(...))``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the vLLM backend moves torch tensors")
try:
    import vllm  # noqa: F401
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import (ModuleSource, VLLMWeightSyncClient, WeightTransferEngineFactory,
                                                  WeightTransferTrainerFactory)
except ImportError as exc:  # pragma: no cover - CI installs it
    if os.environ.get("DMABUF_INTEROP_REQUIRE_VLLM") == "1":  # .ci/run: a skip here would hide the contract
        raise
    pytest.skip(f"vLLM 0.33 does not import here ({exc}): pip install --no-deps vllm==0.33.0 and the packages "
                f".ci/run lists", allow_module_level=True)

from dmabuf_interop.integrations import vllm as backend  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Model(torch.nn.Module):
    """A small model with vLLM's ``load_weights`` contract (an iterable of (name, tensor))."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.loaded: list[str] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
            self.loaded.append(name)
        return set(self.loaded)


class Client:
    """vLLM's ``VLLMWeightSyncClient`` protocol, fanning each call out to the workers (one per TP rank)
    concurrently, as vLLM's ``collective_rpc`` does."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.calls: list[str] = []

    def _all(self, fn) -> None:
        errors: list[BaseException] = []

        def run(w):
            try:
                fn(w)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
            assert not t.is_alive(), "a worker's call did not return within 300 s"
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, init_info):
        json.dumps(init_info)  # what crosses vLLM's control plane is JSON
        self.calls.append("init")
        self._all(lambda w: w.init_transfer_engine(w.parse_init_info(init_info)))

    def start_weight_update(self):
        self.calls.append("start")
        self._all(lambda w: w.start_weight_update())

    def update_weights(self, update_info):
        json.dumps(update_info)
        self.calls.append("update")
        if torch.accelerator.is_available():
            self._all(lambda w: w.update_weights(update_info))
        else:  # update_weights less its torch.accelerator.synchronize() (see the module docstring)
            self._all(lambda w: w.receive_weights(w.parse_update_info(update_info)))

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")
        self._all(lambda w: w.finish_weight_update())


def _workers(n: int) -> list:
    backend.register()
    vllm_config = _vllm_config()
    return [WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="dmabuf"), vllm_config,
                                                      torch.device("cpu"), Model()) for _ in range(n)]


def _vllm_config():
    """What ``WeightTransferEngine.__init__`` reads of the VllmConfig (its parallel and model configs, which
    it only stores, and this backend never reads); a real ``ParallelConfig()`` imports vLLM's executor."""
    from types import SimpleNamespace

    return SimpleNamespace(parallel_config=None, model_config=None)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_entry_point_registers_the_backend_in_both_factories(tmp_path, monkeypatch):
    import vllm.plugins

    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\s*\n(\w+) = "([^"]+)"', text)
    assert m, "pyproject.toml declares no vllm.general_plugins entry point"
    # The declared entry point, as pip installs it: a dist-info on the path (beside any installed copy).
    dist = tmp_path / "dmabuf_interop_plugin-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dmabuf-interop-plugin\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{m.group(1)} = {m.group(2)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for _ in range(2):  # vLLM loads plugins in every process, and a process may load them twice
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()
    assert "dmabuf" in WeightTransferEngineFactory._registry
    assert "dmabuf" in WeightTransferTrainerFactory._registry
    assert WeightTransferEngineFactory._registry["dmabuf"]() is backend.DmabufWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["dmabuf"]() is backend.DmabufTrainerWeightTransferEngine
    backend.register()  # once more: nothing happens


def test_an_update_round_through_both_factories(tmp_path):
    (worker,) = workers = _workers(1)
    assert isinstance(worker, backend.DmabufWeightTransferEngine)
    trainer_model = Model()
    client = Client(workers)
    assert isinstance(client, VLLMWeightSyncClient)
    info = backend.DmabufTrainerInitInfo(address=str(tmp_path / "w.sock"), rank=0, max_bytes=1 << 20)
    json.dumps({k: v for k, v in asdict(info).items()})  # JSON only
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer_model))
    try:
        assert isinstance(engine, backend.DmabufTrainerWeightTransferEngine) and engine.is_sender
        for step in range(3):
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(1.0)
            engine.send_weights()
            assert _same(worker.model, trainer_model)
            assert worker.core.version == step + 1
        assert client.calls == ["init"] + ["start", "update", "finish"] * 3
        assert set(worker.model.loaded) == {n for n, _ in trainer_model.named_parameters()}  # via load_weights
    finally:
        engine.shutdown()
        worker.shutdown()


def test_tensor_parallel_workers_receive_the_same_version_in_buckets(tmp_path):
    workers = _workers(2)
    trainer_model = Model()
    info = backend.DmabufTrainerInitInfo(address=str(tmp_path / "w.sock"), rank=0, max_bytes=16 << 10)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=Client(workers), source=ModuleSource(trainer_model))
    try:
        assert engine.core.publisher.engines == 2
        engine.send_weights()
        assert all(_same(w.model, trainer_model) for w in workers)
        report = engine.core.report
        assert report.engines == 2 and not report.kept and report.batches >= 3  # 20.6 KB through a 16 KiB pool
        assert engine.core.publisher.pool.capacity <= 16 << 10
    finally:
        engine.shutdown()
        for w in workers:
            w.shutdown()


def test_refused_init_and_update_info():
    (worker,) = _workers(1)
    for bad in ({"address": "/tmp/x.sock", "bogus": 1}, {"address": 7}, {"address": ""}, {},
                {"address": "/tmp/" + "\u00e9" * 60},  # 65 characters, 125 bytes: past sun_path's 107
                {"address": "/tmp/x.sock", "timeout": "60"}, {"address": "/tmp/x.sock", "timeout": float("nan")}):
        with pytest.raises(ValueError):
            worker.parse_init_info(bad)
    for bad in ({"version": "1"}, {"version": -1}, {"version": True}, {}, {"version": 1, "handles": "x"}):
        with pytest.raises(ValueError):
            worker.parse_update_info(bad)
    with pytest.raises(ValueError, match="iter_full"):
        WeightTransferTrainerFactory.trainer_init(backend.DmabufTrainerInitInfo(address="/tmp/x.sock", rank=0),
                                                  client=Client([worker]), source=None)
    with pytest.raises(ValueError):
        backend.DmabufTrainerInitInfo(address="/tmp/x.sock", rank=0, max_bytes=0)
    with pytest.raises(Exception, match="before init_transfer_engine"):
        worker.receive_weights(worker.parse_update_info({"version": 1}))


def test_the_backend_works_without_vllm_in_a_fresh_interpreter():
    import subprocess

    code = ("import sys; sys.modules['vllm'] = None\n"
            "import dmabuf_interop.integrations.vllm as v\n"
            "assert not v.HAVE_VLLM and not hasattr(v, 'DmabufWeightTransferEngine')\n"
            "v.register(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "ok", out.stderr


def test_a_fresh_trainer_process_registers_the_backend_as_the_docs_show():
    """A trainer's process loads no vLLM plugins: without ``register()`` vLLM does not know "dmabuf"; with it (as
    docs/weight-sync.md's trainer does) ``trainer_init`` finds the backend."""
    import subprocess

    code = ("from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as F\n"
            "from dmabuf_interop.integrations.vllm import DmabufTrainerInitInfo, register\n"
            "before = 'dmabuf' in F._registry\n"
            "register()\n"
            "print(before, F._registry['dmabuf']().__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])})
    assert out.stdout.split() == ["False", "DmabufTrainerWeightTransferEngine"], out.stderr[-2000:]
