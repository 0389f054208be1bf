"""The weight-sync core over host pools: real sockets, a publisher and receivers in threads.

What is checked: every version arrives whole and equal; a model larger than the pool goes in buckets
through the same pool; several engines receive one version; a version that stops part-way is
reported on both ends with how much was applied, and the next version still arrives; the peer's meta
is checked; dtypes the wire lacks come back as themselves.
"""

from __future__ import annotations

import pickle
import threading

import pytest

torch = pytest.importorskip("torch", reason="weight sync moves torch tensors; CI installs torch==2.13.0 (CPU)")

from dmabuf_interop.channel import SharedPool, listen  # noqa: E402
from dmabuf_interop.errors import IncompleteVersionError, InvalidArgumentError, ProtocolError  # noqa: E402
from dmabuf_interop.fd import open_fds  # noqa: E402
from dmabuf_interop.weight_sync import WeightPublisher, WeightReceiver  # noqa: E402


def _state(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(64, 48, generator=g).to(torch.bfloat16) for i in range(n)}
    out["norm"] = torch.randn(48, generator=g)  # float32
    out["scale"] = torch.tensor(float(seed)).to(torch.float8_e4m3fn)  # no wire name: travels as uint8
    out["step"] = torch.tensor(seed, dtype=torch.int64)
    return out


class Engine(threading.Thread):
    """Receives ``versions`` versions with ``load``, keeping a copy of each; errors kept, not raised."""

    def __init__(self, address: str, versions: int, load=None, prefetch: bool = False) -> None:
        super().__init__(daemon=True)
        self.address, self.versions, self.load_fn, self.prefetch = address, versions, load, prefetch
        self.got: dict[int, dict[str, torch.Tensor]] = {}
        self.errors: list[BaseException] = []
        self.ready = threading.Event()

    def run(self) -> None:
        with WeightReceiver(self.address, timeout=30, wait=True, prefetch=self.prefetch) as rx:
            self.ready.set()
            for _ in range(self.versions):
                seen: dict[str, torch.Tensor] = {}

                def load(items):
                    if self.load_fn is not None:
                        self.load_fn(items)
                    for name, t in items:
                        seen[name] = t.clone()

                try:
                    v = rx.load(load)
                    self.got[v] = seen
                except Exception as exc:  # noqa: BLE001 - the test reads it
                    self.errors.append(exc)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8)
                                        if a[k].dim() else a[k].reshape(1).view(torch.uint8),
                                        b[k].view(torch.uint8) if b[k].dim() else b[k].reshape(1).view(torch.uint8))
                                        for k in a)


def test_versions_arrive_whole_and_staging_is_kept(tmp_path):
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20, chunk_bytes=1 << 18) as pub:
        eng = Engine(addr, 3)
        eng.start()
        pub.accept(timeout=30)
        states = [_state(v) for v in range(3)]
        reports = [pub.publish(s, v) for v, s in enumerate(states)]
        eng.join(60)
        pub.wait(30)
        assert not eng.errors and sorted(eng.got) == [0, 1, 2]
        for v, s in enumerate(states):
            assert _equal(eng.got[v], s)
        assert all(r.kept and r.engines == 1 and r.batches > 1 for r in reports)  # streamed in batches
        assert reports[0].staged_bytes == reports[0].bytes  # ordinary tensors: one copy into the pool


def test_a_model_larger_than_the_pool_goes_in_buckets_through_the_same_pool(tmp_path):
    addr = str(tmp_path / "w.sock")
    state = {f"t{i}": torch.full((128, 256), i, dtype=torch.bfloat16) for i in range(16)}  # 16 x 64 KiB
    with WeightPublisher(addr, max_bytes=256 << 10, chunk_bytes=64 << 10, stream_batches=1) as pub:
        eng = Engine(addr, 2)
        eng.start()
        pub.accept(timeout=30)
        reports = [pub.publish(state, v) for v in range(2)]
        eng.join(60)
        assert not eng.errors and _equal(eng.got[1], state)
        assert not reports[0].kept and reports[0].batches >= 8  # at most half the pool per batch
        assert pub.pool.capacity <= 256 << 10  # reused, never grown past max_bytes


def test_several_engines_receive_the_same_version(tmp_path):
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20) as pub:
        engines = [Engine(addr, 1) for _ in range(3)]
        for e in engines:
            e.start()
        for _ in engines:
            pub.accept(timeout=30)
        state = _state(7)
        report = pub.publish(state, 7)
        for e in engines:
            e.join(60)
            assert not e.errors and _equal(e.got[7], state)
        assert report.engines == 3 and report.staged_bytes == report.bytes  # staged once for all three


def test_parameters_in_the_pool_are_lent_not_copied(tmp_path):
    addr = str(tmp_path / "w.sock")
    with SharedPool(None, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        params = {f"p{i}": torch.from_numpy(pool.empty((256, 64), "float32")) for i in range(4)}
        for i, p in enumerate(params.values()):
            p.fill_(i)
        with WeightPublisher(addr, pool=pool) as pub:
            eng = Engine(addr, 1)
            eng.start()
            pub.accept(timeout=30)
            report = pub.publish(params, 1)
            eng.join(60)
            assert report.staged_bytes == 0 and _equal(eng.got[1], params)


def test_load_into_copies_in_place_and_refuses_a_stranger(tmp_path):
    addr = str(tmp_path / "w.sock")
    module = torch.nn.Linear(32, 16)
    trainer = torch.nn.Linear(32, 16)
    out: dict[str, object] = {}

    def engine():
        with WeightReceiver(addr, timeout=30, wait=True) as rx:
            out["v"] = rx.load_into(module)
            try:
                rx.load_into(module)
            except IncompleteVersionError as exc:
                out["err"] = exc
                out["partial"] = rx.partial

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=1) as pub:
        pub.accept(timeout=30)
        weight = module.weight
        pub.publish(trainer.state_dict(), 1)
        pub.publish({"other.weight": torch.zeros(3)}, 2)
        th.join(60)
    assert out["v"] == 1 and module.weight is weight and torch.equal(module.weight, trainer.weight)
    err = out["err"]
    assert err.version == 2 and err.applied == 0 and "no other.weight" in err.reason and out["partial"] == 2


def test_a_loader_that_fails_part_way_is_reported_and_the_next_version_arrives(tmp_path):
    addr = str(tmp_path / "w.sock")
    calls = {"n": 0}

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 2:  # the second batch of the first version
            raise RuntimeError("engine out of memory")

    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=4) as pub:
        eng = Engine(addr, 2, load=flaky)
        eng.start()
        pub.accept(timeout=30)
        pub.publish(_state(1), 1)
        pub.wait(30)  # the engine gave the broken version back
        state = _state(2)
        pub.publish(state, 2)
        eng.join(60)
    (err,) = eng.errors
    assert isinstance(err, IncompleteVersionError) and err.version == 1 and err.applied == 1
    assert "engine out of memory" in str(err) and err.batches > 2
    assert list(eng.got) == [2] and _equal(eng.got[2], state)  # the rest of version 1 was skipped


class _Exploding(torch.Tensor):
    """Its copy into the pool fails: a trainer that breaks after a first batch went out."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("the trainer's tensor went bad")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_trainer_that_fails_part_way_tells_the_engines(tmp_path):
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=4) as pub:
        eng = Engine(addr, 2)
        eng.start()
        pub.accept(timeout=30)
        state = _state(3)
        state["zzz"] = torch.ones(64, 48).as_subclass(_Exploding)  # last: after the first batches
        with pytest.raises(IncompleteVersionError) as sent:
            pub.publish(state, 3)
        assert sent.value.applied >= 1 and "went bad" in sent.value.reason
        pub.wait(30)
        good = _state(4)
        pub.publish(good, 4)
        eng.join(60)
    (err,) = eng.errors
    assert isinstance(err, IncompleteVersionError) and err.version == 3 and 1 <= err.applied < err.batches
    assert "the trainer aborted" in err.reason and _equal(eng.got[4], good)


def _nested() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: nested tensors are a prototype)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


def test_bad_input_is_refused_before_anything_is_sent(tmp_path):
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20, chunk_bytes=1 << 18) as pub:
        with pytest.raises(InvalidArgumentError, match="no engine"):
            pub.publish({"a": torch.zeros(2)}, 1)
        eng = Engine(addr, 1)
        eng.start()
        pub.accept(timeout=30)
        for bad, match in (({"a": [1, 2]}, "torch.Tensor"), ({"a": torch.zeros(2, dtype=torch.uint16)}, "dtype"),
                           ({}, "empty"), ({"a": torch.zeros(2), "b": torch.zeros(2), "a ": 1}, "torch.Tensor"),
                           ({n: torch.zeros(600 << 10, dtype=torch.uint8) for n in "xy"}, "twice its size"),
                           ({"a": torch.zeros(2), "huge": torch.zeros(2 << 20, dtype=torch.uint8)},
                            "huge .* needs a pool of at least twice its size"),
                           ({"a": torch.eye(2).to_sparse()}, "a: a sparse_coo tensor"),
                           ({"a": torch.empty(2, device="meta")}, "a: a meta tensor"),
                           ({"a": _nested()}, "a: a nested tensor")):
            with pytest.raises(InvalidArgumentError, match=match):
                pub.publish(bad, 1)
        with pytest.raises(InvalidArgumentError, match="version"):
            pub.publish({"a": torch.zeros(2)}, -1)
        state = _state(5)
        pub.publish(state, 5)  # nothing of the refused ones reached the engine
        eng.join(60)
        assert not eng.errors and _equal(eng.got[5], state)


def test_a_batch_without_the_protocol_is_the_peers_fault(tmp_path):
    addr = str(tmp_path / "w.sock")
    with SharedPool(None, chunk_bytes=1 << 20, max_bytes=1 << 20) as pool, listen(addr, pool=pool) as lst:
        out: dict[str, BaseException] = {}

        def engine():
            with WeightReceiver(addr, timeout=30, wait=True) as rx:
                for _ in range(2):
                    try:
                        rx.load(lambda items: None)
                    except Exception as exc:  # noqa: BLE001
                        out.setdefault("first", exc) if "first" not in out else out.setdefault("second", exc)

        th = threading.Thread(target=engine, daemon=True)
        th.start()
        ch = lst.accept(timeout=30)
        ch.send_many({"w": pool.empty((4,), "float32")}, meta={"version": 1})
        ch.send_many({"w": pool.empty((4,), "float32")}, meta={"weight_sync": 1, "version": 1, "batch": 0,
                                                              "batches": 1, "keep": True, "dtypes": {"w": "evil"}})
        th.join(30)
        ch.close()
    assert isinstance(out["first"], ProtocolError) and "weight-sync meta" in str(out["first"])
    assert isinstance(out["second"], ProtocolError) and "dtype" in str(out["second"])


def test_incomplete_version_error_pickles():
    err = pickle.loads(pickle.dumps(IncompleteVersionError(3, 2, 9, "gone")))
    assert (err.version, err.applied, err.batches, err.reason) == (3, 2, 9, "gone") and "2 of 9" in str(err)


def test_no_fd_left_behind(tmp_path):
    before = len(open_fds())
    test_versions_arrive_whole_and_staging_is_kept(tmp_path)
    assert len(open_fds()) <= before


def test_accept_while_takes_an_engine_whose_handshake_ends_after_the_call_returned(tmp_path):
    """A peer's ``connect`` returns once it has sent its hello, before the listener has checked it: the
    control-plane call (vLLM's ``init_weight_transfer_engine``) may return first. Here the engine's hello
    is sent 0.3 s after the call returned; the publisher still takes that engine."""
    import socket
    import time

    from dmabuf_interop.channel.handshake import hello, recv_hello
    from dmabuf_interop.channel.wire import send_frame

    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 16) as pub:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late: list[threading.Thread] = []

        def call() -> str:
            sock.connect(addr)
            recv_hello(sock, 30)  # the listener took it (accept(2)) and its handshake thread runs

            def finish() -> None:
                time.sleep(0.3)
                send_frame(sock, hello(None, []))

            late.append(threading.Thread(target=finish, daemon=True))
            late[0].start()
            return "returned"

        try:
            assert pub.accept_while(call, timeout=30) == "returned"
            assert pub.engines == 1
        finally:
            late[0].join(30)
            sock.close()


def test_the_same_tensors_sent_again_reuse_the_plan_and_a_changed_one_is_sent_as_it_is_now(tmp_path):
    """A trainer hands over the same parameter objects every step: the publisher keeps its items and plan.
    Whatever changed about a tensor (new storage behind the same object, a transposed square view) ends that."""
    addr = str(tmp_path / "w.sock")
    with SharedPool(None, chunk_bytes=1 << 20, max_bytes=4 << 20) as pool:
        params = {f"p{i}": torch.from_numpy(pool.empty((32, 32), "float32")) for i in range(4)}
        for i, p in enumerate(params.values()):
            p.copy_(torch.arange(1024, dtype=torch.float32).reshape(32, 32) + i)
        params["plain"] = torch.ones(8)  # staged: outside the pool
        with WeightPublisher(addr, pool=pool, stream_batches=2) as pub:
            eng = Engine(addr, 4)
            eng.start()
            pub.accept(timeout=30)
            sent = []
            pub.publish(params, 0)
            sent.append({k: v.contiguous().clone() for k, v in params.items()})
            first = pub._last
            pub.wait(30)  # lent, not copied: written only once the engine gave the version back
            params["p1"].add_(5)  # written in place: the same items, sent again
            params["plain"].fill_(3)
            pub.publish(params, 1)
            sent.append({k: v.contiguous().clone() for k, v in params.items()})
            assert pub._last is first  # the items and the plan were used again
            pub.wait(30)
            params["p2"].data = params["p2"].data.t()  # same object, same pointer and shape, other strides
            pub.publish(params, 2)
            sent.append({k: v.contiguous().clone() for k, v in params.items()})
            assert pub._last is not first
            pub.wait(30)
            params["p3"].data = torch.full((32, 32), 9.0)  # new storage behind the same object: staged now
            report = pub.publish(params, 3)
            sent.append({k: v.contiguous().clone() for k, v in params.items()})
            eng.join(60)
            pub.wait(30)
        assert not eng.errors
        for v, want in enumerate(sent):
            assert _equal(eng.got[v], want), v
        assert report.staged_bytes == 4 * 8 + 2 * 32 * 32 * 4  # plain, p2 (not contiguous now) and p3


def test_a_state_dict_sent_again_reaches_the_loader_as_the_views_made_last_version(tmp_path):
    """The same state dict in the same blocks: the loader gets last version's tensor objects again, holding
    this version's values. A tensor whose shape changed gets a new view, of its new shape."""
    addr = str(tmp_path / "w.sock")
    state = {f"w{i}": torch.full((16, 16), float(i)) for i in range(12)}
    handed: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []

    def engine() -> None:
        with WeightReceiver(addr, timeout=30, wait=True) as rx:
            for _ in range(3):
                seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
                rx.load(lambda items: seen.update((n, (t, t.clone())) for n, t in items))
                handed.append(seen)

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=2) as pub:
        pub.accept(timeout=30)
        report = pub.publish(state, 0)
        state = {n: t + 100 for n, t in state.items()}  # other tensors, same shapes: staged as before
        pub.publish(state, 1)
        state["w5"] = torch.full((8, 32), 7.0)  # another shape, as many bytes
        pub.publish(state, 2)
        th.join(60)
    assert len(handed) == 3 and report.batches >= 2
    assert all(handed[1][n][0] is handed[0][n][0] for n in handed[0])  # the first of each batch too
    for v, want in ((1, 100.0), (2, 100.0)):
        for i in range(12):
            n = f"w{i}"
            if n != "w5" or v == 1:
                assert torch.equal(handed[v][n][1], torch.full((16, 16), i + want)), (v, n)
    assert handed[2]["w5"][0] is not handed[1]["w5"][0] and handed[2]["w5"][0].shape == (8, 32)
    assert torch.equal(handed[2]["w5"][1], torch.full((8, 32), 7.0))


def test_a_version_read_whole_and_never_released_is_given_back_once_collected(tmp_path):
    """``for name, t in rx.receive()`` with no release(): the receiver keeps the tensors made for that version
    (Note [kept views]), and each keeps its item held, so the channel's safety net alone never gives the version
    back (the trainer waited out its timeout); the version's own does, once it is collected."""
    addr = str(tmp_path / "w.sock")
    state = {f"w{i}": torch.full((16, 16), float(i)) for i in range(4)}
    got: list[dict[str, torch.Tensor]] = []

    def engine() -> None:
        with WeightReceiver(addr, timeout=30, wait=True) as rx:
            for _ in range(3):
                got.append({n: t.clone() for n, t in rx.receive()})  # never released

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    with WeightPublisher(addr, max_bytes=1 << 20, timeout=5) as pub:
        pub.accept(timeout=30)
        for v in range(3):
            pub.publish({n: t + v for n, t in state.items()}, v)  # first waits for the version before
        pub.wait(5)
        th.join(30)
    assert len(got) == 3
    assert all(torch.equal(got[v][f"w{i}"], torch.full((16, 16), i + v)) for v in range(3) for i in range(4))


def test_parameters_that_require_grad_are_sent_again_with_their_new_values(tmp_path):
    """A module's parameters (requires_grad) handed over every step, updated in place in between: the
    second version reuses the plan and still sends what the parameters hold now."""
    addr = str(tmp_path / "w.sock")
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=3) as pub:
        eng = Engine(addr, 2)
        eng.start()
        pub.accept(timeout=30)
        pub.publish(dict(model.named_parameters()), 0)
        first = pub._last
        pub.wait(30)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-2)  # an optimizer step: in place
        pub.publish(dict(model.named_parameters()), 1)
        assert pub._last is first
        eng.join(60)
    assert not eng.errors
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert _equal(eng.got[1], want) and all(p.requires_grad for p in model.parameters())


def test_the_next_batch_is_taken_while_the_caller_holds_one_and_given_back_if_it_stops(tmp_path):
    """The receiver takes batch i+1 in its prefetch worker while batch i is in the caller's hands, never
    a batch of the next version; a caller that stops part-way gives back the batch taken ahead too."""
    import time

    addr = str(tmp_path / "w.sock")
    state = {f"t{i}": torch.full((64, 64), i, dtype=torch.float32) for i in range(12)}
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=4) as pub:
        out: dict[str, object] = {}
        go = threading.Event()

        def engine() -> None:
            with WeightReceiver(addr, timeout=30, wait=True, prefetch=True) as rx:
                rv = rx.receive()
                it = rv.batches()
                next(it)
                go.wait(30)  # the whole version has been sent
                deadline = time.monotonic() + 10
                while rv.taken < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                out["taken_with_one_held"] = rv.taken
                it.close()
                rv.drain()  # stops part-way: everything taken is given back, the rest taken and given back
                out["partial"] = rx.version
                out["next"] = rx.load(lambda items: out.setdefault("names", [n for n, _ in items]))

        th = threading.Thread(target=engine, daemon=True)
        th.start()
        pub.accept(timeout=30)
        report = pub.publish(state, 1)
        go.set()
        pub.wait(30)  # every batch of version 1 came back, the one taken ahead included
        pub.publish(state, 2)
        th.join(60)
        assert report.batches > 2
        assert out["taken_with_one_held"] == 2 and out["next"] == 2


def test_the_publisher_holds_nothing_of_the_callers_tensors_between_versions(tmp_path):
    import gc
    import weakref

    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20) as pub:
        eng = Engine(addr, 1)
        eng.start()
        pub.accept(timeout=30)
        state = _state(11)
        refs = [weakref.ref(t) for t in state.values()]
        pub.publish(state, 11)
        eng.join(60)
        pub.wait(30)
        del state
        gc.collect()
        assert all(r() is None for r in refs)  # the staged copies are the pool's; the caller's tensors are free


def test_buckets_with_large_tensors_in_a_pool_of_several_chunks(tmp_path):
    """ws-8b's shape in miniature (1/1024 of its bytes, a 4 MiB pool of 2 MiB chunks): an embedding, 36
    layers and an lm_head each about a third of the pool's free half. Staged item by item, a batch's
    blocks spread over both chunks and left no hole for the lm_head: it waited for room until the timeout.
    The two halves of one staging block never fragment."""
    addr = str(tmp_path / "w.sock")
    g = torch.Generator().manual_seed(5)
    state = {"embed": torch.randn(605_000, generator=g).to(torch.bfloat16)}
    for i in range(36):
        for k, n in (("q", 16384), ("k", 4096), ("v", 4096), ("o", 16384), ("g", 48000), ("u", 48000), ("d", 48000)):
            state[f"l{i}.{k}"] = torch.randn(n, generator=g).to(torch.bfloat16)
    state["lm_head"] = torch.randn(605_000, generator=g).to(torch.bfloat16)
    with WeightPublisher(addr, max_bytes=4 << 20, timeout=10) as pub:
        eng = Engine(addr, 3)
        eng.start()
        pub.accept(timeout=30)
        reports = [pub.publish(state, v) for v in range(3)]
        pub.wait(30)
        eng.join(60)
        assert pub.pool.capacity <= 4 << 20
    assert not eng.errors and sorted(eng.got) == [0, 1, 2]
    assert all(_equal(eng.got[v], state) for v in range(3))
    assert all(not r.kept and r.batches > 2 for r in reports)


def test_an_engine_that_exits_with_a_batch_being_taken_ahead_exits_at_once(tmp_path):
    """The prefetch worker waits for batch 1 (which never comes) when the engine's program ends without
    closing anything: the interpreter exits at once, not after the batch timeout (60 s here)."""
    import subprocess
    import sys
    import textwrap
    import time

    addr = str(tmp_path / "w.sock")
    script = textwrap.dedent(f"""
        import sys
        from dmabuf_interop.weight_sync import WeightReceiver
        rx = WeightReceiver({addr!r}, timeout=60, wait=True, prefetch=True)
        rv = rx.receive()
        it = rv.batches()
        next(it)  # batch 0 of 2; the worker now waits for batch 1
        print("took batch 0", flush=True)
        sys.exit(0)
    """)
    with SharedPool(None, chunk_bytes=1 << 20, max_bytes=1 << 20) as pool, listen(addr, pool=pool) as lst:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            ch = lst.accept(timeout=30)
            ch.send_many({"w": pool.empty((4,), "float32")}, meta={"weight_sync": 1, "version": 1, "batch": 0,
                                                                  "batches": 2, "keep": True, "tensors": 2})
            assert child.stdout.readline().strip() == "took batch 0"
            t0 = time.monotonic()
            assert child.wait(timeout=30) == 0
            assert time.monotonic() - t0 < 10
            ch.close()
        finally:
            child.kill()
            child.wait()


def _bucketed_state(v: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64 * 1024,), float(v)) for i in range(8)}  # 8 x 256 KiB float32, staged


@pytest.mark.parametrize("prefetch", [False, True], ids=["in-turn", "prefetch"])
def test_a_loader_that_fails_in_a_bucketed_version_is_reported_at_once(tmp_path, prefetch):
    """Buckets (a 1 MiB pool): the receiver gives batch i-1 back as it takes batch i, so the trainer can stage
    batch i+1 (which a prefetch worker waits for). A loader that fails on batch 1 is reported at once and the
    next version arrives, with no wait for the trainer's timeout."""
    import time

    addr = str(tmp_path / "w.sock")
    calls = {"n": 0}

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("engine out of memory")

    with WeightPublisher(addr, max_bytes=1 << 20, timeout=20) as pub:
        eng = Engine(addr, 2, load=flaky, prefetch=prefetch)
        eng.start()
        pub.accept(timeout=30)
        t0 = time.monotonic()
        first = pub.publish(_bucketed_state(1), 1)
        pub.wait(20)
        state = _bucketed_state(2)
        pub.publish(state, 2)
        eng.join(60)
        elapsed = time.monotonic() - t0
    assert not first.kept and first.batches > 2
    (err,) = eng.errors
    assert isinstance(err, IncompleteVersionError) and "engine out of memory" in err.reason
    assert _equal(eng.got[2], state) and elapsed < 10


def test_a_bucketed_version_that_fails_part_way_still_tells_the_engines(tmp_path):
    """The bucket staging takes what the pool has free; the abort batch lends a byte of that staging, so the
    engines are told (not cut off) and the next version arrives."""
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=1 << 20, timeout=20) as pub:
        eng = Engine(addr, 2)
        eng.start()
        pub.accept(timeout=30)
        state = _bucketed_state(3)
        state["zzz"] = torch.ones(64 * 1024).as_subclass(_Exploding)  # its copy into the pool fails, last
        with pytest.raises(IncompleteVersionError, match="went bad"):
            pub.publish(state, 3)
        pub.wait(20)
        good = _bucketed_state(4)
        report = pub.publish(good, 4)
        eng.join(60)
        assert report.engines == 1  # the engine was told, not cut off
    (err,) = eng.errors
    assert isinstance(err, IncompleteVersionError) and "the trainer aborted" in err.reason
    assert _equal(eng.got[4], good)


def test_buckets_in_a_pool_whose_free_bytes_are_split_over_chunks(tmp_path):
    """The trainer keeps 600 KiB blocks of its own in each 1 MiB chunk of a 4 MiB pool: no block of twice a
    bucket fits, so the buckets are two blocks apart, sized to what the chunks have."""
    addr = str(tmp_path / "w.sock")
    with WeightPublisher(addr, max_bytes=4 << 20, chunk_bytes=1 << 20, timeout=10, stream_batches=1) as pub:
        own = [pub.pool.empty((600 * 1024,), "uint8", timeout=0) for _ in range(4)]
        eng = Engine(addr, 2)
        eng.start()
        pub.accept(timeout=30)
        states = [{f"w{i}": torch.full((220 * 256,), float(v)) for i in range(8)} for v in (1, 2)]
        reports = [pub.publish(s, v) for v, s in zip((1, 2), states)]
        eng.join(60)
        assert len(own) == 4 and pub.pool.capacity <= 4 << 20
    assert not eng.errors and all(_equal(eng.got[v], s) for v, s in zip((1, 2), states))
    assert all(not r.kept for r in reports)


def test_a_version_given_back_part_way_is_skipped_with_its_abort(tmp_path):
    """An engine stops reading version 1 after its second batch and gives it back; the trainer then aborts
    version 1. The engine's next load skips the rest of version 1 and its abort, and returns version 2."""
    addr = str(tmp_path / "w.sock")
    out: dict[str, object] = {}
    stopped = threading.Event()

    def engine() -> None:
        with WeightReceiver(addr, timeout=30, wait=True) as rx:
            with rx.receive() as rv:
                for b in rv.batches():
                    if b.index == 1:
                        break
            stopped.set()
            out["next"] = rx.load(lambda items: None)

    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=4) as pub:
        th = threading.Thread(target=engine, daemon=True)
        th.start()
        pub.accept(timeout=30)
        pub.publish(_state(1), 1)
        assert stopped.wait(30)
        pub.abort(1, "the trainer gave up on version 1")
        pub.wait(30)
        pub.publish(_state(2), 2)
        th.join(60)
    assert out["next"] == 2


def test_a_version_read_whole_by_iterating_is_the_receivers_version(tmp_path):
    """A version given back part-way, then one read whole through ``receive()`` (not ``load()``): the receiver's
    ``version`` is the whole one and ``partial`` is cleared, as after ``load()`` (``partial`` still named the
    version given back, and an abort of that number would have been skipped as its end)."""
    addr = str(tmp_path / "w.sock")
    state = {f"t{i}": torch.full((64, 64), float(i)) for i in range(8)}
    out: dict[str, object] = {}
    go = threading.Event()

    def engine() -> None:
        with WeightReceiver(addr, timeout=30, wait=True) as rx:
            with rx.receive() as v:
                next(v.batches())  # batch 0 of version 1, then given back part-way
            out["partial"] = rx.partial
            go.set()
            with rx.receive() as v:
                out["names"] = [n for n, _ in v]
            out["after"] = (rx.version, rx.partial)

    th = threading.Thread(target=engine, daemon=True)
    th.start()
    with WeightPublisher(addr, max_bytes=1 << 20, stream_batches=4) as pub:
        pub.accept(timeout=30)
        pub.publish(state, 1)
        assert go.wait(30)
        pub.publish(state, 2)
        pub.wait(30)
        th.join(30)
    assert out["partial"] == 1 and out["names"] == list(state) and out["after"] == (2, None)


def test_an_engine_killed_mid_run_is_dropped_and_the_others_go_on(tmp_path):
    """Two engines; one is SIGKILLed while it holds version 1. The publisher drops its channel (its leases
    completed as disconnected) and version 2 reaches the other, whole."""
    import signal
    import subprocess
    import sys
    import textwrap

    addr = str(tmp_path / "w.sock")
    victim_src = textwrap.dedent(f"""
        import time
        from dmabuf_interop.weight_sync import WeightReceiver
        rx = WeightReceiver({addr!r}, timeout=60, wait=True)
        rv = rx.receive()
        for b in rv.batches():
            pass
        print("holding version", rv.version, flush=True)
        time.sleep(60)
    """)
    with WeightPublisher(addr, max_bytes=1 << 20) as pub:
        survivor = Engine(addr, 2)
        survivor.start()
        pub.accept(timeout=30)
        victim = subprocess.Popen([sys.executable, "-c", victim_src], stdout=subprocess.PIPE, text=True)
        try:
            pub.accept(timeout=30)
            pub.publish(_state(1), 1)
            assert victim.stdout.readline().strip() == "holding version 1"
            victim.send_signal(signal.SIGKILL)
            victim.wait(30)
            pub.wait(30)  # the victim's leases complete as disconnected
            state = _state(2)
            report = pub.publish(state, 2)
            engines = pub.engines
            survivor.join(60)
        finally:
            victim.kill()
            victim.wait()
        assert report.engines == 1 and engines == 1
    assert not survivor.errors and _equal(survivor.got[2], state)


class _OneTensorModel:
    """An engine's model of one 1000-element tensor, whose ``load_weights`` copies into it."""

    def __init__(self) -> None:
        self.w = torch.zeros(1000)

    def load_weights(self, items):
        for _, t in items:
            self.w.copy_(t)


class _InProcessClient:
    """vLLM's weight-sync client calling a worker engine in this process; a test's subclass says what
    ``start_weight_update`` and ``update_weights`` do (``starts`` counts the former's calls)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.starts = 0

    def init_weight_transfer_engine(self, info):
        from dmabuf_interop.integrations.vllm import InitInfo

        self.worker.init_transfer_engine(InitInfo(**info))

    def finish_weight_update(self):
        pass


def _vllm_trainer(tmp_path, client, weights: dict, timeout: float):
    """The vLLM backend's trainer over a 1 MiB host pool, sending ``weights`` (as they are at each round)
    through ``client``, a vLLM weight-sync client."""
    from dmabuf_interop.integrations.vllm import TrainerEngine, TrainerOptions

    class Source:
        def iter_full(self):
            return iter(weights.items())

    options = TrainerOptions(address=str(tmp_path / "w.sock"), max_bytes=1 << 20, timeout=timeout)
    return TrainerEngine.trainer_init(options, client=client, source=Source())


def test_the_vllm_trainer_goes_on_after_a_start_weight_update_that_timed_out(tmp_path):
    """``start_weight_update`` outlasts the trainer's timeout once: that round fails, and its update_weights
    is never sent; the next rounds go through at once on a new control-plane thread."""
    import time

    from dmabuf_interop.integrations.vllm import UpdateInfo, WorkerEngine

    model = _OneTensorModel()
    worker = WorkerEngine(torch.device("cpu"), model)
    updates: list[int] = []

    class Client(_InProcessClient):
        def start_weight_update(self):
            self.starts += 1
            if self.starts == 1:
                time.sleep(2.0)

        def update_weights(self, info):
            updates.append(info["version"])
            worker.receive_weights(UpdateInfo(**info))

    weights = {"w": torch.zeros(1000)}
    engine = _vllm_trainer(tmp_path, Client(worker), weights, timeout=1.0)
    try:
        from dmabuf_interop.errors import WaitTimeoutError

        with pytest.raises(WaitTimeoutError, match="start_weight_update"):
            engine.send_weights()
        for k in (2, 3):
            weights["w"].fill_(k)
            t0 = time.monotonic()
            assert engine.send_weights() == k
            assert time.monotonic() - t0 < 1.0 and model.w[0].item() == k
        time.sleep(1.5)  # round 1's start returns now: its update_weights must not follow
        assert updates == [2, 3]
    finally:
        engine.shutdown()
        worker.shutdown()


def test_the_vllm_trainer_sends_nothing_when_start_weight_update_fails_and_tells_of_a_refused_state_dict(tmp_path):
    """A ``start_weight_update`` that fails (the engine refuses) is raised and nothing is sent, so the next
    round arrives as it is; a state dict refused after a start that went through is told to the engine (its
    ``update_weights`` fails), and the next round arrives too."""
    from dmabuf_interop.integrations.vllm import UpdateInfo, WorkerEngine

    model = _OneTensorModel()
    worker = WorkerEngine(torch.device("cpu"), model)
    updates: list[tuple[int, str]] = []

    class Client(_InProcessClient):
        def start_weight_update(self):
            self.starts += 1
            if self.starts == 1:
                raise RuntimeError("the engine is busy")

        def update_weights(self, info):
            try:
                worker.receive_weights(UpdateInfo(**info))
                updates.append((info["version"], "ok"))
            except IncompleteVersionError as exc:
                updates.append((info["version"], type(exc).__name__))
                raise

    weights: dict[str, object] = {"w": torch.zeros(1000)}
    engine = _vllm_trainer(tmp_path, Client(worker), weights, timeout=10.0)
    try:
        with pytest.raises(RuntimeError, match="busy"):
            engine.send_weights()
        weights["w"].fill_(2)
        assert engine.send_weights() == 2 and model.w[0].item() == 2
        weights["bad"] = "not a tensor"
        with pytest.raises(InvalidArgumentError, match="bad"):
            engine.send_weights()
        del weights["bad"]
        weights["w"].fill_(4)
        assert engine.send_weights() == 4 and model.w[0].item() == 4
        assert updates == [(2, "ok"), (3, "IncompleteVersionError"), (4, "ok")]
    finally:
        engine.shutdown()
        worker.shutdown()
