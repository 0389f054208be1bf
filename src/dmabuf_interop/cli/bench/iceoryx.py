"""The iceoryx2 bench peer: zero-copy publish-subscribe over host shared memory (PyPI ``iceoryx2``).

iceoryx2 is the host-memory baseline of ``channel-host``: its Python publish-subscribe with a loaned
sample, measured with the same hand-off definition (producer starts its send -> consumer has read 4
bytes of the payload) in two fresh processes. Per cell the producer creates a publish-subscribe
service of ``iceoryx2.Slice[ctypes.c_uint8]`` and an event service of the same name (``service``
message), a publisher sized for the cell (``initial_max_slice_len``, static allocation) and a
notifier; the consumer opens both, with a subscriber and a listener. One hand-off:
``loan_slice_uninit(size)`` + ``assume_init`` (the export: the producer's block), ``send`` and
``notify`` (the wake of a sleeping consumer), ``receive`` in the consumer, ``payload()`` (the import:
a view of the sample) and a CPU read of its first 4 bytes; the sample goes back by ``delete`` after
the read.

The consumer waits as ``Channel.recv`` does: blocking in the listener (``timed_wait``), or, with
``spin`` > 0, polling ``receive`` for up to ``spin`` seconds before it blocks.

:mod:`.throughput` runs its pipelined throughput with the helpers here (:func:`services`, :func:`wait_sample`).
"""

from __future__ import annotations

import ctypes
import os
import time
from importlib import metadata
from typing import Any

from ...errors import NotSupportedError, ProtocolError, WaitTimeoutError
from ...fdpass import recv_message, send_message
from .protocol import check, make

__all__ = ["MECHANISMS", "INSTALL_HINT", "peers", "iceoryx2", "node", "services", "wait_sample"]

#: How to get the peer library.
INSTALL_HINT = "pip install iceoryx2"

MECHANISMS: dict[str, tuple[str, str | None, str]] = {
    "iceoryx2": (
        "peer", "iceoryx2",
        "iceoryx2 publish-subscribe over host shared memory, no GPU: a service per size with a publisher "
        "sized for it (static allocation); per hand-off Publisher.loan_slice_uninit + assume_init (the "
        "loaned sample), send and a notify on an event service of the same name; the consumer's "
        "Subscriber.receive (waiting in its Listener, or polling first with --consumer-spin), payload() is "
        "the import, the first access a CPU read; the sample is deleted after the read"),
}

now = time.monotonic_ns


def iceoryx2() -> Any:
    """The iceoryx2 module, its log quiet unless ``IOX2_LOG_LEVEL`` says otherwise.

    Raises:
        ImportError: iceoryx2 is not installed (the message says how to install it).
    """
    try:
        import iceoryx2
    except ImportError as exc:
        raise ImportError(f"iceoryx2 is not installed ({INSTALL_HINT}): {exc}") from exc
    # Without a config file it logs one line per node at Info; the bench's stderr is for progress.
    iceoryx2.set_log_level_from_env_or(iceoryx2.LogLevel.Error)
    return iceoryx2


def node(iox2: Any) -> Any:
    # SignalHandlingMode.Disabled: the bench child leaves Ctrl-C to its parent (procs.leave_interrupts_to_parent);
    # iceoryx2's own handlers would take SIGINT and SIGTERM over.
    return iox2.NodeBuilder.new().signal_handling_mode(iox2.SignalHandlingMode.Disabled).create(iox2.ServiceType.Ipc)


def services(iox2: Any, node: Any, name: str, buffer: int, create: bool) -> tuple[Any, Any]:
    """The publish-subscribe and event services called ``name``: created by the producer, opened by the
    consumer, with the same settings (one publisher, one subscriber, no history, ``buffer`` samples queued;
    with ``buffer`` > 1 a full queue holds the publisher back instead of dropping the oldest sample)."""
    sn = iox2.ServiceName.new(name)
    ps = (node.service_builder(sn).publish_subscribe(iox2.Slice[ctypes.c_uint8])
          .max_publishers(1).max_subscribers(1).history_size(0).subscriber_max_buffer_size(buffer)
          .subscriber_max_borrowed_samples(1).enable_safe_overflow(buffer == 1))
    ev = node.service_builder(sn).event().max_notifiers(1).max_listeners(1)
    return (ps.create(), ev.create()) if create else (ps.open(), ev.open())


def wait_sample(iox2: Any, subscriber: Any, listener: Any, timeout: float, spin: float) -> Any:
    """The next sample, or ``None`` after ``timeout`` seconds; polls ``receive`` for up to ``spin``
    seconds first, then sleeps in the listener (a notify sent after an empty ``receive`` wakes it: the
    listener keeps it, so no wake-up is lost)."""
    if spin > 0:
        until = time.perf_counter() + spin
        while True:
            sample = subscriber.receive()
            if sample is not None:
                return sample
            if time.perf_counter() >= until:
                break
    deadline = time.monotonic() + timeout
    while True:
        sample = subscriber.receive()
        if sample is not None:
            return sample
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        listener.timed_wait(iox2.Duration.from_secs_f64(left))


def peers(base: type) -> dict[str, type]:
    """The iceoryx2 bench peer, built on the bench's ``Peer`` base (``peers.Peer``: passed in to avoid an
    import circle)."""

    class Iceoryx2Peer(base):  # type: ignore[misc, valid-type]
        """iceoryx2 publish-subscribe with a loaned sample (see the module docstring)."""

        uses_cuda = False
        measures_idle = True

        def setup(self) -> dict[str, Any]:
            self.iox2 = iceoryx2()
            out = super().setup()
            spin = self.cfg.get("spin", 0)
            if spin == "auto":
                raise NotSupportedError("iceoryx2 has no adaptive spin (--consumer-spin auto is the channels' "
                                        "Channel.spin = 'auto'): give a number of seconds to compare with it")
            self.spin = float(spin)
            self.node = node(self.iox2)
            return {**out, "iceoryx2": metadata.version("iceoryx2")}

        def cell(self, size: int) -> None:
            super().cell(size)
            iox2 = self.iox2
            if self.role == "producer":
                name = f"dmabuf-interop-bench/{os.getpid()}/{size}"
                self.ps, self.ev = services(iox2, self.node, name, 1, create=True)
                try:
                    self.publisher = (self.ps.publisher_builder().initial_max_slice_len(size)
                                      .allocation_strategy(iox2.AllocationStrategy.Static).max_loaned_samples(1)
                                      .create())
                except iox2.PublisherCreateError as exc:  # the data segment does not fit in /dev/shm
                    raise NotSupportedError(f"iceoryx2 cannot make a publisher of {size} bytes: {exc}") from exc
                self.notifier = self.ev.notifier_builder().create()
                send_message(self.pc, make("service", name=name))
            else:
                name = check(recv_message(self.pc, self.timeout, max_fds=0)[0], "service")["name"]
                self.ps, self.ev = services(iox2, self.node, name, 1, create=False)
                self.subscriber = self.ps.subscriber_builder().create()
                self.listener = self.ev.listener_builder().create()

        def produce(self, rep: int) -> dict[str, Any]:
            t0 = now()
            sample = self.publisher.loan_slice_uninit(self.size).assume_init()
            t_exp = now()
            sample.send()
            self.notifier.notify()
            return {"t": [t0, t_exp, t_exp]}

        def consume(self, rep: int) -> dict[str, Any]:
            sample = wait_sample(self.iox2, self.subscriber, self.listener, self.timeout, self.spin)
            if sample is None:
                raise WaitTimeoutError(f"no sample from the publisher within {self.timeout:g} s")
            t_recv = now()
            payload = sample.payload()
            t_imp = now()
            if payload.len() != self.size:  # the peer's length, checked before the read
                raise ProtocolError(f"iceoryx2: a sample of {payload.len()} bytes where {self.size} were sent")
            ctypes.c_uint32.from_address(payload.as_ptr()).value  # noqa: B018 - the first access
            t_read = now()
            self.sample = sample
            return {"t": [t_recv, t_imp, t_read]}

        def release_consumer(self) -> None:
            self.sample.delete()
            del self.sample
            if self.spin > 0:
                self.listener.try_wait()  # the notify a polling consumer did not wait for

        def idle(self, seconds: float) -> tuple[int, int]:
            cpu, t = time.process_time_ns(), now()
            if wait_sample(self.iox2, self.subscriber, self.listener, seconds, self.spin) is not None:
                raise ProtocolError("iceoryx2: a sample arrived while the producer sent nothing")
            return time.process_time_ns() - cpu, now() - t

        def cell_end(self) -> dict[str, Any]:
            for port in ("publisher", "notifier", "subscriber", "listener"):
                if hasattr(self, port):
                    getattr(self, port).delete()
                    delattr(self, port)
            del self.ps, self.ev  # the services go with their last port
            return {}

        def close(self) -> None:
            for port in ("publisher", "notifier", "subscriber", "listener"):
                if hasattr(self, port):
                    getattr(self, port).delete()

    return {"iceoryx2": Iceoryx2Peer}

