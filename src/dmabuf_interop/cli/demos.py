"""The CUDA dmabufInterop sample's three demos, composed from library calls.

1. Same-process round trip: export, write the pattern, import, verify.
2. Cross-process IPC: a forked child exports and writes, sends the fd over a
   Unix socket (``SCM_RIGHTS``); the parent imports and verifies.
3. Cross-GPU across processes: as 2, the child on the producer GPU and the
   parent on the consumer GPU of :meth:`~.mechanisms.Mechanism.pair`.

``--mechanism auto`` (the default) first takes the sample's path (its gate
and skip line); where the sample is gated out, or the probes say its export
or import does not work, one line per mechanism passed over gives the
library's reason (:func:`~dmabuf_interop.mechanisms.why_not`), and the demos
run with the first of :data:`~dmabuf_interop.mechanisms.PREFERENCE` that
works (:func:`~dmabuf_interop.mechanisms.choose`).

Kept from the sample: both children are forked before the parent initialises
CUDA (the driver does not survive ``fork()`` after ``cuInit``); each child
blocks on a one-byte "go" before any CUDA work (the byte names the mechanism,
which ``auto`` chooses only after the fork), and the parent closing the
socket without writing tells it to skip; the producer waits for a one-byte ack
before freeing its memory; stdout is line-buffered and flushed before each
fork, so lines come in source order when piped. A child prints "sent fd to
parent" just before its ``sendmsg``, so its line always precedes the parent's.

Added: every call is checked; every wait for a peer's work has a timeout (a
child's wait for "go" ends by EOF when the parent exits, so demo 1 may take
its time); children are always reaped (killed past the timeout, or at once
when the run is interrupted); a missing capability is a skip line with the
reason, a failure a line naming the call and its ``CUresult``.

Import pre-flight: none. The real import call decides. A ``NOT_SUPPORTED``
from it is reported as a skip with the driver's answer, which is exactly what
a probe would have learnt, at the cost of one export the probe would also have
needed.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, TextIO

from .. import capabilities
from ..descriptor import ShareDescriptor
from ..errors import (DmaBufError, InvalidArgumentError, NoDriverError, NotSupportedError, PeerClosedError,
                      SyscallError, WaitTimeoutError)
from ..fd import OwnedFd
from ..fdpass import close_fds, recv_message, recv_token, send_message, send_token
from ..mechanisms import Mechanism, choose, get_mechanism, why_not
from ..procs import wait_child
from ._faults import fault

__all__ = ["Outcome", "DemoOptions", "run_demos"]

ACK = b"A"
#: The "go" bytes: each names the (mechanism, memory) the child exports with.
GO: dict[bytes, tuple[str, str]] = {b"G": ("dmabuf", "host"), b"D": ("dmabuf", "device"),
                                    b"P": ("posix-fd", "device"), b"M": ("memfd", "host")}
#: ``--mechanism auto``: the sample's path, then the first mechanism that works here.
AUTO = "auto"


def _go(mech: Mechanism) -> bytes:
    """The "go" byte naming ``mech`` (see :data:`GO`)."""
    want = (mech.name, getattr(mech, "memory", "device" if mech.uses_cuda else "host"))
    return next(token for token, named in GO.items() if named == want)


@dataclass(frozen=True)
class Wording:
    """How the demos name one mechanism's things (all demo wording lives in this module)."""

    fd_label: str       #: how an fd is named: "exported as <fd_label> 45"
    import_line: str    #: what the importer prints once the memory is mapped
    no_pair: str        #: the cross-GPU skip line


WORDING = {
    "dmabuf": Wording("dma-buf fd", "imported dma-buf as device pointer",
                      "no GPU pair satisfies the dma-buf capability attributes. Skipping."),
    "posix-fd": Wording("POSIX fd", "imported POSIX-fd handle as device pointer",
                        "no GPU pair supports POSIX-fd handles with peer access. Skipping."),
    "memfd": Wording("host shared memory (memfd) fd", "mapped host shared memory (memfd) into this process",
                     "host shared memory involves no GPU. Skipping."),
}


def _gate_line(device: int, attribute: str) -> str:
    """The CUDA sample's skip line, word for word."""
    return f"Device {device} does not report CU_DEVICE_ATTRIBUTE_{attribute}. Skipping sample."


class Outcome(Enum):
    PASSED = "passed"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass
class DemoOptions:
    """What ``dmabuf-interop`` runs.

    Attributes:
        mechanism: ``"auto"``, ``"dmabuf"``, ``"posix-fd"`` or ``"memfd"``.
        memory: ``"host"`` or ``"device"`` (dmabuf only).
        device: CUDA ordinal of the same-process and cross-process demos.
        size: bytes to share (> 0, a multiple of 4: the pattern is int32).
        timeout: seconds any wait on a peer may take.
    """

    mechanism: str = AUTO
    memory: str = "host"
    device: int = 0
    size: int = 16384
    timeout: float = 60.0


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def __call__(self, line: str = "") -> None:
        self.out.write(line + "\n")
        self.out.flush()


# --- child side -------------------------------------------------------------------------

def _child(sock: socket.socket, demo: int, opts: DemoOptions, say: _Printer) -> int:
    """A forked producer. Returns its exit status."""
    try:
        # No deadline for "go": demo 1 may take long, and the parent's exit (even a
        # crash) closes its end, which ends this wait with EOF.
        token = recv_token(sock, None)
    except PeerClosedError:
        return 0  # the parent skipped this demo
    if token not in GO:
        say(f"  child:  unknown go byte {token!r} from parent")
        return 1
    mech = get_mechanism(*GO[token])
    where = ""
    device = opts.device
    if demo == 3:
        pair = mech.pair()
        if pair is None:
            send_message(sock, {"status": "skip", "reason": WORDING[mech.name].no_pair})
            return 0
        device = pair[0]
        where = f"on device {device}, "
    try:
        exported = mech.export(opts.size, device)
    except NotSupportedError as exc:
        say(f"  child:  export not supported: {exc}. Skipping.")
        send_message(sock, {"status": "skip", "reason": str(exc)})
        return 0
    except DmaBufError as exc:
        say(f"  child:  export failed: {exc}")
        send_message(sock, {"status": "error", "reason": str(exc)})
        return 1
    with exported:
        say(f"  child:  {where}allocated {opts.size} bytes, exported as {WORDING[mech.name].fd_label} {exported.fd}")
        mech.write_pattern(exported)
        say("  child:  wrote pattern")
        fault("before-send")
        say("  child:  sent fd to parent")
        exported.send(sock, timeout=opts.timeout)  # synchronises the device, then SCM_RIGHTS + descriptor
        if fault("before-ack"):
            return 0
        try:
            recv_token(sock, opts.timeout)  # ack: the parent is done with the memory
        except (PeerClosedError, WaitTimeoutError):
            pass  # parent gone or silent: free the memory anyway
    return 0


def _fork_child(demo: int, opts: DemoOptions, out: TextIO,
                close_in_child: list[socket.socket]) -> tuple[int, socket.socket]:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        status = 1
        try:
            parent_end.close()
            for s in close_in_child:
                s.close()
            status = _child(child_end, demo, opts, _Printer(out))
        except KeyboardInterrupt:
            status = 130  # Ctrl-C reached the whole process group: the parent reports it
        except BaseException as exc:  # noqa: BLE001 - a child never returns into the caller
            try:
                _Printer(out)(f"  child:  failed: {exc or type(exc).__name__}")
            except BaseException:  # noqa: BLE001 - stdout gone (closed pipe): nothing to tell
                pass
        finally:
            try:
                out.flush()
            finally:
                os._exit(status)
    child_end.close()
    return pid, parent_end


# --- parent side ------------------------------------------------------------------------

def _attempt(fn: Callable[[], Any], who: str, what: str, say: _Printer) -> tuple[Any, tuple[Outcome, str] | None]:
    """``(fn(), None)``, or ``(None, outcome)`` when it raised: an absent capability skips, any other
    library error fails; each says so on its line."""
    try:
        return fn(), None
    except NotSupportedError as exc:
        say(f"  {who}: {what} not supported: {exc}. Skipping.")
        return None, (Outcome.SKIPPED, str(exc))
    except DmaBufError as exc:
        say(f"  {who}: {what} failed: {exc}")
        return None, (Outcome.FAILED, str(exc))


def _same_process(mech: Mechanism, opts: DemoOptions, say: _Printer) -> tuple[Outcome, str]:
    say("Same-process round-trip")
    exported, bad = _attempt(lambda: mech.export(opts.size, opts.device), "producer", "export", say)
    if bad:
        return bad
    with exported:
        say(f"  producer: allocated {opts.size} bytes, exported as {WORDING[mech.name].fd_label} {exported.fd}")
        mech.write_pattern(exported)
        say("  producer: wrote pattern")
        return _consume(mech, exported.fd, exported.describe(), opts.device, "consumer", say)


def _consume(mech: Mechanism, fd: int, desc: ShareDescriptor, device: int, who: str,
             say: _Printer) -> tuple[Outcome, str]:
    imported, bad = _attempt(lambda: mech.import_(fd, desc, device), who, "import", say)
    if bad:
        return bad
    with imported:
        say(f"  {who}: {WORDING[mech.name].import_line}")
        try:
            n = mech.count_mismatches(imported)
        except DmaBufError as exc:
            say(f"  {who}: verify failed: {exc}")
            return Outcome.FAILED, str(exc)
    if n:
        say(f"  {who}: verified Error ({n} mismatches)")
        return Outcome.FAILED, f"{n} mismatches"
    say(f"  {who}: verified (0 mismatches)")
    return Outcome.PASSED, ""


def _cross_process(pid: int, sock: socket.socket, mech: Mechanism, opts: DemoOptions, device: int,
                   where: str, say: _Printer) -> tuple[Outcome, str]:
    try:
        send_token(sock, _go(mech))
        msg, fds = recv_message(sock, opts.timeout, max_fds=1)
    except PeerClosedError:
        sock.close()
        ended = wait_child(pid, opts.timeout)
        say(f"  parent: child closed the socket before sending the fd ({ended.describe()})")
        return Outcome.FAILED, ended.describe()
    except WaitTimeoutError:
        sock.close()
        ended = wait_child(pid, 0)
        say(f"  parent: timed out after {opts.timeout:g} s waiting for the child's fd ({ended.describe()})")
        return Outcome.FAILED, "timeout"
    except DmaBufError as exc:
        sock.close()
        wait_child(pid, opts.timeout)
        say(f"  parent: bad message from child: {exc}")
        return Outcome.FAILED, str(exc)
    status = msg.get("status", "ok")  # an export's describe() carries no status
    if status != "ok" or len(fds) != 1:
        close_fds(fds)
        sock.close()
        ended = wait_child(pid, opts.timeout)
        if status == "skip":
            if msg.get("reason") == WORDING[mech.name].no_pair:
                say(f"  {WORDING[mech.name].no_pair}")
            return Outcome.SKIPPED, str(msg.get("reason", ""))
        return Outcome.FAILED, str(msg.get("reason", ended.describe()))
    with OwnedFd(fds[0]) as received:
        say(f"  parent: {where}received {WORDING[mech.name].fd_label} {received.fd} from child")
        try:
            desc = ShareDescriptor.from_json(msg)
        except DmaBufError as exc:
            say(f"  parent: bad descriptor from child: {exc}")
            outcome, reason = Outcome.FAILED, str(exc)
        else:
            outcome, reason = _consume(mech, received.fd, desc, device, "parent", say)
    try:
        send_token(sock, ACK)
    except PeerClosedError:
        pass
    sock.close()
    ended = wait_child(pid, opts.timeout)
    if not ended.ok:
        say(f"  parent: {ended.describe()}")
        return Outcome.FAILED, ended.describe()
    return outcome, reason


def _hint(mech: Mechanism, device: int) -> str:
    """Name a mechanism the probes say works on this machine."""
    try:
        if mech.name == "dmabuf" and getattr(mech, "memory", "") == "host" and why_not("dmabuf", device) is None:
            return "Hint: dma-buf from device memory works here: --mechanism dmabuf --memory device"
        if why_not("posix-fd", device) is None:
            return f"Hint: CUDA POSIX-fd handles work on device {device}: --mechanism posix-fd"
    except DmaBufError:
        pass
    return "Hint: --mechanism memfd runs the demos over host shared memory"


def _auto(opts: DemoOptions, count: int | None, say: _Printer) -> Mechanism:
    """``--mechanism auto``: the sample's mechanism where its gate and the probes pass (the
    gate's skip line otherwise), else the first that works, after one line per mechanism
    passed over. ``count``: CUDA devices, ``None`` without a driver."""
    if count is not None and opts.memory == "host":
        sample = get_mechanism("dmabuf", "host")
        missing = sample.gate(opts.device)
        if missing:
            say(_gate_line(opts.device, missing))
        else:
            why = why_not("dmabuf", opts.device, "host")
            if why is None:
                return sample
            say(f"Passed over {why}")
    mech, reasons = choose(opts.device)
    for why in reasons:
        say(f"Passed over {why}")
    say(f"Running the demos with {mech.name}, the first mechanism that works end to end here.")
    return mech


def _open_device(opts: DemoOptions, say: _Printer) -> int | None:
    """Print the device line; the number of CUDA devices, or ``None`` without a driver.

    Raises:
        InvalidArgumentError: ``opts.device`` is out of range (a usage error).
    """
    try:
        count = capabilities.device_count()
    except NoDriverError as exc:
        if opts.mechanism != AUTO:
            say(f"CUDA is not usable here: {exc.detail or exc}")
            say("Run `dmabuf-interop --mechanism memfd` to run the demos over host shared memory.")
        return None
    if not 0 <= opts.device < count:
        raise InvalidArgumentError(f"--device {opts.device} out of range: "
                                   f"this machine has {count} CUDA device(s)")
    facts = capabilities.device_facts(opts.device)
    say(f"Device {opts.device}: {facts.name} (Compute Capability {facts.compute_capability})")
    return count


def run_demos(opts: DemoOptions, out: TextIO | None = None) -> int:
    """Run the three demos; returns the exit status (0 passed or skipped, 1 failed, 2 usage).

    Raises nothing for expected conditions: a missing driver or capability is
    printed as a skip, a failure as a line naming the call and its result.
    """
    out = out if out is not None else sys.stdout
    say = _Printer(out)
    auto = opts.mechanism == AUTO
    mech = None if auto else get_mechanism(opts.mechanism, opts.memory)
    if opts.size <= 0 or opts.size % 4:
        raise InvalidArgumentError(f"--size must be a positive multiple of 4 bytes, got {opts.size}")

    # Fork both producers before this process touches CUDA; "go" tells them the mechanism.
    pid1, sock1 = _fork_child(2, opts, out, [])
    pid2, sock2 = _fork_child(3, opts, out, [sock1])
    children = {pid1: sock1, pid2: sock2}

    def finish(status: int, kill: bool = False) -> int:
        """Close every child's socket (EOF: one still waiting for "go" skips) and reap it;
        ``kill``: SIGKILL first (we are being interrupted or failed unexpectedly)."""
        for pid, sock in list(children.items()):
            sock.close()
            try:
                wait_child(pid, 0 if kill else opts.timeout)
            except SyscallError as exc:  # ECHILD: already reaped by the demo that was interrupted
                if exc.errno != errno.ECHILD:
                    raise
        children.clear()
        return status

    try:
        if mech is None or mech.uses_cuda:
            try:
                count = _open_device(opts, say)
            except InvalidArgumentError as exc:
                print(f"dmabuf-interop: error: {exc}", file=sys.stderr)
                return finish(2)
            if mech is None:
                mech = _auto(opts, count, say)
            elif count is None:
                return finish(0)
            else:
                missing = mech.gate(opts.device)
                if missing:
                    say(_gate_line(opts.device, missing))
                    say(_hint(mech, opts.device))
                    return finish(0)
        if not mech.uses_cuda:
            say("Host shared memory (memfd_create + mmap, no GPU)")
        say()
        results = [_same_process(mech, opts, say)]
        say()
        say("Cross-process IPC (fork + SCM_RIGHTS)")
        results.append(_cross_process(pid1, sock1, mech, opts, opts.device, "", say))
        children.pop(pid1)  # reaped by _cross_process
        say()
        say("Cross-GPU sharing across processes")
        pair = mech.pair() if mech.uses_cuda else None
        if pair is None:
            say(f"  {WORDING[mech.name].no_pair}")
            results.append((Outcome.SKIPPED, WORDING[mech.name].no_pair))
        else:
            results.append(_cross_process(pid2, sock2, mech, opts, pair[1], f"on device {pair[1]}, ", say))
            children.pop(pid2)
        say()
        if any(o is Outcome.FAILED for o, _ in results):
            return finish(1)
        say("Done")
        if not auto and mech.uses_cuda and \
                any(o is Outcome.SKIPPED and r != WORDING[mech.name].no_pair for o, r in results):
            say(_hint(mech, opts.device))
        return finish(0)
    except BaseException:
        finish(1, kill=True)
        raise
