"""Namespaces, connections and snapshots for the kernel tests of several backends.

* :func:`client_node_server`: three namespaces, ``client (10.0.0.2) -- node -- server
  (10.180.0.10, an echo server on 8080)``, the node routing between them (with
  ``ipv6``, also ``fd00::2 -- fd00::1 | fd00:180::1 -- fd00:180::10``);
  :func:`echo_snapshot` proxies ClusterIP 172.30.0.10:80 to that server (plus bulk
  Services), and :func:`assert_restart_keeps_connections` checks a backend restart
  against live traffic through it (:class:`Traffic`: new and long-lived connections);
* :func:`node_and_pod`: a node namespace (node IP on lo) and a pod namespace holding two
  endpoint IPs, the Service range routed towards the pods; :func:`answered_by` connects
  from the node and says which endpoint answered;
* :func:`nft_listing_reloads`: whether ``nft list ruleset`` of a namespace, fed to
  ``nft -f`` in an empty one, loads and lists the same.

Every namespace is named ``<prefix>-...`` (each test file passes its own prefix) and
deleted whatever happens.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from kubeproxy.backend import NodePortAddresses, ProxySnapshot
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.testing.netns import (
    SubprocessRunner,
    add_namespaces,
    delete_namespaces,
    entered,
    open_namespace,
    write_sysctl,
)
from kubeproxy.testing.runner import default_timeout
from kubeproxy.testing.traffic import ListenerServer, make_listener

T = TypeVar("T")

ECHO_VIP, ECHO_SERVER_IP = "172.30.0.10", "10.180.0.10"
ECHO_SERVER_IP6 = "fd00:180::10"


NFTABLES_FLOW_FILES = sorted(
    p
    for group in ("examples", "behaviour", "nftables")
    for p in (Path(__file__).resolve().parent.parent / "flowcases" / group).glob("*.yaml")
)
"""The flow-case files nftables mode runs (the kernel tests replay each state of them)."""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def run_in(netns: str, *argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        input=stdin,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


_EXPIRES = re.compile(r" expires [0-9hms.]+")


_OWNER = re.compile(r" # progname \S+| *\n\tflags owner(?=\n)")


def _comparable(listing: str) -> str:
    # nft separates a table's objects from its flags by a blank line (none after a
    # comment alone), so a listing without the owner flag has one blank line fewer.
    return "\n".join(line for line in _EXPIRES.sub("", listing).splitlines() if line)


def without_owner(listing: str) -> str:
    """An ``nft list`` text without what says who owns a table: the same before and after
    its owner ends (``flags owner`` becomes ``flags`` when the table is orphaned), or
    whether the table is owned at all."""
    text = _OWNER.sub("", listing)
    text = re.sub(r"\n\tflags *(?=\n)", "", text)
    return _comparable(text)


def nft_listing_reloads(netns: str) -> str | None:
    """None when the ruleset of ``netns`` (as ``nft list ruleset`` shows it) loads with
    ``nft -f`` into an empty namespace and lists the same there; else what went wrong.

    Dynamic-map entries count down while they live, so their ``expires`` are left out
    of the comparison. An owned table (``flags owner``, and nft's ``# progname`` note of
    its owner) is loaded without its owner: a table that ``nft -f`` made owned would go
    with that process (and ``persist`` is not in nft 1.0.6's words).
    """
    listed = _OWNER.sub("", run_in(netns, "nft", "list", "ruleset"))
    scratch = f"kpxl-{os.getpid() % 100000}-{uuid.uuid4().hex[:6]}"
    ip("netns", "add", scratch)
    try:
        loaded = subprocess.run(
            ["ip", "netns", "exec", scratch, "nft", "-f", "-"],
            input=listed,
            capture_output=True,
            text=True,
            check=False,
        )
        if loaded.returncode != 0:
            return f"the listing does not load: {' '.join(loaded.stderr.split())[:600]}"
        again = run_in(scratch, "nft", "list", "ruleset")
    finally:
        subprocess.run(["ip", "netns", "delete", scratch], check=False, capture_output=True)
    if _comparable(again) != _comparable(listed):
        diff = difflib.unified_diff(listed.splitlines(), again.splitlines(), lineterm="", n=0)
        return "reloaded, it lists otherwise: " + " | ".join(list(diff)[2:8])
    return None


# client -- node -- server ----------------------------------------------------------------


@dataclass
class Topology:
    """client (10.0.0.2) -- node -- server (10.180.0.10, echo on 8080)."""

    node: str
    client: str
    server: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ipv6: bool = False

    def echo(self, vip: str = ECHO_VIP, port: int = 80) -> bytes:
        """``hello`` sent from the client to ``vip:port``, and what came back."""

        def send() -> bytes:
            with socket.create_connection((vip, port), timeout=2 * default_timeout()) as sock:
                sock.sendall(b"hello\n")
                return sock.recv(64)

        return self.in_namespace(self.client, send)

    def in_namespace(self, netns: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread that has entered ``netns``; return its result."""
        result: list[T] = []
        errors: list[BaseException] = []

        def run() -> None:
            fd = open_namespace(netns)
            try:
                with entered(fd):
                    result.append(fn())
            except BaseException as err:  # re-raised in the caller
                errors.append(err)
            finally:
                os.close(fd)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return result[0]


ECHO_SERVER = """
import socket, sys, threading
if sys.argv[1:] == ["6"]:
    s = socket.socket(socket.AF_INET6)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); s.bind(("::", 8080))
else:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8080))
s.listen(512)
def serve(c):
    with c:
        while True:
            data = c.recv(4096)
            if not data:
                return
            c.sendall(data)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@contextlib.contextmanager
def client_node_server(prefix: str, *, ipv6: bool = False) -> Iterator[Topology]:
    """The three namespaces ``<prefix>-<pid>-node|cli|srv``, the echo server running
    (with ``ipv6``, on both families)."""
    names_prefix = f"{prefix}-{os.getpid()}"
    topo = Topology(f"{names_prefix}-node", f"{names_prefix}-cli", f"{names_prefix}-srv", ipv6=ipv6)
    names = [topo.node, topo.client, topo.server]
    to_client, to_server = f"{prefix}-c", f"{prefix}-s"
    try:
        for name in names:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", topo.node, "link", "add", to_client, "type", "veth", "peer", "name", "eth0",
           "netns", topo.client)  # fmt: skip
        ip("-n", topo.node, "link", "add", to_server, "type", "veth", "peer", "name", "eth0",
           "netns", topo.server)  # fmt: skip
        for link, addr in ((to_client, "10.0.0.1/24"), (to_server, "10.180.0.1/24")):
            ip("-n", topo.node, "addr", "add", addr, "dev", link)
            ip("-n", topo.node, "link", "set", link, "up")
        for name, addr, gateway in (
            (topo.client, "10.0.0.2/24", "10.0.0.1"),
            (topo.server, f"{ECHO_SERVER_IP}/24", "10.180.0.1"),
        ):
            ip("-n", name, "addr", "add", addr, "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "route", "add", "default", "via", gateway)
        run_in(topo.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        if ipv6:
            _add_ipv6(topo, to_client, to_server)
        for version in ("4", "6") if ipv6 else ("4",):
            server = subprocess.Popen(
                ["ip", "netns", "exec", topo.server, sys.executable, "-c", ECHO_SERVER, version],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            topo.processes.append(server)
        _wait_for_server(topo)
        yield topo
    finally:
        for process in topo.processes:
            process.kill()
            process.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _add_ipv6(topo: Topology, to_client: str, to_server: str) -> None:
    """The IPv6 side: no duplicate address detection, so addresses work at once."""
    for name in (topo.node, topo.client, topo.server):
        run_in(name, "sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0")
        run_in(name, "sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0")
    run_in(topo.node, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
    for link, addr in ((to_client, "fd00::1/64"), (to_server, "fd00:180::1/64")):
        ip("-n", topo.node, "addr", "add", addr, "dev", link, "nodad")
    for name, addr, gateway in (
        (topo.client, "fd00::2/64", "fd00::1"),
        (topo.server, f"{ECHO_SERVER_IP6}/64", "fd00:180::1"),
    ):
        ip("-n", name, "addr", "add", addr, "dev", "eth0", "nodad")
        ip("-n", name, "-6", "route", "add", "default", "via", gateway)


def _wait_for_server(topo: Topology) -> None:
    servers = [ECHO_SERVER_IP, ECHO_SERVER_IP6] if topo.ipv6 else [ECHO_SERVER_IP]

    def probe(address: str) -> bool:
        # About 25 s, longer where the flow kit's timeouts are (a Python starting under
        # emulation, `make test-kernels`, took longer than that on a loaded host).
        for _ in range(int(100 * default_timeout())):
            try:
                with socket.create_connection((address, 8080), timeout=0.2):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    for address in servers:
        assert topo.in_namespace(topo.node, functools.partial(probe, address)), (
            f"echo server did not come up on {address}"
        )


def echo_port_name(prefix: str) -> ServicePortName:
    """The echo Service's port: ``<prefix>/echo:tcp``."""
    return ServicePortName(NamespacedName(prefix, "echo"), "tcp", Protocol.TCP)


def echo_snapshot(
    prefix: str, extra: int, offset: int = 0, *, target_endpoints: int = 1
) -> ProxySnapshot:
    """The echo Service (172.30.0.10:80 -> 10.180.0.10:8080, and 10.180.0.11:8080, which
    nobody answers, when ``target_endpoints`` is 2) plus ``extra`` others, ``bulk/s<i>``
    for ``i`` from ``offset``, with three endpoints each; the node is ``<prefix>-node``."""
    services: dict[ServicePortName, ServicePort] = {}
    endpoints: dict[ServicePortName, tuple[Endpoint, ...]] = {}
    categorized: dict[ServicePortName, CategorizedEndpoints] = {}

    def add(port: ServicePort, eps: tuple[Endpoint, ...]) -> None:
        services[port.name] = port
        endpoints[port.name] = eps
        categorized[port.name] = CategorizedEndpoints(eps, (), eps, bool(eps))

    echo: tuple[Endpoint, ...] = (Endpoint(ipaddress.ip_address(ECHO_SERVER_IP), 8080),)
    if target_endpoints > 1:
        echo += (Endpoint(ipaddress.ip_address("10.180.0.11"), 8080),)
    vip = ipaddress.ip_address(ECHO_VIP)
    add(ServicePort(echo_port_name(prefix), vip, 80, Protocol.TCP), echo)
    for index in range(offset, offset + extra):
        name = ServicePortName(NamespacedName("bulk", f"s{index}"), "http", Protocol.TCP)
        eps = tuple(
            Endpoint(ipaddress.ip_address(0x0AB50000 + index * 4 + k), 8080) for k in range(3)
        )
        add(ServicePort(name, ipaddress.ip_address(0xAC1E1000 + index), 80, Protocol.TCP), eps)
    return ProxySnapshot(
        IPFamily.IPV4,
        NodeInfo(f"{prefix}-node", addresses=(ipaddress.ip_address("10.0.0.1"),)),
        services,
        endpoints,
        categorized,
        service_cidrs=(ipaddress.ip_network("172.30.0.0/16"),),
        node_port_addresses=NodePortAddresses(addresses=(ipaddress.ip_address("10.0.0.1"),)),
        local_detector=LocalDetector(
            LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network("10.0.0.0/8"),)
        ),
    )


class Traffic:
    """Connections through Services from one namespace across a switch of the rules.

    ``targets`` are ``(address, port)`` pairs of an echo service. On entering: one
    connection per target is established and echoes once (the long-lived ones), then a
    thread opens a new connection to each target in turn, sends a byte and waits for it
    back, until the block ends. On leaving: each long-lived connection echoes again.
    Without ``hold``, no long-lived connection.
    :attr:`ok`, :attr:`failed` and :attr:`errors` count the new connections; a failed
    echo of a long-lived one is in :attr:`long_lived_errors`.
    """

    def __init__(
        self,
        netns: str,
        targets: Sequence[tuple[str, int]],
        *,
        timeout: float = 1.0,
        hold: bool = True,
    ) -> None:
        self.netns = netns
        self.targets = list(targets)
        self.hold = hold
        self.timeout = timeout
        self.ok = 0
        self.failed = 0
        self.errors: list[str] = []
        self.long_lived_errors: list[str] = []
        self._stop = threading.Event()
        self._fd = -1
        self._thread: threading.Thread | None = None
        self._held: list[tuple[socket.socket, str, int]] = []

    def _connect(self, address: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with entered(self._fd):
            sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect((address, port))
        except OSError:
            sock.close()
            raise
        return sock

    def _loop(self) -> None:
        turn = 0
        while not self._stop.is_set():
            address, port = self.targets[turn % len(self.targets)]
            turn += 1
            try:
                with self._connect(address, port) as sock:
                    sock.sendall(b"x")
                    if sock.recv(8) != b"x":
                        raise OSError("wrong echo")
                self.ok += 1
            except OSError as err:
                self.failed += 1
                self.errors.append(f"{address}:{port}: {err}")
            time.sleep(0.002)

    def __enter__(self) -> Traffic:
        self._fd = open_namespace(self.netns)
        try:
            for address, port in self.targets if self.hold else ():
                sock = self._connect(address, port)
                self._held.append((sock, address, port))
                sock.sendall(b"before\n")
                assert sock.recv(64) == b"before\n", f"{address}:{port} did not echo"
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._loop, name="traffic")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sock, address, port in self._held:
            try:
                sock.sendall(b"after\n")
                if sock.recv(64) != b"after\n":
                    raise OSError("wrong echo")
            except OSError as err:
                self.long_lived_errors.append(f"{address}:{port}: {err}")
        self._close()

    def _close(self) -> None:
        for sock, _address, _port in self._held:
            sock.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def assert_unbroken(self, what: str = "the switch") -> None:
        """No new connection failed, some succeeded, and every long-lived one echoed."""
        assert self.failed == 0, (
            f"{self.failed} connections failed during {what}: {self.errors[:5]}"
        )
        assert self.ok > 0, f"no connection completed during {what}"
        assert not self.long_lived_errors, self.long_lived_errors


@contextlib.contextmanager
def connections_flowing(topology: Topology) -> Iterator[Traffic]:
    """New connections from the client to the echo Service, one after another, for as
    long as the block runs (each must echo within 1 s): a :class:`Traffic` holding no
    long-lived connection; its ``ok``, ``failed`` and ``errors`` say what it saw."""
    with Traffic(topology.client, [(ECHO_VIP, 80)], hold=False) as traffic:
        yield traffic


def assert_restart_keeps_connections(topology: Topology, restart: Callable[[], None]) -> None:
    """Run ``restart`` (a new backend's first sync) while the client holds a connection
    to the echo Service and opens new ones in a loop: no connection fails, some complete
    while ``restart`` runs, and the established one still echoes afterwards."""
    with Traffic(topology.client, [(ECHO_VIP, 80)]) as traffic:
        time.sleep(0.2)
        before = traffic.ok
        started = time.monotonic()
        restart()
        took = time.monotonic() - started
        during = traffic.ok - before
        time.sleep(0.2)
    traffic.assert_unbroken("the restart")
    assert during > 0, f"no connection completed during the {took:.2f}s restart sync"


# node and pod ----------------------------------------------------------------------------


@dataclass
class NodeAndPod:
    """The two namespaces' names, and a descriptor open on each (to enter them)."""

    node: str
    pod: str
    node_fd: int
    pod_fd: int


_NO_DAD = [("net.ipv6.conf.all.accept_dad", "0"), ("net.ipv6.conf.default.accept_dad", "0")]


@contextlib.contextmanager
def node_and_pod(
    prefix: str,
    node_ip: str,
    endpoint_ips: tuple[str, str],
    *,
    ipv6: tuple[str, ...] | None = None,
) -> Iterator[NodeAndPod]:
    """A node namespace (``node_ip`` on lo, 10.244.0.1 towards the pods) and a pod
    namespace holding both endpoint IPs; a route sends Service IPs (172.30.0.0/16)
    towards the pods. With ``ipv6`` (node IP, pod IPs) both are dual-stack too: the node
    IP on lo, fd00:244::1 towards the pod (in fd00:244::/64), Service IPs fd00:96::/64
    routed to it, and no duplicate-address detection to wait for. Both are deleted
    afterwards, and none may be left behind."""
    run_id = uuid.uuid4().hex[:6]
    names = [f"{prefix}-{run_id}-node", f"{prefix}-{run_id}-pod"]
    node_if, pod_if = f"{prefix}{run_id}n", f"{prefix}{run_id}p"
    first, second = endpoint_ips
    node_v6 = pod_v6 = ""
    if ipv6 is not None:
        node_v6 = (
            f"addr add {ipv6[0]}/128 dev lo nodad\n"
            f"addr add fd00:244::1/64 dev {node_if} nodad\n"
            f"route add fd00:96::/64 dev {node_if}\n"
        )
        pod_v6 = "".join(f"addr add {a}/64 dev {pod_if} nodad\n" for a in ipv6[1:])
        pod_v6 += "route add default via fd00:244::1\n"
    runner = SubprocessRunner()
    fds: list[int] = []
    try:
        add_namespaces(runner, names)
        fds = [open_namespace(names[0]), open_namespace(names[1])]
        if ipv6 is not None:
            for fd in fds:
                write_sysctl(fd, _NO_DAD)
        runner(
            ["ip", "-n", names[0], "-batch", "-"],
            stdin=f"link set lo up\naddr add {node_ip}/32 dev lo\n"
            f"link add {node_if} type veth peer name {pod_if} netns {names[1]}\n"
            f"addr add 10.244.0.1/24 dev {node_if}\nlink set {node_if} up\n"
            f"route add 172.30.0.0/16 dev {node_if}\n{node_v6}",
        )
        runner(
            ["ip", "-n", names[1], "-batch", "-"],
            stdin=f"link set lo up\naddr add {first}/24 dev {pod_if}\n"
            f"addr add {second}/24 dev {pod_if}\nlink set {pod_if} up\n"
            f"route add default via 10.244.0.1\n{pod_v6}",
        )
        yield NodeAndPod(names[0], names[1], fds[0], fds[1])
    finally:
        for fd in fds:
            os.close(fd)
        left = delete_namespaces(runner, names)
        assert not left, f"namespaces left behind: {left}"


@contextlib.contextmanager
def node_and_pod_serving(
    prefix: str,
    node_ip: str,
    endpoint_ips: tuple[str, str],
    *,
    ipv6: tuple[str, ...] | None = None,
    protocols: tuple[Protocol, ...] = (Protocol.TCP,),
) -> Iterator[NodeAndPod]:
    """:func:`node_and_pod` with a listener of each of ``protocols`` (TCP) on port 8080 of
    every endpoint IP, the IPv6 pod IPs too (each answers with its address, see
    :func:`answered_by`)."""
    with node_and_pod(prefix, node_ip, endpoint_ips, ipv6=ipv6) as pair:
        listeners = ListenerServer(f"{prefix}-listeners")
        for address in (*endpoint_ips, *(ipv6[1:] if ipv6 else ())):
            for protocol in protocols:
                listeners.add(
                    make_listener(pair.pod_fd, ipaddress.ip_address(address), 8080, protocol)
                )
        listeners.start()
        try:
            yield pair
        finally:
            listeners.close()


@dataclass(frozen=True)
class LoneNamespace:
    """A namespace's name and a descriptor open on it (to enter it)."""

    name: str
    fd: int


@contextlib.contextmanager
def lone_namespace(prefix: str) -> Iterator[LoneNamespace]:
    """One namespace with its loopback up, deleted afterwards (none may be left)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    runner = SubprocessRunner()
    add_namespaces(runner, [name])
    fd = -1
    try:
        runner(["ip", "-n", name, "link", "set", "lo", "up"])
        fd = open_namespace(name)
        yield LoneNamespace(name, fd)
    finally:
        if fd >= 0:
            os.close(fd)
        left = delete_namespaces(runner, [name])
        assert not left, f"namespaces left behind: {left}"


def answered_by(
    netns_fd: int,
    address: str,
    port: int = 80,
    *,
    source: str | None = None,
    protocol: Protocol = Protocol.TCP,
) -> str | None:
    """Open a TCP connection (or send a UDP datagram) from the namespace ``netns_fd``
    (from address ``source``, or the one routing picks), to an IPv4 or IPv6 address; the
    endpoint that answered (None: nobody, within the flow kit's attempt timeout: 1 s,
    longer under emulation)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    kind = socket.SOCK_DGRAM if protocol is Protocol.UDP else socket.SOCK_STREAM
    with entered(netns_fd):
        sock = socket.socket(family, kind)
    with sock:
        sock.settimeout(default_timeout())
        try:
            if source is not None:
                sock.bind((source, 0))
            sock.connect((address, port))
            if protocol is Protocol.UDP:
                sock.send(b"which")
            reply = sock.recv(256)
        except OSError:
            return None
    parts = reply.split()
    return parts[1].decode() if len(parts) == 3 else None
