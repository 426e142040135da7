"""The ipvs backend against real IPVS (kernel tests, in test_ipvs_kernel's ``kpxv-`` namespaces).

Only where the kernel has IP_VS: this project's machines have not, so these run in
``make test-kernels`` (Debian's kernels in a VM) and skip here saying the kernel lacks
IP_VS. ``create_backend`` builds the backend over every real executor (IPVS over netlink,
a ``kube-ipvs0`` dummy link, the ``ipset`` tool, iptables), and what it wrote is read back
from the kernel:

* virtual servers for the cluster IP, the external and load-balancer IPs and each node
  address's NodePort, with the configured scheduler; real servers with weight 1;
* ``kube-ipvs0`` is a dummy link holding the Service addresses, the ipsets their members;
* graceful termination: a removed TCP endpoint with an open connection stays with weight
  0 and gets its weight back when it returns; a removed UDP endpoint goes at once;
* a connection through the virtual server reaches the endpoint (IPVS itself, no iptables
  DNAT);
* the deprecation warning, once; ``cleanup`` removes everything.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import warnings

import pytest

import kubeproxy.backends.ipvs as ipvs_package
from kubeproxy.backend import NodePortAddresses, SyncChanges
from kubeproxy.backends.ipvs import DEPRECATION_MESSAGE, IPVSBackend, cleanup, create_backend
from kubeproxy.backends.ipvs.ipset import IPSetCommands
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    PyrouteIPVS,
    VirtualServer,
    ipvs_in_kernel,
)
from kubeproxy.config import IPVSSettings, ProxierConfig
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPFamily, Protocol
from tests.snapshots import NODE, ep
from tests.test_ipvs_kernel import netns  # noqa: F401 (the fixture ipvs_netns uses)
from tests.test_ipvs_proxier import NODE_IP, World, cluster_ip

pytestmark = pytest.mark.kernel

ip = ipaddress.ip_address
V4 = IPFamily.IPV4


def run(*argv: str) -> str:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True).stdout


@pytest.fixture
def ipvs_netns(netns: str) -> str:  # noqa: F811 (the imported fixture)
    """A ``kpxv-`` namespace (tests/test_ipvs_kernel.py's), where the kernel has IPVS."""
    if not run_in_netns(netns, ipvs_in_kernel):
        pytest.skip("kernel lacks IP_VS (no /proc/net/ip_vs): runs in make test-kernels")
    return netns


def _backend(ns: str, scheduler: str = "rr") -> IPVSBackend:
    config = ProxierConfig(node_name=NODE, ipvs=IPVSSettings(scheduler=scheduler))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_backend(V4, config, netns=ns)


def _world() -> World:
    world = World()
    world.node_port_addresses = NodePortAddresses(match_all=True)
    world.add(
        cluster_ip(
            "web",
            "172.30.0.10",
            node_port=30080,
            external_ips=(ip("203.0.113.5"),),
            load_balancer_vips=(ip("198.51.100.7"),),
        ),
        ep("10.180.0.2", local=True),
        ep("10.180.1.3"),
    )
    world.add(cluster_ip("dns", "172.30.0.53", 53, proto=Protocol.UDP), ep("10.180.0.9", 53))
    return world


def _servers(ns: str) -> dict[str, tuple[VirtualServer, dict[str, int]]]:
    ipvs = PyrouteIPVS(netns=ns)
    try:
        return {
            str(vs): (vs, {str(rs): rs.weight for rs in ipvs.real_servers(vs)})
            for vs in ipvs.virtual_servers()
        }
    finally:
        ipvs.close()


@pytest.mark.parametrize("scheduler", ["rr", "lc", "sh"])
def test_virtual_and_real_servers_link_and_sets_in_the_kernel(
    ipvs_netns: str, scheduler: str
) -> None:
    backend = _backend(ipvs_netns, scheduler)
    backend.sync(_world().snapshot(), SyncChanges(full=True))
    servers = _servers(ipvs_netns)
    web = {"10.180.0.2:8080": 1, "10.180.1.3:8080": 1}
    assert {name: reals for name, (_, reals) in servers.items()} == {
        "172.30.0.10:80/TCP": web,
        "203.0.113.5:80/TCP": web,
        "198.51.100.7:80/TCP": web,
        f"{NODE_IP}:30080/TCP": web,
        "172.30.0.53:53/UDP": {"10.180.0.9:53": 1},
    }
    assert {vs.scheduler for vs, _ in servers.values()} == {scheduler}
    link = run("ip", "-n", ipvs_netns, "-d", "-o", "link", "show", DUMMY_DEVICE)
    assert " dummy " in link
    bound = run("ip", "-n", ipvs_netns, "-o", "addr", "show", "dev", DUMMY_DEVICE)
    assert {w for w in bound.split() if w.count(".") == 3 and "/" in w} == {
        "172.30.0.10/32",
        "172.30.0.53/32",
        "198.51.100.7/32",
        "203.0.113.5/32",
    }
    saved = IPSetCommands(netns=ipvs_netns).save()
    assert saved["KUBE-CLUSTER-IP"].members == {"172.30.0.10,tcp:80", "172.30.0.53,udp:53"}
    assert saved["KUBE-NODE-PORT-TCP"].members == {"30080"}
    cleanup(ipvs_netns)
    assert _servers(ipvs_netns) == {}
    assert DUMMY_DEVICE not in run("ip", "-n", ipvs_netns, "-o", "link")
    assert IPSetCommands(netns=ipvs_netns).save() == {}


def _listen(ns: str, address: str, port: int) -> socket.socket:
    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(8)
        return sock

    return run_in_netns(ns, make)


def _connect(ns: str, address: str, port: int) -> socket.socket:
    def make() -> socket.socket:
        return socket.create_connection((address, port), timeout=30)

    return run_in_netns(ns, make)


def test_a_connection_goes_through_ipvs_and_drains_gracefully(ipvs_netns: str) -> None:
    # The endpoint is an address of the namespace itself: IPVS serves local clients
    # (its LOCAL_OUT hook) and local real servers, so no second namespace is needed.
    run("ip", "-n", ipvs_netns, "addr", "add", "10.180.0.2/32", "dev", "lo")
    listener = _listen(ipvs_netns, "10.180.0.2", 8080)
    world = World()
    web = world.add(cluster_ip("web", "172.30.0.10"), ep("10.180.0.2", local=True))
    udp = world.add(cluster_ip("dns", "172.30.0.53", 53, proto=Protocol.UDP), ep("10.180.0.9", 53))
    backend = _backend(ipvs_netns)
    backend.sync(world.snapshot(), SyncChanges(full=True))
    client = _connect(ipvs_netns, "172.30.0.10", 80)
    conn, _ = listener.accept()
    try:
        assert conn.getsockname() == ("10.180.0.2", 8080)  # reached through IPVS
        world.endpoints[web] = ()
        world.endpoints[udp] = ()
        changed = frozenset({web.service, udp.service})
        backend.sync(world.snapshot(), SyncChanges(full=False, changed_services=changed))
        servers = _servers(ipvs_netns)
        # TCP with an open connection: kept, weight 0 (no new connections); UDP: gone.
        assert servers["172.30.0.10:80/TCP"][1] == {"10.180.0.2:8080": 0}
        assert servers["172.30.0.53:53/UDP"][1] == {}
        world.endpoints[web] = (ep("10.180.0.2", local=True),)
        backend.sync(
            world.snapshot(), SyncChanges(full=False, changed_services=frozenset({web.service}))
        )
        assert _servers(ipvs_netns)["172.30.0.10:80/TCP"][1] == {"10.180.0.2:8080": 1}
    finally:
        client.close()
        conn.close()
        listener.close()
        cleanup(ipvs_netns)


def test_create_backend_warns_once_and_works(
    ipvs_netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ipvs_package, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        create_backend(V4, ProxierConfig(node_name=NODE), netns=ipvs_netns)
        create_backend(IPFamily.IPV6, ProxierConfig(node_name=NODE), netns=ipvs_netns)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == [DEPRECATION_MESSAGE]
