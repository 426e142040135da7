"""plan_port's refusals of what must not reach nft: an endpoint of the other family or
with a port out of range, found among valid ones in any of the categorised lists (the
check looks at a list at a time, and names the first culprit)."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.backends.nftables import frontends
from kubeproxy.backends.nftables.frontends import plan_port
from kubeproxy.backends.nftables.table import InvalidPort, RenderContext, tokens_for
from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    IPFamily,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)

ip = ipaddress.ip_address
NAME = ServicePortName(NamespacedName("ns", "web"), "http", Protocol.TCP)


def _ctx(family: IPFamily) -> RenderContext:
    cidr = "10.0.0.0/8" if family is IPFamily.IPV4 else "fd00::/64"
    detector = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network(cidr),))
    return RenderContext.build(tokens_for(family), detector, masquerade_all=False)


def _port(family: IPFamily) -> ServicePort:
    cluster_ip = ip("172.30.0.1" if family is IPFamily.IPV4 else "fd01::1")
    return ServicePort(name=NAME, cluster_ip=cluster_ip, port=80, protocol=Protocol.TCP)


def _good(family: IPFamily, count: int) -> tuple[Endpoint, ...]:
    prefix = "10.1.0." if family is IPFamily.IPV4 else "fd00::"
    return tuple(Endpoint(ip(f"{prefix}{i + 1}"), 8080) for i in range(count))


@pytest.mark.parametrize("family", [IPFamily.IPV4, IPFamily.IPV6])
@pytest.mark.parametrize("where", ["cluster", "local", "reachable"])
@pytest.mark.parametrize(
    ("bad", "message"),
    [("other family", "is not"), ("port 0", "endpoint port 0"), ("port 70000", "70000")],
)
def test_a_bad_endpoint_among_good_ones_is_refused(
    family: IPFamily, where: str, bad: str, message: str
) -> None:
    good = _good(family, 5)
    if bad == "other family":
        culprit = Endpoint(ip("fd00::9" if family is IPFamily.IPV4 else "10.1.0.9"), 8080)
    else:
        culprit = good[0].with_port(int(bad.split()[1]))
    listed = (*good[:2], culprit, *good[2:])
    cluster = listed if where == "cluster" else good
    local = listed if where == "local" else ()
    reachable = listed if where == "reachable" else good
    eps = CategorizedEndpoints(cluster, local, reachable, True)
    with pytest.raises(InvalidPort, match=message):
        plan_port(_ctx(family), _port(family), eps)


@pytest.mark.parametrize("family", [IPFamily.IPV4, IPFamily.IPV6])
def test_good_endpoints_pass(family: IPFamily) -> None:
    good = _good(family, 5)
    plan = plan_port(_ctx(family), _port(family), CategorizedEndpoints(good, (), good, True))
    assert plan.frontends[0].endpoints == tuple(sorted(ep.key for ep in good))


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**128 - 1))
def test_address_text_is_str_of_the_address(v4: int, v6: int) -> None:
    for ip in (ipaddress.IPv4Address(v4), ipaddress.IPv6Address(v6)):
        assert frontends._address_text(ip) == str(ip)


@pytest.mark.parametrize("family", [IPFamily.IPV4, IPFamily.IPV6])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"port": 0}, "port 0 is out of range"),
        ({"port": 70000}, "port 70000 is out of range"),
        ({"node_port": 70000}, "nodePort 70000 is out of range"),
        ({"cluster_ip": "other"}, "cluster IP .* is not"),
        ({"external_ips": "other"}, "service IP .* is not"),
        ({"load_balancer_vips": "other"}, "service IP .* is not"),
        ({"load_balancer_source_ranges": "other"}, "source range .* is not"),
    ],
)
def test_a_port_the_kernel_must_not_see_is_refused(
    family: IPFamily, change: dict[str, object], message: str
) -> None:
    other = ip("fd02::5" if family is IPFamily.IPV4 else "172.31.0.5")
    fields = dict(change)
    if change.get("cluster_ip") == "other":
        fields["cluster_ip"] = other
    for key in ("external_ips", "load_balancer_vips"):
        if change.get(key) == "other":
            fields[key] = (other,)
    if change.get("load_balancer_source_ranges") == "other":
        fields["load_balancer_source_ranges"] = (ipaddress.ip_network(other),)
    port = dataclasses.replace(_port(family), **fields)  # type: ignore[arg-type]
    eps = CategorizedEndpoints(_good(family, 2), (), _good(family, 2), True)
    with pytest.raises(InvalidPort, match=message):
        plan_port(_ctx(family), port, eps)
