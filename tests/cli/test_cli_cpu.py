"""CPU tests of the ``dmabuf-interop`` command line (issue 3's CPU tests, issue 6 item 7).

The CLI runs as a user runs it: a subprocess, ``--mechanism memfd`` (no GPU
needed), its output compared line by line with the expected text (fd numbers
and pids masked). Dying children are injected with ``DMABUF_INTEROP_FAULT``
(see :mod:`dmabuf_interop.demos`). Option parsing is also checked as a
property (hypothesis) on ``cli.build_parser().parse_args``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop import cli
from dmabuf_interop.kinds import MECHANISM_NAMES
from tests.helpers import env_with_src, run_cli

FAULT = "DMABUF_INTEROP_FAULT"

MEMFD_FD = "host shared memory (memfd) fd N"


def _expected_memfd(size: int) -> list[str]:
    return [
        "Host shared memory (memfd_create + mmap, no GPU)",
        "",
        "Same-process round-trip",
        f"  producer: allocated {size} bytes, exported as {MEMFD_FD}",
        "  producer: wrote pattern",
        "  consumer: mapped host shared memory (memfd) into this process",
        "  consumer: verified (0 mismatches)",
        "",
        "Cross-process IPC (fork + SCM_RIGHTS)",
        f"  child:  allocated {size} bytes, exported as {MEMFD_FD}",
        "  child:  wrote pattern",
        "  child:  sent fd to parent",
        f"  parent: received {MEMFD_FD} from child",
        "  parent: mapped host shared memory (memfd) into this process",
        "  parent: verified (0 mismatches)",
        "",
        "Cross-GPU sharing across processes",
        "  host shared memory involves no GPU. Skipping.",
        "",
    ]


def _mask(text: str) -> list[str]:
    """Mask what the kernel chooses: fd numbers and child pids."""
    text = re.sub(r"\bfd \d+", "fd N", text)
    text = re.sub(r"\bchild \d+ ", "child PID ", text)
    return text.splitlines()


def _assert_lines(got: str, expected: list[str]) -> None:
    lines = _mask(got)
    for n, (g, e) in enumerate(zip(lines, expected), 1):
        assert g == e, f"line {n}: got {g!r}, expected {e!r}\n--- full output:\n{got}"
    assert len(lines) == len(expected), f"got {len(lines)} lines, expected {len(expected)}:\n{got}"


# --------------------------------------------------------------------------- normal runs


@pytest.mark.parametrize("args,size", [
    ((), 16384),
    (("--size", "4"), 4),
    (("--size", "0x100000"), 1 << 20),
    (("run", "--size", "4096"), 4096),
    (("--size", "4096", "run"), 4096),  # options before the subcommand are kept (was: reset to defaults)
])
def test_memfd_run_prints_the_expected_lines(args, size):
    out = run_cli("--mechanism", "memfd", *args, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_lines(out.stdout, _expected_memfd(size) + ["Done"])
    assert out.stderr == ""


def test_memfd_fd_numbers_are_real_numbers():
    out = run_cli("--mechanism", "memfd", timeout=60)
    fds = re.findall(r"\(memfd\) fd (\d+)", out.stdout)
    assert len(fds) == 3 and all(int(fd) >= 0 for fd in fds), out.stdout


def test_huge_timeout_is_honoured_not_overflowed():
    """poll(2) takes an int of milliseconds: a timeout over ~24.8 days used to raise
    OverflowError in every wait (both children failed). Now waits are sliced."""
    out = run_cli("--mechanism", "memfd", "--timeout", "1e10", timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_lines(out.stdout, _expected_memfd(16384) + ["Done"])


# --------------------------------------------------------------------------- dying children


def test_child_killed_mid_protocol_is_reported_within_the_timeout():
    start = time.monotonic()
    out = run_cli("--mechanism", "memfd", "--timeout", "10", extra_env={FAULT: "child-sigkill-before-send"},
                  timeout=60)
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    expected = _expected_memfd(16384)
    cut = expected.index("  child:  sent fd to parent")
    expected[cut:cut + 4] = ["  parent: child closed the socket before sending the fd "
                             "(child PID was killed by SIGKILL)"]
    _assert_lines(out.stdout, expected)
    assert "killed by SIGKILL" in out.stdout
    assert "Traceback" not in out.stderr
    assert elapsed < 10, f"EOF from a dead child must not wait for the timeout ({elapsed:.1f} s)"


def test_child_exiting_before_the_ack_still_verifies():
    """The producer frees its memfd before the consumer's ack: the fd in flight keeps the pages."""
    out = run_cli("--mechanism", "memfd", extra_env={FAULT: "child-exit-before-ack"}, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_lines(out.stdout, _expected_memfd(16384) + ["Done"])


def _session_members(sid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process in session ``sid``, from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            found.append((int(name), fields[0]))
    return found


def test_hung_child_times_out_bounded_and_leaves_no_process():
    env = env_with_src()
    env[FAULT] = "child-hang-before-send"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop", "--mechanism", "memfd", "--timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its session id is its pid: children inherit it
    most = 0
    try:
        while proc.poll() is None and time.monotonic() - start < 20:
            most = max(most, len(_session_members(proc.pid)))
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=max(0.1, 20 - (time.monotonic() - start)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, stdout + stderr
    assert 2 <= elapsed < 20, elapsed
    assert most >= 2, "the check never saw the forked children, so it proves nothing"
    assert _session_members(proc.pid) == [], "a child outlived the run"
    expected = _expected_memfd(16384)
    cut = expected.index("  child:  sent fd to parent")
    expected[cut:cut + 4] = ["  parent: timed out after 2 s waiting for the child's fd "
                             "(child PID was killed by SIGKILL)"]
    _assert_lines(stdout, expected)
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------- usage errors


BAD_OPTIONS = [
    ("--mechanism", "cuda-ipc"),
    ("--mechanism", ""),
    ("--memory", "managed"),
    ("--size", "0"),
    ("--size", str((1 << 42) + 4)),
    ("--size", "-4"),
    ("--size", "-1"),
    ("--size", "abc"),
    ("--size", "1.5"),
    ("--size", "6"),
    ("--size", "4_096"),
    ("--size", "+4096"),
    ("--size", "0o10"),
    ("--size", "0b100"),
    ("--size", "5T"),
    ("--size", ""),
    ("--size",),
    ("--timeout", "-1"),
    ("--timeout", "0"),
    ("--timeout", "abc"),
    ("--timeout", "nan"),
    ("--timeout", "inf"),
    ("--device", "-1"),
    ("--device", "abc"),
    ("--device", "1.0"),
    ("--no-such-option",),
    ("no-such-command",),
    ("run", "--size", "0"),
    ("run", "--timeout", "-1"),
    ("run", "--device", "-1"),
    ("--mechanism", "memfd", "run", "--mechanism", "nope"),
]


@pytest.mark.parametrize("args", BAD_OPTIONS, ids=lambda a: " ".join(a) or "empty")
def test_bad_option_is_one_usage_line_and_exit_2(args):
    out = run_cli(*args, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("dmabuf-interop") and "error:" in lines[0]


# --------------------------------------------------------------------------- option parsing, as a property

INVALID = object()
DEFAULTS = {"mechanism": "auto", "memory": "host", "device": 0, "size": 16384, "timeout": 60.0}

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=8)

sizes = st.one_of(
    st.integers(1, 1 << 40).map(lambda k: 4 * k).flatmap(
        lambda n: st.sampled_from([str(n), hex(n)]).map(lambda t: (t, n))),
    st.tuples(st.integers(1, 1023), st.sampled_from([("K", 10), ("KiB", 10), ("m", 20), ("G", 30), ("t", 40)])).map(
        lambda c: (f"{c[0]}{c[1][0]}", c[0] << c[1][1]) if c[0] << c[1][1] <= 1 << 42 else (f"{c[0]}{c[1][0]}", INVALID)),
    st.integers(-(1 << 40), 1 << 40).filter(lambda n: n <= 0 or n % 4).map(lambda n: (str(n), INVALID)),
    st.sampled_from(["", "abc", "1.5", "0x", "1e3", "four", "4 4", "0o", "--", "0o10", "0b100", "4_096",
                     "+4096", "4B", "4iB", "1.5K", " 4096"]).map(lambda t: (t, INVALID)),
)
timeouts = st.one_of(
    st.floats(min_value=1e-9, max_value=1e12).map(lambda x: (repr(x), x)),
    st.integers(1, 10**9).map(lambda n: (str(n), float(n))),
    st.floats(max_value=0.0, allow_nan=False).map(lambda x: (repr(x), INVALID)),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "", "abc", "1s", "--"]).map(lambda t: (t, INVALID)),
)
devices = st.one_of(
    st.integers(0, 1 << 31).map(lambda n: (str(n), n)),
    st.integers(-(1 << 31), -1).map(lambda n: (str(n), INVALID)),
    st.sampled_from(["", "abc", "1.0", "0x1", "cuda:0", "--"]).map(lambda t: (t, INVALID)),
)
mechanisms = st.one_of(
    st.sampled_from(MECHANISM_NAMES).map(lambda m: (m, m)),
    _TEXT.filter(lambda t: t not in MECHANISM_NAMES).map(lambda t: (t, INVALID)),
)
memories = st.one_of(
    st.sampled_from(["host", "device"]).map(lambda m: (m, m)),
    _TEXT.filter(lambda t: t not in ("host", "device")).map(lambda t: (t, INVALID)),
)
OPTIONS = {"size": sizes, "timeout": timeouts, "device": devices, "mechanism": mechanisms, "memory": memories}


@st.composite
def argvs(draw):
    subcommand = draw(st.booleans())
    chosen = draw(st.lists(st.sampled_from(sorted(OPTIONS)), unique=True))
    before, after, expect = [], [], dict(DEFAULTS)
    for key in draw(st.permutations(chosen)):
        text, value = draw(OPTIONS[key])
        where = after if subcommand and draw(st.booleans()) else before
        where += [f"--{key}", text]
        expect[key] = value
    argv = before + (["run"] + after if subcommand else [])
    return argv, expect, subcommand


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argvs())
def test_option_parsing_property(case):
    argv, expect, subcommand = case
    err = io.StringIO()
    parser = cli.build_parser()
    if any(v is INVALID for v in expect.values()):
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2, argv
        assert len(err.getvalue().splitlines()) == 1, (argv, err.getvalue())
        return
    with contextlib.redirect_stderr(err):
        ns = parser.parse_args(argv)
    assert err.getvalue() == ""
    assert ns.command == ("run" if subcommand else None)
    for key, value in expect.items():
        got = getattr(ns, key)
        assert got == value and type(got) is type(value), (argv, key, got, value)


# --------------------------------------------------------------------------- hostile environments


def _sh(cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, env=env_with_src())


PY = f"{sys.executable} -m dmabuf_interop"


@pytest.mark.parametrize("cmd", ["--mechanism memfd", "", "info"])
@pytest.mark.parametrize("lines", [1, 3, 8])
def test_reader_that_goes_away_is_no_traceback_and_exit_0(cmd, lines):
    """A closed stdout ends every command quietly with 0, however the pipe buffers."""
    out = _sh(f"{PY} {cmd} | head -{lines}; echo \"rc=${{PIPESTATUS[0]}}\" >&2")
    assert len(out.stdout.splitlines()) == lines
    assert "Traceback" not in out.stderr and "Error" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "rc=0", out.stderr


def test_closed_stdout_and_stderr_are_no_crash():
    out = _sh(f"{PY} --mechanism memfd >&-; echo rc=$?")
    assert out.stdout.strip() == "rc=0" and "Traceback" not in out.stderr, out.stderr
    out = _sh(f"{PY} --bogus 2>&-; echo rc=$?")
    assert out.stdout.strip() == "rc=2"


def test_full_disk_stdout_is_one_line():
    out = _sh(f"{PY} --mechanism memfd >/dev/full")
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "No space left" in out.stderr, out.stderr


def test_memfd_larger_than_memory_fails_with_a_line():
    out = run_cli("--mechanism", "memfd", "--size", str(1 << 40), timeout=60)
    assert out.returncode == 1
    assert "MemAvailable" in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("sub", [["info"], ["bench", "--mechanisms", "memfd", "--sizes", "4K", "--reps", "1",
                                            "--warmup", "0"]])
def test_huge_timeouts_do_not_overflow(sub):
    out = run_cli(*sub, "--timeout", "1e308", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "Overflow" not in out.stderr


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_parent_reaps_its_children():
    """SIGINT to the parent alone while a child works: 'interrupted', exit 130, no child left."""
    env = env_with_src()
    env[FAULT] = "child-hang-before-send"
    # A run started from a shell's background job inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: the run would wait out its timeout. The CLI keeps what it inherits; this test,
    # which is about Ctrl-C, gives its run the default disposition.
    proc = subprocess.Popen([sys.executable, "-m", "dmabuf_interop", "--mechanism", "memfd", "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=_sigint_default)
    try:
        seen = ""
        while "child:  wrote pattern" not in seen:
            line = proc.stdout.readline()
            assert line, "the run ended before the child wrote its pattern"
            seen += line
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr
    time.sleep(0.2)
    assert _session_members(proc.pid) == [], "a child outlived the interrupted run"


# --------------------------------------------------------------------------- version, options that do not apply


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    from dmabuf_interop import __version__

    out = run_cli(flag, timeout=60)
    assert out.returncode == 0 and out.stdout == f"dmabuf-interop {__version__}\n", out.stdout + out.stderr


@pytest.mark.parametrize("args,note", [
    (("--size", "4K", "info"), "dmabuf-interop: note: --size does not apply to info; ignored"),
    (("info", "--size", "4K"), "dmabuf-interop: note: --size does not apply to info; ignored"),
    (("info", "--device", "1", "--mechanism", "memfd", "--memory", "device"),
     "dmabuf-interop: note: --mechanism, --memory, --device do not apply to info; ignored"),
    (("--size", "8", "info", "--size", "4K"), "dmabuf-interop: note: --size does not apply to info; ignored"),
    (("--device", "1", "--mechanism", "memfd"), "dmabuf-interop: note: --device does not apply to --mechanism memfd; ignored"),
    (("--mechanism", "memfd", "--memory", "device", "--device", "7"),
     "dmabuf-interop: note: --memory, --device do not apply to --mechanism memfd; ignored"),
    (("--size", "8", "run", "--mechanism", "memfd", "--memory", "host"),
     "dmabuf-interop: note: --memory does not apply to --mechanism memfd; ignored"),
])
def test_options_that_do_not_apply_are_named_once(args, note):
    out = run_cli(*args, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.splitlines() == [note]
