"""The SGLang loader on SGLang's ``update_weights_from_tensor(load_format=...)`` path, on the CPU.

sglang 0.5.23's ``weight_updater`` module does not import without triton (and sgl-kernel), so its
``update_weights_from_tensor`` is not called here. What is run is what it does with a custom loader,
step by step: ``dynamic_import(load_format)`` (the module path and the attribute, split at the last
dot), each named tensor moved with ``.to(device)`` (``_unwrap_tensor``), then
``custom_loader(model, named_tensors)``. Where the sglang wheel is installed, its source is read to
check that this is still the call it makes.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the SGLang loader moves torch tensors")

from dmabuf_interop.errors import IncompleteVersionError, ProtocolError  # noqa: E402
from dmabuf_interop.integrations import sglang as loader  # noqa: E402
from dmabuf_interop.weight_sync import WeightPublisher  # noqa: E402


def dynamic_import(func_path: str):
    """sglang.srt.utils.common.dynamic_import, 0.5.23."""
    parts = func_path.split(".")
    module = importlib.import_module(".".join(parts[:-1]))
    return getattr(module, parts[-1])


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)


def _server_update(model, named_tensors, load_format):
    """What SGLang's WeightUpdater.update_weights_from_tensor does with a custom loader."""
    named_tensors = [(name, t.to("cpu")) for name, t in named_tensors]
    custom_loader = dynamic_import(load_format)
    custom_loader(model, named_tensors)
    return True, "Success"


def test_sglang_calls_a_custom_loader_this_way():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23 to check its call site)")
    root = Path(next(iter(spec.submodule_search_locations)))
    src = (root / "srt/model_executor/model_runner_components/weight_updater.py").read_text()
    assert "elif load_format in self.custom_weight_loaders:" in src
    assert "custom_loader = dynamic_import(load_format)" in src
    assert "custom_loader(self.get_model(), named_tensors)" in src
    common = (root / "srt/utils/common.py").read_text()
    assert 'module_path = ".".join(parts[:-1])' in common
    # The scheduler runs the update only between begin_weight_update and end_weight_update (the docs' trainer
    # calls both).
    scheduler = (root / "srt/managers/scheduler_components/weight_updater.py").read_text()
    assert '"begin_weight_update() and end_weight_update()"' in scheduler


def test_versions_through_update_weights_from_tensor(tmp_path):
    addr = str(tmp_path / "w.sock")
    trainer, engine = Model(), Model()
    with WeightPublisher(addr, max_bytes=1 << 20, timeout=30) as pub:
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(1.0)
            res = loader.send_version(pub, trainer.state_dict(), version, engines=1,
                                      update=lambda named: _server_update(engine, named, loader.LOADER))
            assert res == (True, "Success")
            assert all(torch.equal(x, y) for x, y in zip(trainer.state_dict().values(), engine.state_dict().values()))
        assert pub.engines == 1  # connected once, on the first version
    loader._receivers.clear()


def test_the_placeholder_carries_no_tensor_and_is_checked(tmp_path):
    (name, t), = loader.placeholder(str(tmp_path / "w.sock"), 4)
    assert name.startswith(loader.PREFIX) and t.numel() == 1 and t.device.type == "cpu"
    with pytest.raises(ProtocolError, match="address"):  # 65 characters, 125 bytes: past sun_path's 107
        loader.placeholder("/tmp/" + "\u00e9" * 60, 1)
    model = Model()
    for bad in ([], [(name, t), (name, t)], [("model.a.weight", t)], [(loader.PREFIX + "{", t)],
                [(loader.PREFIX + '{"address": "x", "version": -1, "timeout": 1}', t)],
                [(loader.PREFIX + '{"address": "x", "version": 1, "timeout": 1, "pickle": 1}', t)]):
        with pytest.raises(ProtocolError):
            loader.load_weights(model, bad)


def test_a_failed_load_is_reported_to_the_caller(tmp_path):
    addr = str(tmp_path / "w.sock")

    class Broken(Model):
        def load_weights(self, weights):
            raise RuntimeError("no such parameter")

    with WeightPublisher(addr, max_bytes=1 << 20, timeout=30, stream_batches=1) as pub:
        with pytest.raises(IncompleteVersionError, match="no such parameter"):
            loader.send_version(pub, Model().state_dict(), 1, engines=1,
                                update=lambda named: _server_update(Broken(), named, loader.LOADER))
    assert not loader._receivers  # the failed connection is not kept
    assert threading.active_count() < 50


def test_an_answer_before_the_loaders_connect_is_raised_at_once(tmp_path):
    """SGLang outside begin_weight_update / end_weight_update answers (False, message) without calling the loader:
    send_version raises it then, not a WaitTimeoutError after its whole timeout."""
    import time

    from dmabuf_interop.errors import InvalidArgumentError

    refusal = (False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
    with WeightPublisher(str(tmp_path / "w.sock"), max_bytes=1 << 20, timeout=20) as pub:
        t0 = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="begin_weight_update"):
            loader.send_version(pub, Model().state_dict(), 1, engines=1, update=lambda named: refusal)
        assert time.monotonic() - t0 < 5
        with pytest.raises(ZeroDivisionError):  # and what update raised, as soon
            loader.send_version(pub, Model().state_dict(), 1, engines=1, update=lambda named: 1 / 0)
        assert time.monotonic() - t0 < 10 and pub.engines == 0
