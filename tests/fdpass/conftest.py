"""Fixtures shared by the fd-passing tests: a connected socket pair and the fd-leak check."""

from __future__ import annotations

import gc
import socket

import pytest

from dmabuf_interop.fd import open_fds


@pytest.fixture
def no_fd_leak():
    """The set of open fds must be the same after the test."""
    gc.collect()  # an earlier test's garbage closes its fds now, not inside this test's count
    before = open_fds()
    yield
    after = open_fds()
    assert after == before, f"fd leak: opened {sorted(set(after) - set(before))}, " \
                            f"closed {sorted(set(before) - set(after))}"


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        yield a, b
