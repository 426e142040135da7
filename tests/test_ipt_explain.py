"""``kubeproxy explain|verify --mode iptables`` without a kernel: a Service's frontends
read back from the iptables backend's own save (``FakeIptables``), and two saves
compared (the kernel test is test_ipt_explain_kernel.py)."""

from __future__ import annotations

import ipaddress
from dataclasses import replace

from kubeproxy.backends.iptables import IptablesBackend
from kubeproxy.backends.iptables.explain import (
    Chains,
    compare,
    counted_rules,
    explain_service,
    parse_save,
)
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePort
from tests.snapshots import Clock, World, ep, full, spn

ip = ipaddress.ip_address
V4 = IPFamily.IPV4


def _saves(world: World) -> dict[str, str]:
    fake = FakeIptables()
    backend = IptablesBackend(
        V4, ProxierConfig(node_name="test-node"), executor=fake, clock=Clock()
    )
    backend.sync(world.snapshot(), full())
    return {table: fake.save(V4, table) for table in ("nat", "filter")}


def _world() -> World:
    world = World()
    web = ServicePort(
        spn("web"),
        ip("172.30.0.10"),
        80,
        Protocol.TCP,
        node_port=30080,
        session_affinity_seconds=60,
    )
    world.add(web, ep("10.180.0.1"), ep("10.180.0.2"))
    world.add(ServicePort(spn("empty"), ip("172.30.0.11"), 80, Protocol.TCP))
    return world


def test_a_services_frontends_chains_and_endpoints_are_read_back() -> None:
    saves = _saves(_world())
    nat, filter_table = parse_save(saves["nat"]), parse_save(saves["filter"])
    found = explain_service(nat, filter_table, NamespacedName("ns", "web"))
    by_address = {fe.address: fe for fe in found}
    assert set(by_address) == {"172.30.0.10:80/tcp", "NodePort 30080/tcp"}
    cluster = by_address["172.30.0.10:80/tcp"]
    assert cluster.comment == "ns/web:http cluster IP"
    assert [chain[:9] for chain in cluster.path] == ["KUBE-SVC-"]
    assert [e for e, _p in cluster.endpoints] == ["10.180.0.1:8080", "10.180.0.2:8080"]
    assert cluster.endpoints[0][1] is not None and cluster.endpoints[1][1] is None
    assert cluster.affinity_s == 60
    nodeport = by_address["NodePort 30080/tcp"]
    assert nodeport.path[0].startswith("KUBE-EXT-") and "always" in nodeport.masquerade
    (empty,) = explain_service(nat, filter_table, NamespacedName("ns", "empty"))
    assert empty.no_endpoint == "reject" and empty.address == "172.30.0.11:80/tcp"
    assert explain_service(nat, filter_table, NamespacedName("ns", "we")) == []
    assert explain_service(nat, filter_table, NamespacedName("ns", "web"), "dns") == []


def test_two_saves_compare_chain_by_chain() -> None:
    world = _world()
    want = {t: parse_save(text) for t, text in _saves(world).items()}
    assert compare(want, want) == []
    changed = replace(world.services[spn("web")], session_affinity_seconds=0)
    world.add(changed, ep("10.180.0.1"))
    have = {t: parse_save(text) for t, text in _saves(world).items()}
    found = [str(d) for d in compare(want, have)]
    assert any(
        d.startswith("ns/web:http: nat KUBE-SVC-") and "missing rule" in d and "10.180.0.2" in d
        for d in found
    ), found
    assert any(d.startswith("ns/web:http: nat KUBE-SEP-") and ": missing" in d for d in found)
    # A chain of ours the proxy did not write, a reordered chain.
    have["nat"]["KUBE-SVC-GHOST"] = []
    svc = next(c for c in want["nat"] if c.startswith("KUBE-SVC-") and len(want["nat"][c]) > 2)
    have["nat"][svc] = list(reversed(want["nat"][svc]))
    found = [str(d) for d in compare(want, have)]
    assert "KUBE-SVC-GHOST: nat KUBE-SVC-GHOST: extra, not written by us" in found
    assert f"ns/web:http: nat {svc}: the same rules, another order" in found


def test_counters_are_not_differences() -> None:
    text = (
        "*nat\n:KUBE-NODEPORTS - [0:0]\n"
        '-A KUBE-NODEPORTS -d 127.0.0.0/8 -p tcp -m comment --comment "ns/web:http" -m tcp'
        " --dport 30080 -m nfacct --nfacct-name localhost_nps_accepted_pkts -j KUBE-EXT-X\n"
        "COMMIT\n"
    )
    have = {"nat": parse_save(text)}
    (words,) = have["nat"]["KUBE-NODEPORTS"]
    assert "nfacct" not in words
    want: dict[str, Chains] = {"nat": {"KUBE-NODEPORTS": []}}
    assert [d.what for d in compare(want, have)] == [
        "nat KUBE-NODEPORTS: extra rule -d 127.0.0.0/8 -p tcp -m comment --comment ns/web:http"
        " -m tcp --dport 30080 -j KUBE-EXT-X"
    ]
    assert compare(want, have, {"nat": counted_rules(text)}) == []
