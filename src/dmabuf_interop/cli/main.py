"""The ``dmabuf-interop`` command line.

``dmabuf-interop [run] [options]`` runs the three demos (the default);
``dmabuf-interop info`` reports what works on this machine and why not;
``dmabuf-interop bench`` measures the mechanisms against what users use today.

Exit status (every command):

* 0: passed, or skipped for a missing capability; also when the reader of
  stdout goes away (``| head``): whether a writer notices a closed pipe at all
  depends on pipe buffering, so stopping quietly with 0 is the one status a
  closed stdout can always give;
* 1: failed (one line naming the call and its result), including a full stdout;
* 2: usage error (one line on stderr);
* 130: interrupted (Ctrl-C); the demos' children are killed and reaped first.

Options that do not apply to what runs (``--size`` with ``info``, ``--device``
with memfd, ...) are reported in one ``note:`` line on stderr and ignored.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .. import __version__
from ..kinds import MECHANISM_NAMES
from ._units import SIZE_FORMS, seconds_argument, word_size_argument
from .demos import AUTO

__all__ = ["main", "build_parser"]

PROG = "dmabuf-interop"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {PROG} --help)\n")
        raise SystemExit(2)


#: Longest wait handed to subprocess and poll (about 11.6 days; poll takes an int of ms); longer ``--timeout`` values mean this.
MAX_WAIT = 1e6


def _device(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid device {text!r}: expected a CUDA ordinal") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid device {value}: ordinals start at 0")
    return value


class _Store(argparse.Action):
    """Store the value and mark the option as given, so that one that does not apply can be named.

    The mark is an attribute of its own (``given_<dest>``): argparse copies a
    subcommand's namespace over the top-level one attribute by attribute, so a
    shared set would lose the options given before the subcommand.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, "given_" + self.dest, True)


def _add_run_options(p: argparse.ArgumentParser, defaults: bool = True, ignored: bool = False) -> None:
    """The run options. ``defaults=False`` for a subcommand: argparse lets a subparser's
    defaults overwrite values parsed before it, so ``--size 8 run`` would silently run
    with 16384 bytes; the top-level parser supplies the defaults. ``ignored=True`` for
    ``info``: it takes them only to name them in a note (no help; not ``--timeout``,
    which it has of its own)."""

    def d(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    def h(text: str) -> str:
        return argparse.SUPPRESS if ignored else text

    p.add_argument("--mechanism", choices=(AUTO, *MECHANISM_NAMES), default=d(AUTO), action=_Store,
                   help=h("how memory is shared (default: auto: the CUDA sample's dma-buf path, and where this "
                          "machine cannot run it, the first of dmabuf (device memory), posix-fd, memfd that works)"))
    p.add_argument("--memory", choices=("host", "device"), default=d("host"), action=_Store,
                   help=h("dmabuf producer allocator: host = cuMemAllocHost (the sample's), device = cuMemAlloc"))
    p.add_argument("--device", type=_device, default=d(0), action=_Store,
                   help=h("CUDA ordinal for demos 1 and 2 (default 0)"))
    p.add_argument("--size", type=word_size_argument, default=d(16384), action=_Store,
                   help=h(f"bytes to share, a multiple of 4 (default 16384): {SIZE_FORMS}"))
    if not ignored:
        p.add_argument("--timeout", type=seconds_argument, default=d(60.0), action=_Store,
                       help="seconds any wait on a peer process may take (default 60)")


#: Run options that do not apply, by what runs.
_NOT_APPLYING = {
    "info": ("mechanism", "memory", "device", "size"),
    "bench": ("mechanism", "memory", "device", "size"),
    "posix-fd": ("memory",),
    "memfd": ("memory", "device"),
}


def _note_ignored(args: argparse.Namespace) -> None:
    """One ``note:`` line on stderr naming the given options that do not apply."""
    what = args.command if args.command in ("info", "bench") else args.mechanism
    ignored = [f"--{o}" for o in _NOT_APPLYING.get(what, ()) if getattr(args, "given_" + o, False)]
    if ignored:
        where = what if args.command in ("info", "bench") else f"--mechanism {what}"
        _error(f"note: {', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} not apply to {where}; ignored")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Share CUDA buffers between contexts, processes and GPUs "
                                            "through Linux file descriptors (dma-buf, POSIX fd, memfd).")
    parser.add_argument("-V", "--version", action="version", version=f"{PROG} {__version__}")
    _add_run_options(parser)
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    run = sub.add_parser("run", help="run the three demos (the default)")
    _add_run_options(run, defaults=False)
    info = sub.add_parser("info", help="tell whether dma-buf sharing works on this machine, and why not")
    info.add_argument("--json", action="store_true", help="print one JSON object (keys documented in docs/info.md)")
    info.add_argument("--timeout", type=seconds_argument, default=argparse.SUPPRESS,
                      help="seconds the probe child may take (default 60)")
    _add_run_options(info, defaults=False, ignored=True)  # accepted, named in a note, ignored
    bench = sub.add_parser("bench", help="benchmark sharing mechanisms against torch, cuda.core and CuPy IPC")
    from .bench import add_arguments

    add_arguments(bench)
    return parser


def _quiet_stdout() -> None:
    """Point fd 1 at /dev/null so that the interpreter's final flush cannot fail again
    (the recipe in the ``signal`` module's note on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _error(text: str) -> None:
    try:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dmabuf-interop`` console script.

    A user never sees a traceback: library errors, a closed or full stdout
    (``| head``, ``>&-``, ``>/dev/full``), memory errors and Ctrl-C each end in
    one line on stderr and an exit status (set ``DMABUF_INTEROP_DEBUG=1`` to get
    the traceback of an unexpected error).
    """
    for name in ("stdout", "stderr"):  # closed by the caller (>&-): write to /dev/null instead
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    try:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    args = build_parser().parse_args(argv)
    _note_ignored(args)
    from ..errors import DmaBufError
    from ..procs import make_children_waitable

    make_children_waitable()  # an inherited SIGCHLD SIG_IGN would lose every child's exit status

    try:
        if args.command == "info":
            from .info import main as info_main

            return info_main(json_output=args.json, timeout=min(args.timeout, MAX_WAIT))
        if args.command == "bench":
            from .bench import main as bench_main

            args.timeout = min(args.timeout, MAX_WAIT)
            return bench_main(args)
        from .demos import DemoOptions, run_demos

        return run_demos(DemoOptions(mechanism=args.mechanism, memory=args.memory, device=args.device,
                                     size=args.size, timeout=args.timeout))
    except BrokenPipeError:
        _quiet_stdout()  # the reader went away (| head): stop quietly (exit status: module docstring)
        return 0
    except DmaBufError as exc:
        _error(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except (MemoryError, OSError) as exc:
        _error(f"error: {type(exc).__name__}: {exc}")
        return 1
    except Exception as exc:  # noqa: BLE001 - the promise is one line, not a traceback
        if os.environ.get("DMABUF_INTEROP_DEBUG"):
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (set DMABUF_INTEROP_DEBUG=1 for the traceback)")
        return 1
