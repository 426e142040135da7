"""The ipvs backend's kernel-facing parts in network namespaces (``kpxv-<pid>-<n>``).

This kernel has no IP_VS and no dummy links, so:

* the ipset executor and the iptables rules run for real: the backend with a fake IPVS
  but the real ``ipset`` and iptables executors and a real link (a bridge named
  ``kube-ipvs0``, since dummy links cannot be made here); ``ipset save``,
  ``iptables-save`` and ``ip addr`` in the namespace show what is expected;
* a rule the kernel refuses (``-m ipvs``, absent without IP_VS) fails the sync and leaves
  the previous rules in place;
* ``cleanup`` removes it all and leaves a foreign ipset and a foreign chain alone;
* ``create_backend`` warns and says ``kernel lacks IP_VS``, and a flow-case run with the
  ipvs backend is reported as skipped for that reason.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import kubeproxy.backends.ipvs as ipvs_package
from kubeproxy.backend import NodePortAddresses, SyncChanges, SyncError
from kubeproxy.backends.iptables.exec import IptablesCommands, IptablesVariant
from kubeproxy.backends.ipvs import DEPRECATION_MESSAGE, IPVSBackend, cleanup, create_backend
from kubeproxy.backends.ipvs.fake import FakeIPSets, FakeIPVS
from kubeproxy.backends.ipvs.ipset import (
    IPSetCommands,
    IPSetRestore,
    SetName,
    member_ip,
    member_ip_port,
    member_ip_port_ip,
    member_ip_port_net,
    member_port,
    set_specs,
)
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    IPVSUnsupported,
    PyrouteIPVS,
    PyrouteLinks,
    ipvs_in_kernel,
)
from kubeproxy.config import ProxierConfig
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPFamily, Protocol
from kubeproxy.testing.cases import load_case_file
from kubeproxy.testing.pytest import KnownFailure, flow_test
from kubeproxy.testing.runner import RunOptions, Status, run_case
from tests.snapshots import NODE, ep
from tests.test_ipvs_proxier import Kit, World, cluster_ip

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.kernel


# Every flow with the ipvs backend. Without IP_VS each item is skipped, saying the kernel
# lacks it (the factory's support check; CI accepts exactly such skips); with IP_VS (make
# test-kernels) the flows run, and those where upstream's ipvs mode differs must fail as
# backends/ipvs/differences.yaml says.
def known_differences(
    path: Path = REPO / "kubeproxy/backends/ipvs/differences.yaml",
) -> dict[str, KnownFailure]:
    """Flow id -> how the ipvs backend fails it, as upstream's ipvs mode would."""
    known: dict[str, KnownFailure] = {}
    for entry in yaml.safe_load(path.read_text()):
        reason = f"upstream ipvs: {entry['why']} ({' '.join(entry['upstream'].split())})"
        for flow in entry["flows"]:
            assert flow not in known, f"{flow} listed twice"
            known[flow] = KnownFailure(entry["fails with"], reason)
    return known


test_flow_cases = flow_test(
    ["flowcases/examples/*.yaml", "flowcases/behaviour/*.yaml"],
    backend="kubeproxy.backends.ipvs:create_backend",
    base=REPO,
    marks=[pytest.mark.kernel],
    known_failures=known_differences(),
)

ip = ipaddress.ip_address
net = ipaddress.ip_network
V4, V6 = IPFamily.IPV4, IPFamily.IPV6
_counter = itertools.count()


def run(*argv: str, stdin: str | None = None) -> str:
    return subprocess.run(
        list(argv), input=stdin, check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpxv-{os.getpid()}-{next(_counter)}"
    run("ip", "netns", "add", name)
    try:
        run("ip", "-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def in_ns(netns: str, *argv: str) -> str:
    return run("ip", "netns", "exec", netns, *argv)


def test_ipset_executor_writes_and_reads_back_what_the_fake_holds(netns: str) -> None:
    real, fake = IPSetCommands(netns=netns), FakeIPSets()
    batch = IPSetRestore()
    members = {
        SetName.IPVS_IPS: [member_ip(ip("10.96.0.1"))],
        SetName.CLUSTER_IP: [member_ip_port(ip("10.96.0.1"), Protocol.TCP, 80)],
        SetName.LOOP_BACK: [member_ip_port_ip(ip("10.1.0.1"), Protocol.SCTP, 9, ip("10.1.0.1"))],
        SetName.LOAD_BALANCER_SOURCE_CIDR: [
            member_ip_port_net(ip("1.2.3.4"), Protocol.UDP, 53, net("10.0.0.0/8")),
            member_ip_port_net(ip("1.2.3.4"), Protocol.UDP, 53, net("10.9.9.9/32")),
        ],
        SetName.NODE_PORT_TCP: [member_port(30080), member_port(32767)],
    }
    v6_members = {
        SetName.CLUSTER_IP: [member_ip_port(ip("fd00::a"), Protocol.TCP, 443)],
        SetName.LOAD_BALANCER_SOURCE_CIDR: [
            member_ip_port_net(ip("fd00::1"), Protocol.TCP, 80, net("fd00:1::/64"))
        ],
    }
    for family, wanted in ((V4, members), (V6, v6_members)):
        specs = set_specs(family)
        for spec in specs.values():
            batch.create(spec)
        for key, entries in wanted.items():
            for entry in entries:
                batch.add(specs[key].name, entry)
    batch.create(set_specs(V4)[SetName.CLUSTER_IP])  # again: -exist keeps it
    real.restore(batch)
    fake.restore(batch)
    assert {k: v.members for k, v in real.save().items()} == {
        k: v.members for k, v in fake.save().items()
    }
    assert real.save(["KUBE-6-LOAD-BALANCER-SOURCE-CID"])[
        "KUBE-6-LOAD-BALANCER-SOURCE-CID"
    ].members == {"fd00::1,tcp:80,fd00:1::/64"}

    second = IPSetRestore()
    second.delete("KUBE-NODE-PORT-TCP", "30080")
    second.delete("KUBE-NODE-PORT-TCP", "30081")  # absent: fine with -exist
    second.swap("KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP")
    second.flush("KUBE-LOOP-BACK")
    second.destroy("KUBE-6-IPVS-IPS")
    real.restore(second)
    fake.restore(second)
    saved = real.save()
    assert {k: v.members for k, v in saved.items()} == {
        k: v.members for k, v in fake.save().items()
    }
    assert saved["KUBE-EXTERNAL-IP"].members == {"10.96.0.1,tcp:80"}
    assert saved["KUBE-NODE-PORT-TCP"].members == {"32767"}
    assert "KUBE-6-IPVS-IPS" not in saved


def _kernel_backend(netns: str, family: IPFamily = V4) -> tuple[IPVSBackend, FakeIPVS]:
    fake_ipvs = FakeIPVS()
    backend = IPVSBackend(
        family,
        ProxierConfig(node_name=NODE),
        ipvs=fake_ipvs,
        links=PyrouteLinks(netns=netns, kind="bridge"),
        ipsets=IPSetCommands(netns=netns),
        iptables=IptablesCommands(IptablesVariant.NFT, netns=netns),
    )
    return backend, fake_ipvs


def _world() -> World:
    world = World()
    world.add(
        cluster_ip(
            "web",
            "172.30.0.10",
            node_port=30080,
            external_ips=(ip("203.0.113.5"),),
            load_balancer_vips=(ip("198.51.100.7"),),
            load_balancer_source_ranges=(net("192.168.0.0/24"),),
        ),
        ep("10.180.0.2", local=True),
        ep("10.180.1.3"),
    )
    world.add(cluster_ip("dns", "172.30.0.53", 53, proto=Protocol.UDP), ep("10.180.0.9", 53))
    return world


def test_backend_programs_real_ipsets_iptables_and_addresses_then_cleans_up(netns: str) -> None:
    in_ns(netns, "ipset", "create", "FOREIGN", "hash:ip")
    in_ns(netns, "iptables", "-N", "FOREIGN-CHAIN")
    in_ns(netns, "iptables", "-A", "INPUT", "-j", "FOREIGN-CHAIN")
    backend, fake_ipvs = _kernel_backend(netns)
    world = _world()
    backend.sync(world.snapshot(), SyncChanges(full=True))

    saved = IPSetCommands(netns=netns).save()
    assert saved["KUBE-CLUSTER-IP"].members == {"172.30.0.10,tcp:80", "172.30.0.53,udp:53"}
    assert saved["KUBE-EXTERNAL-IP"].members == {"203.0.113.5,tcp:80"}
    assert saved["KUBE-LOAD-BALANCER-SOURCE-IP"].members == {"198.51.100.7,tcp:80,198.51.100.7"}
    assert saved["KUBE-NODE-PORT-TCP"].members == {"30080"}
    assert saved["KUBE-LOOP-BACK"].members == {"10.180.0.2,tcp:8080,10.180.0.2"}
    assert saved["KUBE-IPVS-IPS"].members == {
        "172.30.0.10",
        "172.30.0.53",
        "198.51.100.7",
        "203.0.113.5",
    }
    nat = in_ns(netns, "iptables-save", "-t", "nat")
    for line in (
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING',
        "-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN",
        "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
        "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT",
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
    ):
        assert line in nat.splitlines(), line
    assert "--match-set KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ" in nat
    assert "--match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE" in nat
    filt = in_ns(netns, "iptables-save", "-t", "filter")
    assert (
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set KUBE-IPVS-IPS dst "
        "-j REJECT --reject-with icmp-port-unreachable" in filt.splitlines()
    )
    assert "--match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL" in filt
    # The kernel holds exactly what the unit tests see in FakeIptables.
    kit = Kit()
    kit.iptables.restore(V4, "*filter\n:FOREIGN-CHAIN - [0:0]\n-A INPUT -j FOREIGN-CHAIN\nCOMMIT\n")
    kit.backend().sync(world.snapshot(), SyncChanges(full=True))
    for table, real in (("nat", nat), ("filter", filt)):
        expected = kit.iptables.dump(V4, table)
        assert [x for x in real.splitlines() if not x.startswith("#")] == expected.splitlines()
    bound = in_ns(netns, "ip", "-o", "addr", "show", "dev", DUMMY_DEVICE)
    assert {w for w in bound.split() if w.count(".") == 3 and "/" in w} == {
        "172.30.0.10/32",
        "172.30.0.53/32",
        "198.51.100.7/32",
        "203.0.113.5/32",
    }
    assert len(fake_ipvs.services) == 5

    # An incremental sync removing a Service removes its members and address.
    dns = next(n for n in world.services if n.service.name == "dns")
    world.remove(dns)
    backend.sync(
        world.snapshot(), SyncChanges(full=False, changed_services=frozenset({dns.service}))
    )
    saved = IPSetCommands(netns=netns).save()
    assert saved["KUBE-CLUSTER-IP"].members == {"172.30.0.10,tcp:80"}
    assert "172.30.0.53/32" not in in_ns(netns, "ip", "-o", "addr", "show", "dev", DUMMY_DEVICE)

    cleanup(netns)
    assert set(IPSetCommands(netns=netns).save()) == {"FOREIGN"}
    everything = in_ns(netns, "iptables-save")
    assert "KUBE-" not in everything
    assert "-A INPUT -j FOREIGN-CHAIN" in everything.splitlines()
    assert DUMMY_DEVICE not in in_ns(netns, "ip", "-o", "link")


def test_rule_the_kernel_refuses_keeps_the_previous_rules(netns: str) -> None:
    backend, _ = _kernel_backend(netns)
    world = _world()
    backend.sync(world.snapshot(), SyncChanges(full=True))
    before = in_ns(netns, "iptables-save", "-t", "filter")
    # Source ranges without the node's address: KUBE-IPVS-OUT-FILTER needs `-m ipvs`,
    # which a kernel without IP_VS lacks, so iptables-restore fails there; a kernel with
    # IP_VS (make test-kernels) takes the rule.
    name = world.add(
        cluster_ip(
            "closed",
            "172.30.0.20",
            load_balancer_vips=(ip("198.51.100.20"),),
            load_balancer_source_ranges=(net("203.0.113.0/24"),),
        ),
        ep("10.180.0.5"),
    )
    changes = SyncChanges(full=False, changed_services=frozenset({name.service}))
    if _has_ipvs(netns):
        backend.sync(world.snapshot(), changes)
        after = in_ns(netns, "iptables-save", "-t", "filter")
        assert (
            "-A KUBE-IPVS-OUT-FILTER -s 198.51.100.20/32 -m ipvs --vproto 6"
            " --vaddr 198.51.100.20 --vport 80 -j DROP"
        ) in after.splitlines(), after
        return
    with pytest.raises(SyncError, match="ipvs"):
        backend.sync(world.snapshot(), changes)
    after = in_ns(netns, "iptables-save", "-t", "filter")
    strip = [x for x in before.splitlines() if not x.startswith("#")]
    assert [x for x in after.splitlines() if not x.startswith("#")] == strip


def _has_ipvs(netns: str) -> bool:
    return run_in_netns(netns, ipvs_in_kernel)


def test_real_executors_on_a_kernel_without_ipvs(
    netns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _has_ipvs(netns):
        # make test-kernels: the kernel has IP_VS and dummy links (tests/test_ipvs_real.py
        # drives them); here only that the same calls work.
        assert PyrouteIPVS(netns=netns).virtual_servers() == []
        assert PyrouteLinks(netns=netns).ensure_link(DUMMY_DEVICE)
        cleanup(netns)
        assert DUMMY_DEVICE not in in_ns(netns, "ip", "-o", "link")
        return
    with pytest.raises(IPVSUnsupported, match="kernel lacks IP_VS"):
        PyrouteIPVS(netns=netns).virtual_servers()
    monkeypatch.setattr(ipvs_package, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(IPVSUnsupported, match="kernel lacks IP_VS"):
            create_backend(V4, ProxierConfig(node_name=NODE), netns=netns)
        with pytest.raises(IPVSUnsupported):
            create_backend(V6, ProxierConfig(node_name=NODE), netns=netns)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == [DEPRECATION_MESSAGE]
    # Dummy links are missing too; cleanup copes with both.
    with pytest.raises(Exception, match="not supported"):
        PyrouteLinks(netns=netns).ensure_link(DUMMY_DEVICE)
    cleanup(netns)


def run_in_netns_free_ipvs() -> bool:
    """Whether the kernel has IP_VS, asked in a namespace made for the question."""
    name = f"kpxv-{os.getpid()}-{next(_counter)}"
    run("ip", "netns", "add", name)
    try:
        return _has_ipvs(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def test_flow_case_with_the_ipvs_backend_is_skipped_because_the_kernel_lacks_ip_vs() -> None:
    case_file = load_case_file(REPO / "flowcases/examples/clusterip-basics.yaml")
    results = [
        result
        for case in case_file.cases[:1]
        for result in run_case(
            case_file,
            case,
            "kubeproxy.backends.ipvs:create_backend",
            RunOptions(run_id=f"v{os.getpid() % 100000}"),
        )
    ]
    assert results
    if run_in_netns_free_ipvs():
        # make test-kernels: with IP_VS the case runs (what its flows must show is
        # test_flow_cases' business, with the known differences listed there).
        assert Status.SKIP not in [r.status for r in results], [r.line() for r in results]
        assert Status.PASS in [r.status for r in results]
        return
    for result in results:
        assert result.status is Status.SKIP, result.line()
        assert "kernel lacks IP_VS" in result.detail, result.line()


def test_ipv6_sets_and_rules_in_a_namespace(netns: str) -> None:
    world = World(family=V6)
    world.node_port_addresses = NodePortAddresses(match_all=True)
    world.add(cluster_ip("web", "fd00:30::10", node_port=30080), ep("fd00:180::2", local=True))
    backend, _ = _kernel_backend(netns, V6)
    backend.sync(world.snapshot(), SyncChanges(full=True))
    saved = IPSetCommands(netns=netns).save()
    assert saved["KUBE-6-CLUSTER-IP"].members == {"fd00:30::10,tcp:80"}
    assert saved["KUBE-6-NODE-PORT-TCP"].members == {"30080"}
    nat6 = in_ns(netns, "ip6tables-save", "-t", "nat")
    assert "-A KUBE-SERVICES -s ::1/128 -j RETURN" in nat6.splitlines()
    assert "--match-set KUBE-6-LOOP-BACK dst,dst,src -j MASQUERADE" in nat6
    assert "fd00:30::10/128" in in_ns(netns, "ip", "-o", "addr", "show", "dev", DUMMY_DEVICE)
    cleanup(netns)
    assert IPSetCommands(netns=netns).save() == {}
    assert "KUBE-" not in in_ns(netns, "ip6tables-save")
