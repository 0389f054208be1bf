"""vLLM weight-transfer backend ``"dmabuf"``: trainer -> vLLM workers over a channel, no pickle.

Server: ``vllm serve MODEL --weight-transfer-config '{"backend": "dmabuf"}'`` (the backend is
registered through the ``vllm.general_plugins`` entry point :func:`register`). Trainer (a process that
loads no vLLM plugins: it registers the backend itself)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory, ModuleSource
    from dmabuf_interop.integrations.vllm import DmabufTrainerInitInfo, register

    register()                     # "dmabuf" in vLLM's factories (idempotent)
    engine = WeightTransferTrainerFactory.trainer_init(
        DmabufTrainerInitInfo(address="/run/user/1000/w.sock", device=0, rank=0),
        client=client, source=ModuleSource(model))
    engine.send_weights()          # every step: start, update (the channel), finish

The logic lives in :class:`WorkerEngine` and :class:`TrainerEngine`, which need no vLLM (a harness
calls them in vLLM's order); the vLLM classes (``DmabufWeightTransferEngine``,
``DmabufTrainerWeightTransferEngine`` and their info dataclasses) are a thin layer over them, defined
when vLLM imports. What crosses vLLM's control plane is JSON: the init info names the trainer's
socket, the update info a version number.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from .._worker import DaemonWorker
from ..channel.rendezvous import MAX_ADDRESS_BYTES, local_address_ok
from ..errors import IncompleteVersionError, InvalidArgumentError
from ..weight_sync import PublishReport, WeightPublisher, WeightReceiver

__all__ = ["BACKEND", "HAVE_VLLM", "InitInfo", "SocketClient", "TrainerEngine", "TrainerOptions", "UpdateInfo", "WorkerEngine",
           "register", "serve"]

#: The backend's name in vLLM's registries and ``--weight-transfer-config``.
BACKEND = "dmabuf"


def _timeout(value: Any, what: str) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0):
        raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")


@dataclass
class InitInfo:
    """Worker-side init info (JSON): the trainer's socket ``address`` (a path, or ``@name``) and the
    ``timeout`` in seconds for connecting and for each batch of a version.

    Raises:
        ValueError: a field of the wrong type (vLLM's ``parse_init_info`` turns unknown fields into one too).
    """

    address: str
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if not local_address_ok(self.address):
            raise ValueError(f"address must be a socket path or @name of at most {MAX_ADDRESS_BYTES} bytes, "
                             f"got {self.address!r}")
        _timeout(self.timeout, "timeout")


@dataclass
class UpdateInfo:
    """Per-round update info (JSON): the ``version`` the trainer publishes now.

    Raises:
        ValueError: a version that is not an int >= 0.
    """

    version: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version must be an int >= 0, got {self.version!r}")


@dataclass
class TrainerOptions:
    """Trainer-side options: where to listen, the pool (``device``: CUDA ordinal, ``None`` for a host
    pool; ``max_bytes`` in bytes; a model larger goes in buckets), ``timeout`` in seconds for every wait
    on the engines, and ``stream_batches`` (see :class:`~dmabuf_interop.weight_sync.WeightPublisher`)."""

    address: str = ""
    device: int | None = None
    max_bytes: int = 8 << 30
    timeout: float = 300.0
    stream_batches: int = 8

    def __post_init__(self) -> None:
        InitInfo(self.address, self.timeout)  # the same checks as the worker's
        if self.device is not None and (isinstance(self.device, bool) or not isinstance(self.device, int)
                                        or self.device < 0):
            raise ValueError(f"device must be a CUDA ordinal or None, got {self.device!r}")
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {self.max_bytes!r}")


class WorkerEngine:
    """The worker side, in vLLM's order: :meth:`init_transfer_engine` once, then per round
    :meth:`start_weight_update`, :meth:`receive_weights` (one per ``update_weights`` call),
    :meth:`finish_weight_update`; :meth:`shutdown` at the end.

    Args:
        device: the device of the worker's model (a ``torch.device``; CUDA: received memory is mapped
            there; CPU: a host pool's memory is read in place).
        model: anything with ``load_weights(iterable of (name, tensor))`` (vLLM's models do).
    """

    def __init__(self, device: Any, model: Any) -> None:
        self.device = device
        self.model = model
        self.receiver: WeightReceiver | None = None
        self.version: int | None = None  # the last version loaded whole

    def init_transfer_engine(self, info: InitInfo) -> None:
        """Connect to the trainer (which accepts while this runs).

        Raises:
            SyscallError, PeerRefusedError, WaitTimeoutError: as :func:`~dmabuf_interop.channel.connect`.
        """
        self.shutdown()
        index = getattr(self.device, "index", None)
        cuda = getattr(self.device, "type", "cpu") == "cuda"
        if cuda and index is None:
            import torch

            index = torch.cuda.current_device()
        self.receiver = WeightReceiver(info.address, device=index if cuda else None, timeout=info.timeout)

    def start_weight_update(self) -> None:
        """Nothing to prepare: the channel's imports persist from round to round."""

    def receive_weights(self, info: UpdateInfo, load_weights: Callable[[Any], Any] | None = None) -> None:
        """Receive ``info.version`` and hand each batch to ``load_weights`` (default the model's).

        Raises:
            InvalidArgumentError: no ``init_transfer_engine`` yet, or another version arrived.
            IncompleteVersionError: the version stopped part-way (it says how much was loaded).
        """
        if self.receiver is None:
            raise InvalidArgumentError("receive_weights before init_transfer_engine")
        got = self.receiver.load(load_weights or self.model.load_weights)
        if got != info.version:
            raise InvalidArgumentError(f"the trainer sent version {got}, the update named {info.version}")
        self.version = got

    def finish_weight_update(self) -> None:
        """Nothing to finish: :meth:`receive_weights` returns with the weights in the model."""

    def shutdown(self) -> None:
        """Close the channel (the vLLM worker itself keeps running)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


class TrainerEngine:
    """The trainer side: :meth:`trainer_init` rendezvous through ``client`` (vLLM's
    ``VLLMWeightSyncClient``: ``init_weight_transfer_engine``, ``start_weight_update``,
    ``update_weights``, ``finish_weight_update``), then :meth:`send_weights` every round.

    ``source`` is anything with ``iter_full()`` yielding ``(name, tensor)`` (vLLM's ``WeightSource``).
    Rank 0 sends; other ranks iterate the source (its collectives) and send nothing.
    """

    def __init__(self, *, client: Any, source: Any, options: TrainerOptions, is_sender: bool = True) -> None:
        self.client = client
        self.source = source
        self.options = options
        self.is_sender = is_sender
        self.publisher: WeightPublisher | None = None
        self.version = 0
        self.report: PublishReport | None = None  # the last version's
        # One thread, kept from round to round, makes each round's control-plane calls (starting a thread
        # per round cost ~0.3 ms of the round on an H200 host).
        self._rpc: DaemonWorker | None = None

    @classmethod
    def trainer_init(cls, options: TrainerOptions, *, client: Any, source: Any, rank: int = 0) -> "TrainerEngine":
        """Listen, tell the engines to connect (``client.init_weight_transfer_engine`` with the JSON of
        :class:`InitInfo`) and take each while that call runs.

        Raises:
            ValueError: no source, or one without ``iter_full``.
            WaitTimeoutError, SyscallError: as :meth:`WeightPublisher.accept_while`.
        """
        if source is None or not callable(getattr(source, "iter_full", None)):
            raise ValueError("the dmabuf backend sends full tensors: it needs a source with iter_full()")
        engine = cls(client=client, source=source, options=options, is_sender=rank == 0)
        if engine.is_sender:
            o = options
            engine.publisher = WeightPublisher(o.address, device=o.device, max_bytes=o.max_bytes, timeout=o.timeout,
                                               stream_batches=o.stream_batches)
            try:
                info = asdict(InitInfo(o.address, o.timeout))
                engine.publisher.accept_while(lambda: client.init_weight_transfer_engine(info), timeout=o.timeout)
                if engine.publisher.engines == 0:
                    raise InvalidArgumentError("init_weight_transfer_engine returned and no engine connected")
            except BaseException:
                engine.shutdown()
                raise
        return engine

    def send_weights(self, pairs: Iterable[tuple[str, Any]] | None = None) -> int:
        """One round: ``start_weight_update``, then ``update_weights({"version": v})``, both in one thread,
        while the state dict goes over the channels once ``start_weight_update`` has returned;
        ``finish_weight_update``. Returns the version sent.

        Raises:
            IncompleteVersionError: sending stopped part-way (the engines were told).
            WaitTimeoutError: a control-plane call did not return within the options' ``timeout``.
            whatever the client's calls raised (an engine's failure comes back through them).
        """
        pairs = self.source.iter_full() if pairs is None else pairs
        if not self.is_sender:
            for _ in pairs:  # the source's collectives (an FSDP all-gather) run on every rank
                pass
            return self.version
        assert self.publisher is not None
        from ..errors import WaitTimeoutError

        self.version += 1
        version = self.version
        out: dict[str, BaseException] = {}
        started = threading.Event()
        decided = threading.Lock()  # update_weights goes, or the round is given up: one of the two, decided once
        round_state = {"go": False, "given_up": False}

        def rpc() -> None:
            # One thread makes both calls, so update_weights leaves as soon as start_weight_update returns
            # (no thread start between them) while this thread already sends (a speed trick: ~0.3 ms).
            try:
                self.client.start_weight_update()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                out["start"] = exc
                return
            finally:
                started.set()
            with decided:
                if round_state["given_up"]:
                    return  # no engine waits for a version that was never sent
                round_state["go"] = True
            try:
                self.client.update_weights(asdict(UpdateInfo(version)))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                out["error"] = exc

        if self._rpc is None:
            self._rpc = DaemonWorker("dmabuf-interop-update-weights")
        call = self._rpc.submit(rpc)
        if not started.wait(self.options.timeout):
            with decided:
                round_state["given_up"] = not round_state["go"]  # (start may have returned just now)
            if round_state["given_up"]:
                self._rpc.shutdown(timeout=0)  # still in start_weight_update: the next round gets a thread of its own
                self._rpc = None
                raise WaitTimeoutError(f"start_weight_update did not return in {self.options.timeout} s")
        if "start" in out:  # nothing was sent: the engines never began this version
            raise out["start"]
        try:
            self.report = self.publisher.publish(pairs, version)
        except BaseException as exc:
            if not isinstance(exc, IncompleteVersionError):  # refused before a batch went: the engines wait
                self.publisher.abort(version, f"the trainer refused the version: {type(exc).__name__}: {exc}")
            raise
        finally:
            done = concurrent.futures.wait([call], self.options.timeout).done
        if not done:
            self._rpc.shutdown(timeout=0)  # still in update_weights: the next round gets a thread of its own
            self._rpc = None
            raise WaitTimeoutError(f"update_weights of version {version} did not return in {self.options.timeout} s")
        if "error" in out:
            raise out["error"]
        self.client.finish_weight_update()
        self.publisher.wait(self.options.timeout)  # the engines gave the version back: the source may change
        return version

    def shutdown(self) -> None:
        """Close the channels, the listener and the pool, and end the control-plane thread."""
        if self._rpc is not None:
            self._rpc.shutdown(timeout=1.0)  # idle: it ends at once; a call still running ends with the client's timeout
            self._rpc = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


# --- a harness: vLLM's control plane over a socket, without vLLM -----------------------------------------

class SocketClient:
    """A ``VLLMWeightSyncClient`` over a connected AF_UNIX socket (framed JSON, :func:`~dmabuf_interop.fdpass.
    send_message`), answered by :func:`serve` in the engine's process: vLLM's HTTP routes in miniature, so
    the backend runs in vLLM's order where vLLM is not installed (the example, the bench, the GPU tests).

    Raises (each call):
        IncompleteVersionError: the engine's version stopped part-way (as the engine raised it).
        DmaBufError: any other failure in the engine (its type and message).
        PeerClosedError, WaitTimeoutError: the engine went, or did not answer within ``timeout``.
    """

    def __init__(self, sock: Any, timeout: float | None = 300.0) -> None:
        self.sock = sock
        self.timeout = timeout

    def _call(self, method: str, arg: Any = None) -> None:
        from ..errors import DmaBufError, IncompleteVersionError
        from ..fdpass import recv_message, send_message

        send_message(self.sock, {"call": method, "arg": arg}, timeout=self.timeout)
        reply, _ = recv_message(self.sock, timeout=self.timeout, max_fds=0)
        if reply.get("ok") is True:
            return
        inc = reply.get("incomplete")
        if isinstance(inc, list) and len(inc) == 4:
            raise IncompleteVersionError(*inc)
        raise DmaBufError(f"engine: {str(reply.get('error'))[:2000]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown")


def serve(sock: Any, worker: WorkerEngine, *, timeout: float | None = None,
          after: Callable[[str], None] | None = None) -> None:
    """Answer a :class:`SocketClient` with ``worker``'s methods, as vLLM's worker does (parsing the JSON
    into :class:`InitInfo` / :class:`UpdateInfo`), until ``shutdown`` or the client goes (EOF).
    ``after(method)`` runs after each call that succeeded, before the reply (a test checks the weights
    after ``finish_weight_update``)."""
    from ..errors import IncompleteVersionError, PeerClosedError
    from ..fdpass import recv_message, send_message

    calls: dict[str, Callable[[Any], None]] = {
        "init_weight_transfer_engine": lambda a: worker.init_transfer_engine(InitInfo(**a)),
        "start_weight_update": lambda a: worker.start_weight_update(),
        "update_weights": lambda a: worker.receive_weights(UpdateInfo(**a)),
        "finish_weight_update": lambda a: worker.finish_weight_update(),
        "shutdown": lambda a: worker.shutdown(),
    }
    while True:
        try:
            msg, _ = recv_message(sock, timeout=timeout, max_fds=0)
        except PeerClosedError:
            worker.shutdown()
            return
        method = msg.get("call")
        reply: dict[str, Any] = {"ok": True}
        try:
            if method not in calls:
                raise InvalidArgumentError(f"no such call: {str(method)[:100]!r}")
            arg = msg.get("arg")
            if method in ("init_weight_transfer_engine", "update_weights") and not isinstance(arg, dict):
                raise InvalidArgumentError(f"{method} takes a JSON object")
            calls[method](arg)
            if after is not None:
                after(method)
        except IncompleteVersionError as exc:
            reply = {"error": str(exc), "incomplete": [exc.version, exc.applied, exc.batches, exc.reason]}
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, as vLLM's RPC does
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        send_message(sock, reply, timeout=timeout)
        if method == "shutdown":
            return


# --- the vLLM layer ------------------------------------------------------------------------------------

try:
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                       WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
except ImportError:  # no vLLM (or one whose weight-transfer API differs): the logic above still works
    HAVE_VLLM = False
else:
    HAVE_VLLM = True

if HAVE_VLLM:
    from typing import ClassVar

    @dataclass
    class DmabufWeightTransferInitInfo(WeightTransferInitInfo, InitInfo):
        """:class:`InitInfo` as vLLM's worker-side init info."""

    @dataclass
    class DmabufWeightTransferUpdateInfo(WeightTransferUpdateInfo, UpdateInfo):
        """:class:`UpdateInfo` as vLLM's update info."""

    @dataclass
    class DmabufTrainerInitInfo(TrainerInitInfo, TrainerOptions):
        """:class:`TrainerOptions` with vLLM's keyword-only ``rank``; ``backend`` is ``"dmabuf"``."""

        backend: ClassVar[str] = BACKEND

    class DmabufWeightTransferEngine(WeightTransferEngine):
        """vLLM's worker engine over :class:`WorkerEngine`."""

        init_info_cls = DmabufWeightTransferInitInfo
        update_info_cls = DmabufWeightTransferUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self.core = WorkerEngine(device, model)

        def init_transfer_engine(self, init_info: Any) -> None:
            self.core.init_transfer_engine(init_info)

        def start_weight_update(self) -> None:
            self.core.start_weight_update()

        def receive_weights(self, update_info: Any) -> None:
            self.core.model = self.model  # set_weight_update_target may have changed it
            self.core.receive_weights(update_info)

        def finish_weight_update(self) -> None:
            self.core.finish_weight_update()

        def shutdown(self) -> None:
            self.core.shutdown()

    class DmabufTrainerWeightTransferEngine(TrainerWeightTransferEngine):
        """vLLM's trainer engine over :class:`TrainerEngine`."""

        init_info_cls = DmabufTrainerInitInfo

        def __init__(self, *, core: TrainerEngine, rank: int) -> None:
            super().__init__(client=core.client, source=core.source, is_sender=core.is_sender, rank=rank)
            self.core = core

        @classmethod
        def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Any:
            fields = {k: getattr(init_info, k) for k in TrainerOptions.__dataclass_fields__}
            core = TrainerEngine.trainer_init(TrainerOptions(**fields), client=client, source=source,
                                              rank=init_info.rank)
            return cls(core=core, rank=init_info.rank)

        def send_weights(self) -> None:
            self.core.send_weights()

        def shutdown(self) -> None:
            self.core.shutdown()

    __all__ += ["DmabufTrainerInitInfo", "DmabufTrainerWeightTransferEngine", "DmabufWeightTransferEngine",
                "DmabufWeightTransferInitInfo", "DmabufWeightTransferUpdateInfo"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register ``"dmabuf"`` in vLLM's worker and trainer
    factories. Loaded again (vLLM loads plugins in every process, maybe twice), it does nothing; where
    vLLM does not import, it does nothing."""
    if not HAVE_VLLM:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, name in ((WeightTransferEngineFactory, "DmabufWeightTransferEngine"),
                          (WeightTransferTrainerFactory, "DmabufTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, __name__, name)
        except ValueError as exc:  # registered already (by a first load of this plugin)
            if "already registered" not in str(exc):
                raise
