"""tcp:// channels through NIXL, on loopback with host pools: real processes, real sockets, real READs."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time

import pytest

from dmabuf_interop.channel import connect, listen
from dmabuf_interop.channel.auth import authenticate_connector, authenticate_listener, load_secret
from dmabuf_interop.channel.remote import ucx_read_transports
from dmabuf_interop.errors import InvalidArgumentError, NotSupportedError, PeerRefusedError
from tests.helpers.remote import TOKEN, peer_env, result, start, start_producer


def assert_released_and_clean(got: dict, sent: dict) -> None:
    """Every lease ended released; neither side left a NIXL registration or an fd behind."""
    assert sent["reasons"] == ["released"]
    assert got["registered"] == sent["registered"] == 0
    assert got["fds_leaked"] == sent["fds_leaked"] == 0


@pytest.mark.nixl
def test_thousand_mixed_arrays_verified_and_nothing_leaked() -> None:
    producer, addr = start_producer("producer", "1000", "host")
    consumer = start("consumer", addr, "1000", "host")
    got, sent = result(consumer), result(producer)
    assert got["good"] == got["n"] == 1000
    assert got["transport"]["mechanism"] == "nixl" and got["transport"]["backend"] == "UCX"
    assert got["transport"]["ucx_tls"] == "tcp" and got["transport"]["ucx_net_devices"] == "lo"
    assert_released_and_clean(got, sent)


@pytest.mark.nixl
def test_recv_into_callers_arrays() -> None:
    producer, addr = start_producer("producer", "50", "host")
    consumer = start("consumer-into", addr, "50")
    got, sent = result(consumer), result(producer)
    assert got["refused"] == 1 and got["good"] == 49  # a wrong shape is refused, and its lease still released
    assert_released_and_clean(got, sent)


@pytest.mark.nixl
def test_wrong_token_is_refused_on_both_sides() -> None:
    producer, addr = start_producer("producer", "1", "host")
    consumer = start("consumer", addr, "1", "host", env=peer_env(token="not-the-shared-secret"))
    out, err = consumer.communicate(timeout=60)
    assert consumer.returncode != 0 and "PeerRefusedError" in err and "wrong shared secret" in err
    out, err = producer.communicate(timeout=60)
    assert producer.returncode != 0 and "PeerRefusedError" in err and "wrong shared secret" in err


@pytest.mark.nixl
def test_consumer_killed_releases_its_leases_within_a_second() -> None:
    producer, addr = start_producer("producer-watch", "8")
    consumer = start("consumer-hold", addr, "1")
    assert producer.stdout.readline().strip() == "sent"
    assert consumer.stdout.readline().strip() == "held 1"
    killed_at = time.time()
    consumer.send_signal(signal.SIGKILL)
    consumer.wait(30)
    report = result(producer)
    assert report["reasons"] == ["disconnected", "released"]  # 1 read, 7 still lent when it died
    assert report["done_at"] - killed_at < 1.0
    assert report["registered"] == 0  # the channel's end deregistered its chunks


@pytest.mark.nixl
def test_producer_killed_fails_the_read_and_keeps_what_was_received() -> None:
    producer, addr = start_producer("producer-stream")
    consumer = start("consumer-survive", addr, "5")
    assert consumer.stdout.readline().strip() == "held 5"
    producer.send_signal(signal.SIGKILL)
    producer.wait(30)
    report = result(consumer)
    assert report["held_ok"] == 5
    assert report["error"] == "PeerClosedError"
    assert report["seconds"] < 30


def test_remote_address_without_nixl_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api", "nixl"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(NotSupportedError, match=r"dmabuf-interop\[nixl\]"):
        listen("tcp://127.0.0.1:0", token=TOKEN)
    with pytest.raises(NotSupportedError, match=r"dmabuf-interop\[nixl\]"):
        connect("tcp://127.0.0.1:1", token=TOKEN)


@pytest.mark.parametrize("address", ["tcp://", "tcp://host", "tcp://host:port", "tcp://h:1/path", "tcp://u@h:1"])
def test_bad_remote_address(address: str) -> None:
    with pytest.raises(InvalidArgumentError):
        connect(address, token=TOKEN)


def test_remote_options_refused_for_local_addresses(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match="tcp://"):
        listen(str(tmp_path / "s"), token=TOKEN)


def test_secret_sources(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DMABUF_INTEROP_TOKEN", raising=False)
    with pytest.raises(InvalidArgumentError, match="DMABUF_INTEROP_TOKEN"):
        load_secret()
    with pytest.raises(InvalidArgumentError, match="at least 16"):
        load_secret("short")
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)  # (one readable by others is read with a warning)
    assert load_secret(token_file=f) == TOKEN.encode()
    monkeypatch.setenv("DMABUF_INTEROP_TOKEN", TOKEN)
    assert load_secret() == TOKEN.encode()
    with pytest.raises(InvalidArgumentError):
        load_secret(TOKEN, f)


def _auth_pair(listener_secret: bytes, connector_secret: bytes) -> tuple[BaseException | None, BaseException | None]:
    a, b = socket.socketpair()
    errs: list[BaseException | None] = [None, None]

    def side(i: int, fn, sock, secret) -> None:
        try:
            fn(sock, secret, 10)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errs[i] = exc
        finally:
            sock.close()

    t = threading.Thread(target=side, args=(0, authenticate_listener, a, listener_secret))
    t.start()
    side(1, authenticate_connector, b, connector_secret)
    t.join(10)
    return errs[0], errs[1]


def test_challenge_response() -> None:
    assert _auth_pair(TOKEN.encode(), TOKEN.encode()) == (None, None)
    lerr, cerr = _auth_pair(TOKEN.encode(), b"another-secret-of-enough-bytes")
    assert isinstance(lerr, PeerRefusedError) and isinstance(cerr, PeerRefusedError)
    assert "wrong shared secret" in str(cerr)


def test_secret_never_on_the_wire() -> None:
    a, b = socket.socketpair()
    seen = bytearray()
    refused: list[BaseException] = []

    def listener() -> None:
        try:
            authenticate_listener(a, TOKEN.encode(), 10)
        except PeerRefusedError as exc:
            refused.append(exc)

    t = threading.Thread(target=listener)
    t.start()
    # A connector that records what the listener sends and answers with garbage.
    from dmabuf_interop.channel.wire import recv_frame, send_frame

    msg, _ = recv_frame(b, 10)
    seen += repr(msg).encode()
    send_frame(b, {"kind": "auth", "nonce": msg["nonce"], "mac": msg["nonce"]})
    msg, _ = recv_frame(b, 10)
    seen += repr(msg).encode()
    t.join(10)
    a.close(), b.close()
    assert msg["kind"] == "refuse" and len(refused) == 1
    assert TOKEN.encode() not in seen


PROTO_INFO = """\
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   | b inter-node cfg#1                                    |
[1.1] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   |   Range     |    Description     |       Config        |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   |     0..inf  | zero-copy          | tcp/lo              |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   | b inter-node cfg#1                                    |
[1.1] [vm:1:0]   | active message by ucp_am_send* from host memory       |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   |          0  | short              | posix/memory        |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   | b intra-node cfg#2                                    |
[1.1] [vm:1:0]   | remote memory read by ucp_get* into cuda memory from cuda |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
[1.1] [vm:1:0]   |     0..inf  | zero-copy          | cuda_ipc/cuda       |
[1.1] [vm:1:0]   +-------------+--------------------+---------------------+
"""


def test_ucx_read_transports_parses_proto_info() -> None:
    assert ucx_read_transports(PROTO_INFO) == ["tcp/lo", "cuda_ipc/cuda"]
    assert ucx_read_transports("") == []


@pytest.mark.nixl
def test_remote_listener_skips_a_peer_that_left_and_refuses_accept_once_closed() -> None:
    from dmabuf_interop.errors import WaitTimeoutError

    listener = listen("tcp://127.0.0.1:0", token=TOKEN)
    host, port = listener.address[len("tcp://"):].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()  # connects, then leaves
    with pytest.raises(WaitTimeoutError):  # the departed peer is skipped; nobody else comes
        listener.accept(0.5)
    listener.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        listener.accept(1)
    # A thread waiting in accept() is woken by close().
    listener = listen("tcp://127.0.0.1:0", token=TOKEN)
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: errors.append(pytest.raises(InvalidArgumentError, listener.accept,
                                                                         None).value))
    waiter.start()
    time.sleep(0.3)
    listener.close()
    waiter.join(5)
    assert not waiter.is_alive() and len(errors) == 1 and "closed" in str(errors[0])
