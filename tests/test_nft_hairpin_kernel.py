"""A hairpin address two Services share, in the kernel: a full sync writes it without
counting (each Service queues it, the kernel holds one element), and incremental syncs
count it from the ports before the first change, so it stays while either Service holds
it and goes with the last (issue 32: the full sync keeps no count of 1M addresses)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import replace

import pytest

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)
from tests.kernelkit import (
    ECHO_SERVER_IP,
    Topology,
    client_node_server,
    echo_port_name,
    echo_snapshot,
    run_in,
)

pytestmark = pytest.mark.kernel

PREFIX = "kpxh"
CONFIG = ProxierConfig(node_name=f"{PREFIX}-node")
TWIN_VIP = "172.30.0.20"
TWIN = NamespacedName("hairpin", "twin")


@pytest.fixture
def topology() -> Iterator[Topology]:
    with client_node_server(PREFIX) as topo:
        yield topo


def _with_twin(base: ProxySnapshot) -> ProxySnapshot:
    """``base`` with a Service of two ports whose one endpoint is the echo server's: its
    address is then held by three ports (the echo Service's and the twin's two)."""
    services, endpoints, categorized = (
        dict(base.services),
        dict(base.endpoints),
        dict(base.categorized),
    )
    eps = (Endpoint(ipaddress.ip_address(ECHO_SERVER_IP), 8080),)
    for port_name, port in (("a", 80), ("b", 81)):
        name = ServicePortName(TWIN, port_name, Protocol.TCP)
        services[name] = ServicePort(name, ipaddress.ip_address(TWIN_VIP), port, Protocol.TCP)
        endpoints[name] = eps
        categorized[name] = CategorizedEndpoints(eps, (), eps, True)
    return replace(base, services=services, endpoints=endpoints, categorized=categorized)


def _without(base: ProxySnapshot, service: NamespacedName) -> ProxySnapshot:
    keep = [name for name in base.services if name.service != service]
    return replace(
        base,
        services={n: base.services[n] for n in keep},
        endpoints={n: base.endpoints[n] for n in keep if n in base.endpoints},
        categorized={n: base.categorized[n] for n in keep if n in base.categorized},
    )


def _hairpin(netns: str) -> list[str]:
    listing = run_in(netns, "nft", "list", "set", "ip", "kube-proxy", "hairpin-endpoints.g1")
    return re.findall(r"([0-9.]+) \. \1", listing)


def test_a_shared_hairpin_address_stays_until_its_last_port_goes(topology: Topology) -> None:
    backend = NftablesBackend(IPFamily.IPV4, CONFIG, executor=LibNftables(topology.node))
    both = _with_twin(echo_snapshot(PREFIX, 2))
    backend.sync(both, SyncChanges(full=True))
    # Queued by each Service, held once; both Services answer.
    assert _hairpin(topology.node).count(ECHO_SERVER_IP) == 1
    assert topology.echo(TWIN_VIP, 81) == b"hello\n"
    assert topology.echo() == b"hello\n"

    echo_only = _without(both, TWIN)
    backend.sync(echo_only, SyncChanges(full=False, changed_services=frozenset({TWIN})))
    assert not backend.last_sync_full
    assert _hairpin(topology.node).count(ECHO_SERVER_IP) == 1
    assert topology.echo() == b"hello\n"

    echo = echo_port_name(PREFIX).service
    backend.sync(
        _without(echo_only, echo), SyncChanges(full=False, changed_services=frozenset({echo}))
    )
    assert ECHO_SERVER_IP not in _hairpin(topology.node)
    assert len(_hairpin(topology.node)) == 6  # the two bulk Services' three each
