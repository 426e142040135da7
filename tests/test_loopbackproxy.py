"""The localhost NodePort proxy with real sockets, in a network namespace of its own.

Upstream's ``pkg/proxy/localnodeportproxy`` tests, case for case (add and remove, endpoints
updated, no endpoints, a backend that refuses, shutdown closing listeners
and in-flight connections, IPv6, affinity pinned / re-pinned / expired, spreading without
affinity, the listener counts, a bind that fails), and what upstream does not bound:
connections, the relay's memory, a backend that never answers.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from socket import AF_INET
from typing import Any

import pytest

from kubeproxy.localnodeports import NodePortTarget
from kubeproxy.loopbackproxy import LocalNodePortProxy
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePortName
from kubeproxy.testing.netns import SubprocessRunner, entered
from tests.kernelkit import lone_namespace

pytestmark = pytest.mark.kernel

NAME = ServicePortName(NamespacedName("default", "svc"), "http", Protocol.TCP)


@dataclass
class Netns:
    name: str
    fd: int
    handed_out: set[int] = field(default_factory=set)

    def open(self, family: int = AF_INET) -> socket.socket:
        with entered(self.fd):
            return socket.socket(family, socket.SOCK_STREAM)

    def free_port(self, family: int = AF_INET) -> int:
        """A port nothing holds, never one this namespace handed out before: the kernel
        draws ``bind(0)`` ports from about 14,000, so a test's two draws were equal once in
        14,000 runs (three: 1 in 4,700)."""
        while True:
            with self.open(family) as probe:
                probe.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
                port: int = probe.getsockname()[1]
            if port not in self.handed_out:
                self.handed_out.add(port)
                return port


@pytest.fixture
def netns() -> Iterator[Netns]:
    with lone_namespace("kpxlp") as made:
        yield Netns(made.name, made.fd)


class Backend:
    """A TCP server in the namespace: echoes (``echo``) or tells its own port, then closes."""

    def __init__(self, netns: Netns, *, echo: bool, family: int = socket.AF_INET) -> None:
        self.sock = netns.open(family)
        self.sock.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        self.sock.listen(64)
        self.port: int = self.sock.getsockname()[1]
        self.address = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        self.echo = echo
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> tuple[str, int]:
        return (self.address, self.port)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            if not self.echo:
                conn.sendall(str(self.port).encode())
                return
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def proxy(
    netns: Netns, family: IPFamily = IPFamily.IPV4, **kwargs: Any
) -> Iterator[LocalNodePortProxy]:
    made = LocalNodePortProxy(family, netns=netns.name, **kwargs)
    try:
        yield made
    finally:
        made.close()


def target(port: int, *backends: Backend, affinity: int = 0) -> NodePortTarget:
    return NodePortTarget(NAME, port, tuple(b.endpoint for b in backends), affinity)


def connect(netns: Netns, port: int, family: int = socket.AF_INET) -> socket.socket:
    sock = netns.open(family)
    sock.settimeout(5.0)
    sock.connect(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
    return sock


def echo(netns: Netns, port: int, message: bytes, family: int = socket.AF_INET) -> bytes:
    with connect(netns, port, family) as sock:
        sock.sendall(message)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(1 << 20):
            received += chunk
        return received


def backend_of(netns: Netns, port: int) -> int:
    with connect(netns, port) as sock:
        data = b""
        while chunk := sock.recv(64):
            data += chunk
    return int(data)


def refused(netns: Netns, port: int) -> bool:
    try:
        connect(netns, port).close()
    except ConnectionRefusedError:
        return True
    return False


def test_add_and_remove(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, backend)])
        assert p.ports == {port} and p.listeners == 1
        assert echo(netns, port, b"hello nodeport") == b"hello nodeport"
        p.sync([])
        assert p.listeners == 0
        assert refused(netns, port)


def test_endpoints_are_updated_in_place(netns: Netns) -> None:
    first, second = Backend(netns, echo=False), Backend(netns, echo=False)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, first)])
        assert backend_of(netns, port) == first.port
        p.sync([target(port, second)])
        assert p.listeners == 1
        assert backend_of(netns, port) == second.port


def test_no_endpoints_no_listener(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([NodePortTarget(NAME, port, ())])
        assert p.listeners == 0 and refused(netns, port)
        p.sync([target(port, backend)])
        assert p.listeners == 1
        p.sync([NodePortTarget(NAME, port, ())])
        assert p.listeners == 0 and refused(netns, port)


def test_apply_changes_only_what_it_is_given(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    a, b = netns.free_port(), netns.free_port()
    with proxy(netns) as p:
        p.apply([target(a, backend)])
        p.apply([target(b, backend)])
        assert p.ports == {a, b}
        p.apply([], removed=[a])
        assert p.ports == {b}
        assert echo(netns, b, b"x") == b"x"


def test_a_backend_that_refuses_closes_the_client(netns: Netns) -> None:
    port, dead = netns.free_port(), netns.free_port()
    with proxy(netns) as p:
        p.sync([NodePortTarget(NAME, port, (("127.0.0.1", dead),))])
        with connect(netns, port) as sock:
            assert sock.recv(16) == b""
        assert wait_for(lambda: p.connections == 0)


def test_a_backend_that_never_answers_times_out(netns: Netns) -> None:
    port, silent = netns.free_port(), netns.free_port()
    # SYNs to the silent port vanish: the proxy's connect can only time out.
    SubprocessRunner()(
        ["ip", "netns", "exec", netns.name, "nft", "-f", "-"],
        stdin="add table ip t\nadd chain ip t out { type filter hook output priority 0 ; }\n"
        f"add rule ip t out tcp dport {silent} drop\n",
    )
    with proxy(netns, dial_timeout=0.3) as p:
        p.sync([NodePortTarget(NAME, port, (("127.0.0.1", silent),))])
        start = time.monotonic()
        with connect(netns, port) as sock:
            assert sock.recv(16) == b""
        assert time.monotonic() - start < 3.0
        assert wait_for(lambda: p.connections == 0)


def test_close_ends_listeners_and_connections_in_flight(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    ports = [netns.free_port() for _ in range(3)]
    p = LocalNodePortProxy(IPFamily.IPV4, netns=netns.name)
    p.sync([target(port, backend) for port in ports])
    assert p.listeners == 3
    idle = connect(netns, ports[0])
    idle.sendall(b"x")
    assert idle.recv(1) == b"x"  # established through the proxy
    p.close()
    idle.settimeout(2.0)
    try:
        assert idle.recv(1) == b""
    except ConnectionResetError:
        pass  # closed either way; a timeout would fail the test
    finally:
        idle.close()
    assert all(refused(netns, port) for port in ports)
    with pytest.raises(RuntimeError, match="closed"):
        p.sync([])


def test_a_removed_listener_closes_its_connections(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, backend)])
        with connect(netns, port) as sock:
            sock.sendall(b"x")
            assert sock.recv(1) == b"x"
            p.sync([])
            assert sock.recv(1) == b""


def test_ipv6(netns: Netns) -> None:
    backend = Backend(netns, echo=True, family=socket.AF_INET6)
    port = netns.free_port(socket.AF_INET6)
    with proxy(netns, family=IPFamily.IPV6) as p:
        assert p.address == "::1"
        p.sync([target(port, backend)])
        assert echo(netns, port, b"hello ipv6", socket.AF_INET6) == b"hello ipv6"


def test_affinity_pins_all_localhost_clients_to_one_endpoint(netns: Netns) -> None:
    backends = [Backend(netns, echo=False) for _ in range(3)]
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, *backends, affinity=10800)])
        first = backend_of(netns, port)
        assert all(backend_of(netns, port) == first for _ in range(10))


def test_a_pinned_endpoint_removed_is_replaced(netns: Netns) -> None:
    one, two = Backend(netns, echo=False), Backend(netns, echo=False)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, one, two, affinity=10800)])
        pinned = backend_of(netns, port)
        remaining = two if pinned == one.port else one
        p.sync([target(port, remaining, affinity=10800)])
        assert backend_of(netns, port) == remaining.port


def test_affinity_expires_after_its_timeout_without_a_connection(netns: Netns) -> None:
    backends = [Backend(netns, echo=False) for _ in range(3)]
    port = netns.free_port()
    now = [1000.0]
    with proxy(netns, clock=lambda: now[0], rng=random.Random(7)) as p:
        p.sync([target(port, *backends, affinity=60)])
        first = backend_of(netns, port)
        now[0] += 30  # inside the window, renewed by each connection
        assert backend_of(netns, port) == first
        for _ in range(20):
            now[0] += 61
            if backend_of(netns, port) != first:
                break
        else:
            pytest.fail("the pin never expired")


def test_without_affinity_connections_spread(netns: Netns) -> None:
    backends = [Backend(netns, echo=False) for _ in range(3)]
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, *backends)])
        seen = {backend_of(netns, port) for _ in range(100)}
        assert seen == {b.port for b in backends}


def test_a_port_held_by_another_process_is_counted_logged_once_and_retried(
    netns: Netns, caplog: pytest.LogCaptureFixture
) -> None:
    backend = Backend(netns, echo=True)
    taken = netns.open()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    held = taken.getsockname()[1]
    free = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(held, backend), target(free, backend)])
        assert p.ports == {free} and p.listener_failures == 1
        p.sync([target(held, backend), target(free, backend)])
        assert p.listener_failures == 2
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1
        assert f"port={held}" in errors[0].getMessage()
        assert "Address already in use" in errors[0].getMessage()
        taken.close()
        p.sync([target(held, backend), target(free, backend)])
        assert p.ports == {held, free}
        assert echo(netns, held, b"freed") == b"freed"


def test_connections_are_bounded(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    with proxy(netns, max_connections=4) as p:
        p.sync([target(port, backend)])
        first, second = connect(netns, port), connect(netns, port)
        for sock in (first, second):
            sock.sendall(b"a")
            assert sock.recv(1) == b"a"
        assert p.connections == 2
        # A lone Service gets half the cap: the third waits in the kernel's accept queue,
        # connected but not served.
        third = connect(netns, port)
        third.settimeout(0.5)
        third.sendall(b"b")
        with pytest.raises(TimeoutError):
            third.recv(1)
        assert p.connections == 2
        first.close()
        third.settimeout(5.0)
        assert third.recv(1) == b"b"
        second.close()
        third.close()
        assert wait_for(lambda: p.connections == 0)


class Hung:
    """A backend that accepts and then does nothing: never reads, never closes (a hung
    application); it keeps every connection it accepted."""

    def __init__(self, netns: Netns) -> None:
        self.sock = netns.open()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port: int = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def hung_target(port: int, hung: Hung) -> NodePortTarget:
    name = ServicePortName(NamespacedName("default", "hung"), "http", Protocol.TCP)
    return NodePortTarget(name, port, (hung.endpoint,), 0)


def test_one_service_cannot_take_every_slot_of_the_family(netns: Netns) -> None:
    # Issue 31: a backend that ignores its clients held the whole family's cap, and every
    # other localhost NodePort of the family was dead until it let go.
    hung, backend = Hung(netns), Backend(netns, echo=True)
    stuck, other, third = netns.free_port(), netns.free_port(), netns.free_port()
    with proxy(netns, max_connections=8) as p:
        p.sync([hung_target(stuck, hung), target(other, backend), target(third, backend)])
        clients = [connect(netns, stuck) for _ in range(20)]
        assert wait_for(lambda: p.connections == 4)  # half the cap: the rest wait
        assert echo(netns, other, b"still served") == b"still served"
        with connect(netns, other) as held:  # a second Service holding one, the third
            held.sendall(b"1")
            assert held.recv(1) == b"1"
            assert echo(netns, third, b"served too") == b"served too"
        assert wait_for(lambda: p.connections == 4)
        for sock in clients:
            sock.close()
        hung.close()


def test_a_half_closed_connection_is_closed_after_its_timeout(netns: Netns) -> None:
    hung = Hung(netns)
    port = netns.free_port()
    with proxy(netns, half_close_timeout=0.5) as p:
        p.sync([hung_target(port, hung)])
        with connect(netns, port) as client:
            client.sendall(b"request")
            # Timed from before the half-close: the proxy cannot see it any earlier (timed
            # from after the wait below, a slow poll on a busy machine ate the 0.1 s slack).
            start = time.monotonic()
            client.shutdown(socket.SHUT_WR)  # the client is done; the backend never is
            assert wait_for(lambda: p.connections == 1 and len(hung.conns) == 1)
            assert wait_for(lambda: p.connections == 0, timeout=5.0)
            assert time.monotonic() - start >= 0.4
            assert client.recv(16) == b""  # the proxy ended the client's side too
        assert p.closed_half_closed == 1
        backend_side = hung.conns[0]
        backend_side.settimeout(2.0)
        assert backend_side.recv(16) == b"request"
        assert backend_side.recv(16) == b""  # and told the backend
        hung.close()


def test_an_idle_connection_is_closed_after_its_timeout_a_busy_one_is_not(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    # The busy connection's bytes 0.2 s apart leave 1.3 s for a busy machine to delay one
    # (with 0.6 s, a stall of 0.4 s closed it); the idle one is gone before the 2 s end.
    with proxy(netns, idle_timeout=1.5) as p:
        p.sync([target(port, backend)])
        idle, busy = connect(netns, port), connect(netns, port)
        with idle, busy:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:  # one byte every 0.2 s keeps it open
                busy.sendall(b"x")
                assert busy.recv(1) == b"x"
                time.sleep(0.2)
            assert idle.recv(1) == b""
            assert p.connections == 1
            assert p.closed_idle == 1


def test_proxied_sockets_send_keepalives(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    with proxy(netns) as p:
        p.sync([target(port, backend)])
        with connect(netns, port) as sock:
            sock.sendall(b"x")
            assert sock.recv(1) == b"x"
            listing = SubprocessRunner()(
                ["ip", "netns", "exec", netns.name, "ss", "-tnoH", "state", "established"]
            )
    # The proxy's two sockets (accepted from the client, connected to the backend) carry
    # a keep-alive timer; the test's own client and the backend's socket do not.
    assert listing.count("timer:(keepalive") == 2, listing


def test_stopping_at_the_cap_is_clean(netns: Netns, monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 31: stopping at the cap registered a closed listener again, and the proxy's
    # thread ended with a traceback.
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    hung, backend = Hung(netns), Backend(netns, echo=True)
    stuck, other = netns.free_port(), netns.free_port()
    p = LocalNodePortProxy(IPFamily.IPV4, netns=netns.name, max_connections=2)
    p.sync([hung_target(stuck, hung), target(other, backend)])
    held = [connect(netns, stuck), connect(netns, other)]
    held[1].sendall(b"x")
    assert held[1].recv(1) == b"x"
    assert wait_for(lambda: p.connections == 2)  # every slot taken
    waiting = connect(netns, other)  # in the accept queue
    p.close()
    assert not p._thread.is_alive()
    assert died == []
    for sock in (*held, waiting):
        sock.settimeout(2.0)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""
        sock.close()
    hung.close()


def test_a_large_transfer_with_half_close(netns: Netns) -> None:
    backend = Backend(netns, echo=True)
    port = netns.free_port()
    payload = bytes(range(256)) * 40_000  # 10 MB
    with proxy(netns) as p:
        p.sync([target(port, backend)])
        sock = connect(netns, port)

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        with sock:
            sender = threading.Thread(target=send)
            sender.start()
            received = bytearray()
            while chunk := sock.recv(1 << 20):
                received += chunk
            sender.join()
        assert bytes(received) == payload
        assert wait_for(lambda: p.connections == 0)


def test_an_unknown_namespace_fails_at_once() -> None:
    with pytest.raises(FileNotFoundError):
        LocalNodePortProxy(IPFamily.IPV4, netns=f"kpxlp-missing-{uuid.uuid4().hex[:6]}")


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
