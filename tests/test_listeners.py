"""Listeners that hold bursts: the accept queue every listener asks for, and the cap on
connection handlers.

The backlog tests read what the kernel holds (``ss``: a listening socket's Send-Q is its
accept-queue limit) in network namespaces of our own whose ``net.core.somaxconn`` is set
to an unusual value, so a listener that asked for anything else shows. The last one runs
the real binary and reads every listener in its namespace. The handler-cap tests hold
handlers busy with clients that connect and send nothing, and watch the next request
wait in the accept queue until a handler is free.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeproxy.health import ProxyHealth, ProxyHealthServer, ServiceHealthServer
from kubeproxy.host.httpserving import DEFAULT_MAX_HANDLERS, HandlerSlots, listen_backlog
from kubeproxy.host.netns import in_netns
from kubeproxy.metrics import MetricsServer, ProxyMetrics
from kubeproxy.objects import IPFamily, NamespacedName, NodeInfo
from kubeproxy.testing.runner import default_timeout
from tests.test_health import lb_service, lb_slice

SOMAXCONN = 5000  # above socket.SOMAXCONN (4096): a listener showing it read the kernel's limit
BIN = Path(sys.executable).parent
NODE = "kpxl-node"
NODE_IP = "192.0.2.10"
HEALTH_CHECK_PORT = 30300


def run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 0, f"{argv}: {result.stderr}"
    return result.stdout


def listen_queues(netns: str) -> dict[tuple[str, int], int]:
    """Every TCP listener in ``netns``: (address, port) -> accept-queue limit."""
    found = {}
    for line in run("ip", "netns", "exec", netns, "ss", "-Hltn").splitlines():
        fields = line.split()
        # State Recv-Q Send-Q Local:Port Peer:Port; a listener's Send-Q is its backlog.
        host, _, port = fields[3].rpartition(":")
        found[host.strip("[]"), int(port)] = int(fields[2])
    return found


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"kpxl-{os.getpid()}"
    run("ip", "netns", "add", name)
    try:
        run("ip", "-n", name, "link", "set", "lo", "up")
        run("ip", "netns", "exec", name, "sysctl", "-qw", f"net.core.somaxconn={SOMAXCONN}")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def inside(netns: str, action: Callable[[], Any]) -> Any:
    with in_netns(netns):
        return action()


def get(port: int, path: str = "/", timeout: float = 5.0) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


# --- the accept queue -----------------------------------------------------------------


def test_listen_backlog_is_the_kernels_limit() -> None:
    with open("/proc/sys/net/core/somaxconn", encoding="ascii") as file:
        assert listen_backlog() == int(file.read())
    assert listen_backlog() > 5


@pytest.mark.kernel
def test_every_server_asks_for_the_kernels_accept_queue(namespace: str) -> None:
    assert inside(namespace, listen_backlog) == SOMAXCONN
    health = ProxyHealth(60.0, node=NodeInfo(NODE))
    healthz = ProxyHealthServer("0.0.0.0:10256", health)
    metrics = MetricsServer("127.0.0.1:10249", ProxyMetrics(process_metrics=False))
    checks = ServiceHealthServer(IPFamily.IPV4, health)
    baseline = ProxyHealthServer("127.0.0.1:10257", health, backlog=5, max_handlers=None)
    try:
        for server in (healthz, metrics, baseline):
            inside(namespace, server.start)
        inside(namespace, lambda: checks.sync_services({NamespacedName("demo", "lb"): 30301}))
        assert listen_queues(namespace) == {
            ("*", 10256): SOMAXCONN,  # dual-stack wildcard
            ("127.0.0.1", 10249): SOMAXCONN,
            ("0.0.0.0", 30301): SOMAXCONN,
            ("127.0.0.1", 10257): 5,  # the standard library's default, kept selectable
        }
    finally:
        for server in (healthz, metrics, baseline):
            server.stop()
        checks.close()


def write_manifests(directory: Path) -> None:
    """A node on NODE_IP and one LoadBalancer Service with a local endpoint."""
    documents = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]},
        },
        lb_service(HEALTH_CHECK_PORT),
        lb_slice([("10.244.0.5", NODE, True)]),
    ]
    (directory / "cluster.yaml").write_text(yaml.safe_dump_all(documents))


@pytest.mark.kernel
def test_every_listener_of_the_daemon_asks_for_the_kernels_accept_queue(
    namespace: str, tmp_path: Path
) -> None:
    run("ip", "-n", namespace, "addr", "add", f"{NODE_IP}/32", "dev", "lo")
    write_manifests(tmp_path)
    log = (tmp_path / "daemon.log").open("w")
    daemon = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            namespace,
            str(BIN / "kube-proxy-nftables"),
            "--manifests",
            str(tmp_path),
            "--hostname-override",
            NODE,
            "--cluster-cidr=10.244.0.0/16",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # The health check server binds after the first sync: under emulation (make
        # test-kernels) nothing listened yet 30 s after the start (the binary's --once
        # took 76 s there), so the wait grows with the flow kit's timeout scale.
        deadline = time.monotonic() + 30 * default_timeout()
        queues = listen_queues(namespace)
        while (NODE_IP, HEALTH_CHECK_PORT) not in queues:
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, (
                f"no health check listener: {queues}; the daemon said: "
                + (tmp_path / "daemon.log").read_text()[-2000:]
            )
            time.sleep(0.1)
            queues = listen_queues(namespace)
        # Everything the daemon listens on, and nothing else is in this namespace.
        assert queues == {
            ("*", 10256): SOMAXCONN,
            ("127.0.0.1", 10249): SOMAXCONN,
            (NODE_IP, HEALTH_CHECK_PORT): SOMAXCONN,
        }
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(15 * default_timeout())
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        log.close()
        subprocess.run(
            ["ip", "netns", "exec", namespace, "nft", "delete", "table", "ip", "kube-proxy"],
            capture_output=True,
            check=False,
        )


# --- the handler cap ------------------------------------------------------------------


def test_handler_slots_count_and_refuse_bad_limits() -> None:
    slots = HandlerSlots(2)
    assert slots.acquire(lambda: False) and slots.acquire(lambda: False)
    assert slots.active == 2
    assert not slots.acquire(lambda: True, poll=0.01), "full and closed: gives up"
    slots.release()
    assert slots.acquire(lambda: False)
    assert slots.peak == 2
    unlimited = HandlerSlots(None)
    for _ in range(DEFAULT_MAX_HANDLERS + 1):
        assert unlimited.acquire(lambda: True)
    assert unlimited.active == DEFAULT_MAX_HANDLERS + 1
    with pytest.raises(ValueError):
        HandlerSlots(0)


def idle_clients(port: int, count: int) -> list[socket.socket]:
    """Clients that connect and send nothing: each holds a handler until it gives up."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_capped(port: int, slots: HandlerSlots) -> None:
    """With a cap of 2 and two idle clients, a request waits until one of them leaves."""
    assert slots.limit == 2
    idle = idle_clients(port, 2)
    try:
        wait_until(lambda: slots.active == 2, "two busy handlers")
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            waiting.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            waiting.settimeout(0.3)
            with pytest.raises(TimeoutError):
                waiting.recv(1)  # queued: no handler is free
            assert slots.active == 2
            idle.pop().close()
            waiting.settimeout(5)
            assert waiting.recv(12).startswith(b"HTTP/1.1 ")
        finally:
            waiting.close()
    finally:
        for client in idle:
            client.close()
    wait_until(lambda: slots.active == 0, "every handler to end")
    assert slots.peak == 2


def test_proxy_health_server_caps_its_handlers() -> None:
    health = ProxyHealth(60.0, node=NodeInfo(NODE))
    server = ProxyHealthServer("127.0.0.1:0", health, max_handlers=2)
    server.start()
    try:
        assert server.port
        assert_capped(server.port, server.server.slots)
        assert get(server.port, "/healthz") == 200
    finally:
        server.stop()


def test_service_health_checks_share_one_handler_cap() -> None:
    health = ProxyHealth(60.0, node=NodeInfo(NODE))
    localhost = ipaddress.IPv4Address("127.0.0.1")
    server = ServiceHealthServer(IPFamily.IPV4, health, addresses=[localhost], max_handlers=2)
    ports: list[int] = []
    while len(ports) < 2:  # two distinct: bind(0) repeats a port 1 in 14,000 times
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            if (port := int(probe.getsockname()[1])) not in ports:
                ports.append(port)
    try:
        server.sync_services(
            {NamespacedName("demo", "a"): ports[0], NamespacedName("demo", "b"): ports[1]}
        )
        server.sync_endpoints({NamespacedName("demo", "b"): 1})
        # Two idle clients on one Service's port hold the handlers of every port.
        assert_capped(ports[1], server.slots)
        assert get(ports[1]) == 200
        assert get(ports[0]) == 503
    finally:
        server.close()


def test_capped_handlers_reuse_their_threads() -> None:
    health = ProxyHealth(60.0, node=NodeInfo(NODE))
    capped = ProxyHealthServer("127.0.0.1:0", health, max_handlers=3)
    uncapped = ProxyHealthServer("127.0.0.1:0", health, backlog=5, max_handlers=None)
    for server in (capped, uncapped):
        server.start()
    try:
        for server in (capped, uncapped):
            assert server.port
            port = server.port
            for _ in range(20):
                assert get(port, "/livez") == 200
            # A handler may still be finishing after its answer was read: let the last
            # one end, or the three idle clients can meet it (a peak of 4).
            wait_until(lambda s=server: s.server.slots.active == 0, "answered handlers")  # type: ignore[misc]
            busy = idle_clients(port, 3)
            wait_until(lambda s=server: s.server.slots.active == 3, "three busy handlers")  # type: ignore[misc]
            for client in busy:
                client.close()
            wait_until(lambda s=server: s.server.slots.active == 0, "idle handlers")  # type: ignore[misc]
        # Capped: at most three threads, kept for the next connections; uncapped: one
        # new thread per connection, none kept (the standard library's way).
        assert 1 <= capped.server.slots.workers <= 3
        assert uncapped.server.slots.workers == 0
        assert capped.server.slots.peak == uncapped.server.slots.peak == 3
    finally:
        for server in (capped, uncapped):
            server.stop()
    # Stopped: the kept threads end.
    assert capped.server.slots.workers == 0
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name == "healthz-handler"],
        "the handler threads to end",
    )
    # Started again, it serves with new ones.
    capped.start()
    try:
        assert capped.port
        assert get(capped.port, "/livez") == 200
        assert capped.server.slots.workers == 1
    finally:
        capped.stop()


def test_a_stopping_server_does_not_wait_for_a_handler_slot() -> None:
    health = ProxyHealth(60.0, node=NodeInfo(NODE))
    server = ProxyHealthServer("127.0.0.1:0", health, max_handlers=1)
    server.start()
    assert server.port
    idle = idle_clients(server.port, 2)  # one handler busy, the serving loop waiting
    try:
        wait_until(lambda: server.server.slots.active == 1, "a busy handler")
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5
    finally:
        for client in idle:
            client.close()
