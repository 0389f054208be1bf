"""A channel server that stays up (CPU): flow control, one set of limits, the dtypes users send, the API.

Real sockets, forks and fds, no mocks. Scenarios that could hang run in a forked child with a hard bound
(:func:`tests.helpers.bounded.bounded`). Each test states the behaviour expected of the library; those
marked ``xfail`` show a fault that is still there (the reason names it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dmabuf_interop import errors
from dmabuf_interop.channel import SharedPool, connect, listen
from dmabuf_interop.errors import InvalidArgumentError, NotSupportedError, PeerClosedError, PoolExhaustedError
from dmabuf_interop.fd import open_fds
from dmabuf_interop.fdpass import recv_token
from tests.helpers import env_with_src
from tests.helpers.bounded import bounded, child, error, reap
from tests.helpers.channels import connect_in_thread, local_pair

ROOT = Path(__file__).resolve().parents[2]



@pytest.fixture
def addr(tmp_path: Path) -> str:
    return str(tmp_path / "s.sock")


@pytest.fixture
def pool():
    with SharedPool(chunk_bytes=1 << 20, max_bytes=16 << 20) as p:
        yield p


# --------------------------------------------------------------------------- backpressure


def test_a_consumer_that_stops_receiving_pushes_the_producer_back(addr: str) -> None:
    limit = 20000

    def scenario() -> dict[str, Any]:
        def consumer() -> dict[str, Any]:
            with SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20) as cpool:
                ch = connect(addr, timeout=3, wait=True, pool=cpool)
                ch.send(cpool.empty(4, "int32"))  # its reader thread runs from now on
                time.sleep(30)  # and it never calls recv()
                ch.close()
            return {}

        cpid, crfd = child(consumer)
        pool = SharedPool(chunk_bytes=1 << 16, max_bytes=1 << 20)
        lst = listen(addr, pool=pool)
        ch = lst.accept(timeout=3)
        ch.recv(3).release()
        a = pool.empty(4, "int32")
        sent, pushed_back, waited = 0, None, None
        t_end = time.monotonic() + 5
        while sent < limit and time.monotonic() < t_end:
            t0 = time.monotonic()
            try:
                ch.send(a, timeout=0.5)
            except BaseException as exc:  # noqa: BLE001
                pushed_back, waited = type(exc).__name__, time.monotonic() - t0
                break
            sent += 1
        with open(f"/proc/{cpid}/status") as fh:
            rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        os.kill(cpid, 9)
        reap(cpid)
        os.close(crfd)
        return {"sent": sent, "pushed_back": pushed_back, "waited": waited, "consumer_rss_kib": rss}

    out = bounded(scenario, 10)
    assert out["pushed_back"] == "WaitTimeoutError" and out["waited"] < 1.5, out
    assert out["sent"] < 5000, out


# --------------------------------------------------------------------------- one set of limits


def test_an_array_the_receiver_would_refuse_is_refused_before_sending(addr: str, pool: SharedPool) -> None:
    lst, prod, cons = local_pair(addr, pool=pool)
    try:
        try:
            prod.send(np.zeros((1,) * 33, "int8"))
            refused = False
        except InvalidArgumentError:
            refused = True
        prod.send(np.arange(3))
        if not refused:  # the receiver takes it
            with cons.recv(2) as r:
                assert r.shape == (1,) * 33
        with cons.recv(2) as r:
            assert r.as_array().tolist() == [0, 1, 2]
    finally:
        cons.close()
        prod.close()
        lst.close()


def test_chunks_past_the_receivers_limit_are_refused_before_sending(addr: str) -> None:
    n = 4100
    per_pool = 100  # (several pools: one pool of 4100 chunks takes seconds to fill, each alloc scans every chunk)

    def scenario() -> dict[str, Any]:
        pools = [SharedPool(chunk_bytes=4096, max_bytes=4096 * per_pool) for _ in range(n // per_pool + 1)]
        lst, prod, cons = local_pair(addr, pool=pools[0])
        got: dict[str, Any] = {"n": 0}

        def drain() -> None:
            try:
                while True:
                    cons.recv(3).release()
                    got["n"] += 1
            except BaseException as exc:  # noqa: BLE001
                got["end"] = error(exc)

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        held, refused = [], None
        for i in range(n):
            a = pools[i // per_pool].empty(1024, "int32")  # a chunk of its own: the others are held
            held.append(a)
            try:
                prod.send(a)
            except (InvalidArgumentError, PoolExhaustedError) as exc:
                refused = {"at": i, **error(exc)}
                break
            except BaseException as exc:  # noqa: BLE001
                refused = {"at": i, **error(exc), "torn_down": True}
                break
        try:
            prod.send(held[0])  # the channel is still up
            still_up: Any = True
        except BaseException as exc:  # noqa: BLE001
            still_up = error(exc)
        time.sleep(0.5)
        prod.close()
        t.join(5)
        cons.close()
        lst.close()
        for p in pools:
            p.close()
        return {"refused": refused, "still_up": still_up, "received": got}

    out = bounded(scenario, 20)
    assert out["still_up"] is True, out
    assert out["received"]["end"]["error"] == "PeerClosedError", out  # only our close ended it
    if out["refused"] is None:
        assert out["received"]["n"] == n + 1, out
    else:
        assert out["received"]["n"] == out["refused"]["at"] + 1, out


# --------------------------------------------------------------------------- dtypes


_ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3"]


@pytest.mark.parametrize("name", _ML_DTYPES)
def test_an_ml_dtypes_array_travels_with_its_dtype(addr: str, pool: SharedPool, name: str) -> None:
    dt = np.dtype(getattr(ml_dtypes, name))
    a = np.array([0.5, 1, 2, 4, 0.25, 8, 1, 2], np.float32).astype(dt)
    lst, prod, cons = local_pair(addr, pool=pool)
    try:
        prod.send(a)
        with cons.recv(2) as r:
            got = r.as_array()
            assert r.dtype == name
            assert got.dtype == dt
            assert got.view(np.uint8).tolist() == a.view(np.uint8).tolist()
    finally:
        cons.close()
        prod.close()
        lst.close()


_TORCH_DTYPES = ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "complex32"]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", _TORCH_DTYPES)
def test_a_torch_cpu_tensor_travels_with_its_dtype(addr: str, pool: SharedPool, name: str) -> None:
    torch = pytest.importorskip("torch", reason="a torch tensor needs torch (CI installs the CPU build)")

    dt = getattr(torch, name)
    t = torch.tensor([0.5, 1, 2, 4, 0.25, 8, 1, 2], dtype=torch.float32).to(dt)
    lst, prod, cons = local_pair(addr, pool=pool)
    try:
        prod.send(t)
        with cons.recv(2) as r:
            got = r.as_tensor()
            assert r.dtype == name
            assert got.dtype == dt
            assert got.view(torch.uint8).tolist() == t.view(torch.uint8).tolist()
    finally:
        cons.close()
        prod.close()
        lst.close()


_NO_ML_DTYPES = """
import os, sys, tempfile
sys.modules["ml_dtypes"] = None  # as if not installed: import raises ImportError
import torch
from dmabuf_interop.channel import SharedPool
from dmabuf_interop.errors import InvalidArgumentError
from tests.helpers.channels import connect_in_thread, local_pair
addr = os.path.join(tempfile.mkdtemp(), "s.sock")
with SharedPool(chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
    lst, prod, cons = local_pair(addr, pool=pool)
    for name in ("bfloat16", "float8_e4m3fn"):
        t = torch.tensor([0.5, 1, 2, 4], dtype=torch.float32).to(getattr(torch, name))
        prod.send(t)
        with cons.recv(2) as r:
            try:
                r.as_array()
                print(name, "as_array: no error")
            except InvalidArgumentError as exc:
                print(name, "as_array:", exc)
            print(name, "as_tensor:", r.as_tensor().dtype, r.as_tensor().view(torch.uint8).tolist() ==
                  t.view(torch.uint8).tolist())
    cons.close(); prod.close(); lst.close()
"""


def test_without_ml_dtypes_a_host_bfloat16_or_float8_array_is_refused_by_name_and_as_tensor_works() -> None:
    pytest.importorskip("torch", reason="as_tensor needs torch (CI installs the CPU build)")
    run = subprocess.run([sys.executable, "-c", _NO_ML_DTYPES], capture_output=True, text=True, timeout=60,
                         env=env_with_src(), cwd=ROOT)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for name in ("bfloat16", "float8_e4m3fn"):
        said = next(line for line in lines if line.startswith(f"{name} as_array:"))
        assert "ml_dtypes" in said and name in said, said
        assert f"{name} as_tensor: torch.{name} True" in lines, lines


# --------------------------------------------------------------------------- no pool given


def test_a_channel_without_a_pool_makes_one_on_first_need(addr: str) -> None:
    def scenario() -> dict[str, Any]:
        import gc

        gc.collect()
        fds = open_fds()
        lst, prod, cons = local_pair(addr)  # no pool on either side
        out: dict[str, Any] = {}
        try:
            prod.send(np.arange(10))
            with cons.recv(2) as r:
                out["to_consumer"] = r.as_array().tolist()
            cons.send(np.arange(3, dtype=np.float32))
            with prod.recv(2) as r:
                out["to_producer"] = r.as_array().tolist()
        except BaseException as exc:  # noqa: BLE001
            out.update(error(exc))
        cons.close()
        prod.close()
        lst.close()
        gc.collect()
        time.sleep(0.1)
        gc.collect()
        out["fds_left"] = sorted(set(open_fds()) - set(fds))
        return out

    out = bounded(scenario, 8)
    assert out.get("to_consumer") == list(range(10)) and out.get("to_producer") == [0, 1, 2], out
    assert out["fds_left"] == [], out  # the pool made for the channel is closed with it


def test_a_listeners_pool_made_on_first_need_is_shared_by_its_channels_and_closed_with_the_last(addr: str) -> None:
    def scenario() -> dict[str, Any]:
        import gc

        gc.collect()
        fds = open_fds()
        lst = listen(addr)
        chans, conns = [], []
        for _ in range(2):
            t, out = connect_in_thread(addr, timeout=5)
            chans.append(lst.accept(timeout=5))
            t.join(5)
            conns.append(out["channel"])
        got = []
        for ch, cons in zip(chans, conns):
            ch.send(np.arange(5))
            with cons.recv(2) as r:
                got.append(r.as_array().tolist())
        shared = lst._auto.pools  # (internal: the listener's pools made on first need)
        made = [p.is_host for p in shared.pools]
        for c in conns:
            c.close()
        for ch in chans:
            ch.close()
        open_after_channels = [not p._closed for p in shared.pools]
        lst.close()
        gc.collect()
        return {"got": got, "made": made, "open_after_channels": open_after_channels,
                "fds_left": sorted(set(open_fds()) - set(fds))}

    out = bounded(scenario, 10)
    assert out["got"] == [list(range(5))] * 2, out
    assert out["made"] == [True], out  # one host pool for both channels
    assert out["open_after_channels"] == [True], out  # the listener still holds it
    assert out["fds_left"] == [], out


# --------------------------------------------------------------------------- errors that say what happened


def test_send_and_recv_after_this_ends_close_raise_a_closed_error(addr: str, pool: SharedPool) -> None:
    lst, prod, cons = local_pair(addr, pool=pool)
    prod.close()
    cons.close()
    lst.close()
    with pytest.raises(errors.DmaBufError) as sent:
        prod.send(np.arange(3))
    with pytest.raises(errors.DmaBufError) as received:
        cons.recv(0)
    for info in (sent, received):  # errors.ClosedError: closed by this end, not by the peer
        assert type(info.value).__name__ == "ClosedError", repr(info.value)
        assert not isinstance(info.value, PeerClosedError), repr(info.value)
        assert "closed" in str(info.value)


@pytest.mark.parametrize("dtype", [[("a", "<i4"), ("b", "<f8")], "<U5", "S3"], ids=["structured", "unicode", "bytes"])
def test_a_refused_dtype_is_named_as_it_was_passed(addr: str, pool: SharedPool, dtype: Any) -> None:
    a = np.zeros(3, dtype=dtype)
    lst, prod, cons = local_pair(addr, pool=pool)
    try:
        with pytest.raises(InvalidArgumentError) as info:
            prod.send(a)
        assert str(a.dtype) in str(info.value), str(info.value)
        assert a.dtype.name not in str(info.value).replace(str(a.dtype), ""), str(info.value)
    finally:
        cons.close()
        prod.close()
        lst.close()


def test_a_token_file_readable_by_others_is_refused_or_warned_about(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o644)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            listen("tcp://127.0.0.1:0", token_file=str(token)).close()
            refused = None
        except InvalidArgumentError as exc:
            refused = str(exc)
        except NotSupportedError:  # NIXL not installed: the token was read (and judged) before
            refused = None
    said = [str(w.message) for w in caught] + ([refused] if refused else [])
    assert any("0644" in s or "0o644" in s or "readable by" in s for s in said), said


_NO_NIXL = """
import sys
for name in ("nixl_cu13", "nixl_cu12", "nixl", "nixl._api"):
    sys.modules[name] = None  # as if not installed: import raises ImportError
from dmabuf_interop.channel import listen
from dmabuf_interop.errors import NotSupportedError
try:
    listen("tcp://127.0.0.1:0", token="0123456789abcdef0123456789abcdef")
except NotSupportedError as exc:
    print(exc)
"""


def test_the_nixl_missing_hint_agrees_with_the_readme() -> None:
    run = subprocess.run([sys.executable, "-c", _NO_NIXL], capture_output=True, text=True, timeout=30,
                         env=env_with_src())
    assert run.returncode == 0, run.stderr
    hint = run.stdout.strip()
    assert "NIXL" in hint, hint
    readme = (ROOT / "README.md").read_text()
    assert "--no-deps 'nixl-cu13" in readme  # what the README advises
    assert "--no-deps" in hint and "nixl-cu13" in hint, hint


# --------------------------------------------------------------------------- zero means do not wait


def test_recv_token_with_timeout_zero_takes_a_byte_already_queued() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.send(b"k")
        assert recv_token(b, timeout=0) == b"k"


# --------------------------------------------------------------------------- the channel soak


def test_the_channel_soak_for_a_few_seconds_ends_back_at_its_start(tmp_path: Path) -> None:
    """``scripts/soak_channel.py`` with a few consumers dying by SIGKILL: fds, threads and the pool end as
    they started, and no consumer saw a wrong array or an error."""
    report = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak_channel.py"), "--seconds", "3",
                          "--consumers", "4", "--warmup", "1", "--lifetime", "0.1,1.5", "--json", str(report)],
                         capture_output=True, text=True, timeout=90, env=env_with_src())
    out = json.loads(report.read_text())
    assert run.returncode == 0 and out["passed"], (run.stderr[-2000:], out["back_to_start"], out["consumer_exits"])
    assert out["consumer_exits"].get("killed by SIGKILL", 0) >= 4, out["consumer_exits"]
    assert out["producer"].get("arrays", 0) > 0, out["producer"]
