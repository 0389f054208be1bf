#!/usr/bin/env python3
"""Where one channel hand-off's time goes, stage by stage, between two processes (GPU or host pool).

    PYTHONPATH=src python3 scripts/handoff_stages.py [--host] [--device 0] [--spin 0.0005|auto] [--socket]
        [--count 2000] [--pause 0.0003] [--size 1048576]

A producer process lends a ring of 8 ``SharedPool.empty`` blocks over a channel, one at a time, pausing
``--pause`` seconds before each ``send`` (a producer woken for each hand-off); the consumer process receives
each, takes ``as_array`` and reads the first 4 bytes (the host: a NumPy read; a GPU: a kernel that copies them
to pinned memory, then a stream synchronisation), then releases it. Each side stamps ``time.monotonic_ns``:

- the producer: ``send`` called (t0), and the moment the hand-off left (the ring slot published, or the
  socket message sent: the library's own ``Rings.push_repeat``, the attached ring's ``push_host`` /
  ``Link.send_locked`` wrapped);
- the consumer: the moment it woke (its sleep on the ring ended: ``Rings.sleep_end``, or a socket message
  read: ``FrameReader.read_by``; a spinning consumer that saw the slot never sleeps, so this stage is not
  shown for it), ``recv`` returned, and the read done.

Printed: the median of each stage over the hand-offs after the first 200, in µs. ``monotonic_ns`` is one clock
for both processes of a machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

_mono = time.monotonic_ns
_RING_BLOCKS = 8
_SKIP = 200


def _median(values: list[int]) -> float:
    kept = values[_SKIP:] if len(values) > 2 * _SKIP else values  # (a stage seen on fewer hand-offs: all of them)
    return statistics.median(kept) / 1e3


def _consumer(args: argparse.Namespace, addr: str, go: int, out: str) -> None:
    from dmabuf_interop import fdpass
    from dmabuf_interop.channel import _ring, connect

    woke = [0]
    sleep_end, read_by = _ring.Rings.sleep_end, fdpass.FrameReader.read_by

    def timed_sleep_end(self, *a, **k):  # type: ignore[no-untyped-def]
        woke[0] = _mono()
        return sleep_end(self, *a, **k)

    def timed_read_by(self, *a, **k):  # type: ignore[no-untyped-def]
        got = read_by(self, *a, **k)
        woke[0] = _mono()
        return got

    _ring.Rings.sleep_end, fdpass.FrameReader.read_by = timed_sleep_end, timed_read_by
    os.read(go, 1)
    reader = None
    if not args.host:
        from dmabuf_interop.cli.bench.reader import Reader

        reader = Reader(args.device)
    ch = connect(addr, timeout=30, device=None if args.host else args.device, ring=not args.socket)
    ch.spin = args.spin
    stamps: dict[str, list[int]] = {"woke": [], "returned": [], "read": []}
    for _ in range(args.count):
        woke[0] = 0
        got = ch.recv(30)
        returned = _mono()
        view = got.as_array()
        if reader is None:
            int(view[0])
        else:
            reader.read4(int(view.ptr))
        read = _mono()
        got.release()
        for key, value in zip(stamps, (woke[0], returned, read)):
            stamps[key].append(value)
    with open(out, "w") as f:
        json.dump({**stamps, "ring": ch.ring}, f)
    time.sleep(0.3)  # the producer's last waits take the last releases
    ch.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", action="store_true", help="a host pool (memfd) instead of a device pool")
    p.add_argument("--device", type=int, default=0, help="the GPU of both processes (default 0)")
    p.add_argument("--spin", type=lambda t: t if t == "auto" else float(t), default=0.0,
                   help="the consumer's Channel.spin, seconds or 'auto' (default 0)")
    p.add_argument("--socket", action="store_true", help="refuse the shared-memory ring on both ends")
    p.add_argument("--count", type=int, default=2000,
                   help=f"hand-offs, more than {2 * _SKIP} (default 2000; the first {_SKIP} are not counted)")
    p.add_argument("--pause", type=float, default=300e-6, help="seconds the producer pauses before each send")
    p.add_argument("--size", type=int, default=1 << 20, help="bytes per block (default 1 MiB)")
    args = p.parse_args()
    if args.count <= 2 * _SKIP:
        p.error(f"--count must be more than {2 * _SKIP}: the first {_SKIP} hand-offs are warm-ups")
    if args.pause < 0 or args.size < 8 or (args.spin != "auto" and args.spin < 0):
        p.error("--pause and --spin must be at least 0, --size at least 8 bytes")
    folder = tempfile.mkdtemp(prefix="handoff-stages-")
    try:
        return _run(args, folder)
    finally:  # (the consumer's process leaves by os._exit: only this one runs it)
        shutil.rmtree(folder, ignore_errors=True)


def _run(args: argparse.Namespace, folder: str) -> int:
    from dmabuf_interop.channel import _link, _ring

    addr, out = os.path.join(folder, "c.sock"), os.path.join(folder, "consumer.json")
    go_r, go_w = os.pipe()
    pid = os.fork()  # (before any CUDA call in this process)
    if pid == 0:
        os.close(go_w)
        code = 0
        try:
            _consumer(args, addr, go_r, out)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(go_r)
    from dmabuf_interop.channel import SharedPool, listen

    left = [0]
    push, send_locked = _ring.Rings.push_repeat, _link.Link.send_locked

    def timed_push(self, *a, **k):  # type: ignore[no-untyped-def]
        got = push(self, *a, **k)
        left[0] = _mono()
        return got

    def timed(publish):  # type: ignore[no-untyped-def]
        def call(*a):  # type: ignore[no-untyped-def]
            got = publish(*a)
            left[0] = _mono()
            return got
        return call

    def timed_send_locked(self, *a, **k):  # type: ignore[no-untyped-def]
        got = send_locked(self, *a, **k)
        left[0] = _mono()
        return got

    _ring.Rings.push_repeat, _link.Link.send_locked = timed_push, timed_send_locked
    pool = SharedPool(None if args.host else args.device, chunk_bytes=64 << 20,
                      max_bytes=max(64 << 20, (_RING_BLOCKS + 1) * args.size + (2 << 20)))
    t0s: list[int] = []
    lefts: list[int] = []
    with pool, listen(addr, pool=pool, ring=not args.socket) as lst:
        os.write(go_w, b"x")
        with lst.accept(timeout=60) as ch:
            if ch.ring:  # (the attached ring's host publish is its cursor's, bound on the instance)
                ch._rings.push_host = timed(ch._rings.push_host)
            blocks = [pool.empty(args.size, "uint8") for _ in range(_RING_BLOCKS)]
            leases: list = [None] * _RING_BLOCKS
            for i in range(args.count):
                k = i % _RING_BLOCKS
                if leases[k] is not None:
                    leases[k].wait(30)
                time.sleep(args.pause)
                t0 = _mono()
                leases[k] = ch.send(blocks[k], timeout=30)
                t0s.append(t0)
                lefts.append(left[0])
            for lease in leases:
                lease.wait(30)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                print("the consumer failed (its traceback is above)", file=sys.stderr)
                return 1
            del blocks, leases
    with open(out) as f:
        c = json.load(f)

    def stage(a: list[int], b: list[int]) -> float:
        return _median([y - x for x, y in zip(a, b) if x and y])  # (0: not stamped, e.g. no sleep that time)

    where = "host pool" if args.host else f"GPU {args.device}"
    spin = args.spin if args.spin == "auto" else f"{args.spin:g} s"
    print(f"{where}, {'ring' if c['ring'] else 'socket alone'}, consumer spin {spin}, {args.size} bytes, "
          f"pause {args.pause:g} s: medians of {args.count - _SKIP} hand-offs, us")
    print(f"  send called -> hand-off left:        {stage(t0s, lefts):7.1f}")
    if args.spin == 0:
        print(f"  hand-off left -> consumer woke:      {stage(lefts, c['woke']):7.1f}")
        print(f"  consumer woke -> recv returned:      {stage(c['woke'], c['returned']):7.1f}")
    print(f"  hand-off left -> recv returned:      {stage(lefts, c['returned']):7.1f}")
    print(f"  recv returned -> 4 bytes read:       {stage(c['returned'], c['read']):7.1f}")
    print(f"  send called -> 4 bytes read (total): {stage(t0s, c['read']):7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
