"""iptables chain names: upstream's hash scheme, checked names, prefixes."""

from __future__ import annotations

import pytest

from kubeproxy.backends.iptables.naming import (
    InvalidName,
    endpoint_chain,
    is_service_chain,
    port_hash,
    service_chains,
    service_port_string,
)
from kubeproxy.backends.iptables.restore import check_chain_name
from kubeproxy.objects import NamespacedName, Protocol, ServicePortName


def spn(ns: str, name: str, port: str, proto: Protocol = Protocol.TCP) -> ServicePortName:
    return ServicePortName(NamespacedName(ns, name), port, proto)


def test_upstream_verified_hashes() -> None:
    # Two chain names upstream's own tests check (pkg/proxy/iptables/proxier_test.go).
    text = service_port_string(spn("ns1", "svc1", "p80"))
    assert text == "ns1/svc1:p80"
    assert service_chains(text, "tcp")[0] == "KUBE-SVC-XPGD46QRK7WJZT7O"
    assert endpoint_chain(text, "tcp", "10.180.0.1:80") == "KUBE-SEP-SXIVWICOYRO3J4NJ"


def test_one_hash_four_prefixes() -> None:
    h = port_hash("ns1/svc1:p80", "tcp")
    assert service_chains("ns1/svc1:p80", "tcp") == (
        f"KUBE-SVC-{h}",
        f"KUBE-SVL-{h}",
        f"KUBE-EXT-{h}",
        f"KUBE-FW-{h}",
    )
    assert port_hash("ns1/svc1:p80", "udp") != h


def test_unnamed_port_and_ipv6_endpoint() -> None:
    text = service_port_string(spn("ns", "svc", ""))
    assert text == "ns/svc"
    a = endpoint_chain(text, "tcp", "[fd00::1]:80")
    b = endpoint_chain(text, "tcp", "[fd00::1]:81")
    assert a != b
    for name in (a, b, *service_chains(text, "sctp")):
        assert check_chain_name(name) == name
        assert len(name) <= 28
        assert is_service_chain(name)


@pytest.mark.parametrize(
    "name",
    [
        spn("ns", "svc", 'p"80'),
        spn("ns", "svc name", "p80"),
        spn("", "svc", "p80"),
        spn("ns", "svc", "p80\n-A INPUT -j DROP"),
        spn("n" * 64, "svc", "p80"),
        spn("ns", "-svc", "p80"),
    ],
)
def test_bad_names_are_refused(name: ServicePortName) -> None:
    with pytest.raises(InvalidName):
        service_port_string(name)


@pytest.mark.parametrize(
    ("chain", "ours"),
    [
        ("KUBE-SVC-XPGD46QRK7WJZT7O", True),
        ("KUBE-SEP-SXIVWICOYRO3J4NJ", True),
        ("KUBE-FW-XPGD46QRK7WJZT7O", True),
        ("KUBE-SERVICES", False),
        ("KUBE-FIREWALL", False),
        ("KUBE-SVCX", False),
    ],
)
def test_is_service_chain(chain: str, ours: bool) -> None:
    assert is_service_chain(chain) is ours
