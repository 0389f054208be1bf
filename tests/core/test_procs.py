"""Children are waited for whatever SIGCHLD disposition the process inherited. Real forks."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys

import pytest

from dmabuf_interop import errors
from dmabuf_interop.procs import make_children_waitable, wait_child
from tests.helpers import env_with_src, fork_child


@pytest.fixture
def sigchld_ignored():
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGCHLD, previous)


def test_wait_under_ignored_sigchld_is_syscall_error_naming_sigchld(sigchld_ignored):
    pid = fork_child(lambda: 3)
    with pytest.raises(errors.SyscallError, match="SIGCHLD is ignored") as info:
        wait_child(pid, 10)
    assert info.value.errno == errno.ECHILD


def test_make_children_waitable_restores_the_exit_status(sigchld_ignored):
    make_children_waitable()
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
    assert wait_child(fork_child(lambda: 3), 10).exitcode == 3


def test_cli_runs_all_demos_with_sigchld_ignored_through_exec():
    """SIG_IGN survives exec (as from some shells and supervisors): all three sections, Done, exit 0."""
    out = subprocess.run([sys.executable, "-m", "dmabuf_interop", "--mechanism", "memfd"], capture_output=True,
                         text=True, timeout=60, env=env_with_src(),
                         preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("verified (0 mismatches)") == 2, out.stdout
    assert "Cross-GPU sharing across processes" in out.stdout and out.stdout.rstrip().endswith("Done")
    assert out.stderr == ""
