"""The ipvs backend's parts: set names and members, restore input, the fakes' kernel
checks, the rule text, link-local addresses, and the support check."""

from __future__ import annotations

import errno
import ipaddress

import pytest

from kubeproxy.backend import NodePortAddresses, SyncChanges
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.ipvs import IPVSBackend
from kubeproxy.backends.ipvs.fake import FakeIPSets, FakeIPVS, FakeLinks
from kubeproxy.backends.ipvs.ipset import (
    IPSetError,
    IPSetRestore,
    SetName,
    SetType,
    member_ip_port,
    member_ip_port_net,
    member_port,
    parse_save,
    set_name,
    set_specs,
)
from kubeproxy.backends.ipvs.netlink import (
    DUMMY_DEVICE,
    IPVSError,
    IPVSUnsupported,
    RealServer,
    VirtualServer,
    check_ipvs_support,
)
from kubeproxy.backends.ipvs.rules import RuleInputs, local_detector_not_local, render_rules
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import IPFamily, Protocol

ip = ipaddress.ip_address
net = ipaddress.ip_network
V4, V6 = IPFamily.IPV4, IPFamily.IPV6


def test_set_names_follow_upstream_for_both_families() -> None:
    assert set_name(SetName.CLUSTER_IP, V4) == "KUBE-CLUSTER-IP"
    assert set_name(SetName.CLUSTER_IP, V6) == "KUBE-6-CLUSTER-IP"
    assert set_name(SetName.LOAD_BALANCER_SOURCE_CIDR, V6) == "KUBE-6-LOAD-BALANCER-SOURCE-CID"
    assert set_name(SetName.NODE_PORT_LOCAL_SCTP, V6) == "KUBE-6-NODE-PORT-LOCAL-SCTP-HAS"
    specs = set_specs(V6)
    assert len(specs) == 17
    assert all(len(s.name) <= 31 for s in specs.values())
    assert specs[SetName.NODE_PORT_TCP].create_line() == (
        "create KUBE-6-NODE-PORT-TCP bitmap:port range 0-65535"
    )
    assert specs[SetName.CLUSTER_IP].create_line() == (
        "create KUBE-6-CLUSTER-IP hash:ip,port family inet6 hashsize 1024 maxelem 65536"
    )


def test_members_are_spelled_as_ipset_save_prints_them() -> None:
    assert member_ip_port(ip("fd00::0:1"), Protocol.SCTP, 9) == "fd00::1,sctp:9"
    assert member_ip_port_net(ip("1.2.3.4"), Protocol.TCP, 80, net("10.0.0.7/32")) == (
        "1.2.3.4,tcp:80,10.0.0.7"
    )
    with pytest.raises(ValueError):
        member_port(0)
    with pytest.raises(ValueError):
        member_ip_port(ip("1.2.3.4"), Protocol.TCP, 65536)


def test_restore_input_refuses_what_could_smuggle_commands() -> None:
    batch = IPSetRestore()
    with pytest.raises(IPSetError):
        batch.add("KUBE-CLUSTER-IP", "1.2.3.4,tcp:80\ndestroy X")
    with pytest.raises(IPSetError):
        batch.add("BAD NAME", "1.2.3.4")
    with pytest.raises(IPSetError):
        batch.flush("x" * 32)
    assert len(batch) == 0


def test_parse_save_reads_create_and_add_lines() -> None:
    text = (
        "create A hash:ip,port family inet hashsize 1024 maxelem 65536 bucketsize 12 "
        "initval 0x1\nadd A 1.2.3.4,tcp:80\ncreate B bitmap:port range 0-65535\nadd B 30080\n"
    )
    sets = parse_save(text)
    assert {k: (v.type, v.members) for k, v in sets.items()} == {
        "A": ("hash:ip,port", {"1.2.3.4,tcp:80"}),
        "B": ("bitmap:port", {"30080"}),
    }


def test_fake_ipsets_check_members_and_apply_lines_up_to_the_bad_one() -> None:
    fake = FakeIPSets()
    batch = IPSetRestore()
    batch.create(set_specs(V4)[SetName.CLUSTER_IP])
    batch.add("KUBE-CLUSTER-IP", "1.2.3.4,tcp:80")
    batch.add("KUBE-CLUSTER-IP", "fd00::1,tcp:80")  # wrong family
    batch.add("KUBE-CLUSTER-IP", "1.2.3.5,tcp:81")
    with pytest.raises(IPSetError, match="line 3"):
        fake.restore(batch)
    assert fake.members("KUBE-CLUSTER-IP") == {"1.2.3.4,tcp:80"}
    other = IPSetRestore()
    other.lines.append("create KUBE-CLUSTER-IP hash:ip family inet")
    with pytest.raises(IPSetError, match="another type"):
        fake.restore(other)
    missing = IPSetRestore()
    missing.destroy("NOPE")
    with pytest.raises(IPSetError, match="does not exist"):
        fake.restore(missing)


def test_fake_ipvs_refuses_what_the_kernel_refuses() -> None:
    fake = FakeIPVS()
    vs = VirtualServer(ip("10.0.0.1"), Protocol.TCP, 80)
    fake.add_virtual_server(vs)
    with pytest.raises(IPVSError) as exists:
        fake.add_virtual_server(vs)
    assert exists.value.errno == errno.EEXIST
    with pytest.raises(IPVSError):
        fake.add_real_server(
            VirtualServer(ip("10.0.0.2"), Protocol.TCP, 80), RealServer(vs.address, 1)
        )
    with pytest.raises(IPVSError):
        fake.add_real_server(vs, RealServer(ip("fd00::1"), 80))
    with pytest.raises(IPVSError):
        fake.add_virtual_server(VirtualServer(ip("10.0.0.3"), Protocol.TCP, 80, "nosuch"))
    with pytest.raises(IPVSUnsupported, match="kernel lacks IP_VS"):
        FakeIPVS(supported=False).virtual_servers()


def test_support_check_probes_the_scheduler_and_cleans_up() -> None:
    fake = FakeIPVS()
    check_ipvs_support(fake, "rr")
    assert fake.operations == [
        "add vs 198.51.100.0:20000/TCP rr flags=0x0 timeout=0",
        "del vs 198.51.100.0:20000/TCP",
    ]
    assert fake.services == {}
    with pytest.raises(IPVSUnsupported, match="scheduler 'xyz'"):
        check_ipvs_support(fake, "xyz")
    with pytest.raises(IPVSUnsupported, match="kernel lacks IP_VS"):
        check_ipvs_support(FakeIPVS(supported=False), "rr")


def test_local_detector_matches() -> None:
    assert local_detector_not_local(LocalDetector(), V4) == ""
    cidr = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (net("10.0.0.0/8"),))
    assert local_detector_not_local(cidr, V4) == "! -s 10.0.0.0/8"
    bridge = LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="cbr0")
    assert local_detector_not_local(bridge, V4) == "! -i cbr0"
    prefix = LocalDetector(LocalDetectMode.INTERFACE_NAME_PREFIX, interface="veth")
    assert local_detector_not_local(prefix, V4) == "! -i veth+"
    with pytest.raises(ValueError):
        local_detector_not_local(
            LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="a b -j ACCEPT"), V4
        )


def test_rules_without_services_are_upstreams_fixed_rules() -> None:
    text = render_rules(RuleInputs(V4, set_specs(V4), frozenset(), masquerade_mark=0x4000)).render()
    rules = [line for line in text.splitlines() if line.startswith("-A")]
    assert rules == [
        "-A KUBE-SOURCE-RANGES-FIREWALL -j DROP",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" '
        "-m mark --mark 0x4000/0x4000 -j ACCEPT",
        '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" '
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        '-A KUBE-NODE-PORT -m comment --comment "Kubernetes health check node port" '
        "-m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j ACCEPT",
        "-A KUBE-IPVS-FILTER -m set --match-set KUBE-LOAD-BALANCER dst,dst -j RETURN",
        "-A KUBE-IPVS-FILTER -m set --match-set KUBE-CLUSTER-IP dst,dst -j RETURN",
        "-A KUBE-IPVS-FILTER -m set --match-set KUBE-EXTERNAL-IP dst,dst -j RETURN",
        "-A KUBE-IPVS-FILTER -m set --match-set KUBE-EXTERNAL-IP-LOCAL dst,dst -j RETURN",
        "-A KUBE-IPVS-FILTER -m set --match-set KUBE-HEALTH-CHECK-NODE-PORT dst -j RETURN",
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW "
        "-m set --match-set KUBE-IPVS-IPS dst -j REJECT",
        "-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN",
        "-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT",
        "-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" '
        "-j MASQUERADE --random-fully",
        "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
    ]
    assert text.count(" - [0:0]") == 11


def test_link_local_addresses_on_the_link_are_left_alone() -> None:
    links = FakeLinks()
    links.ensure_link(DUMMY_DEVICE)
    links.links[DUMMY_DEVICE].add(ip("fe80::1"))
    links.links[DUMMY_DEVICE].add(ip("fd00:30::99"))
    backend = IPVSBackend(
        V6,
        ProxierConfig(node_name="n"),
        ipvs=FakeIPVS(),
        links=links,
        ipsets=FakeIPSets(),
        iptables=FakeIptables(),
    )
    from kubeproxy.backend import ProxySnapshot
    from kubeproxy.objects import NodeInfo

    snapshot = ProxySnapshot(
        V6, NodeInfo("n"), {}, {}, {}, node_port_addresses=NodePortAddresses(match_all=True)
    )
    backend.sync(snapshot, SyncChanges(full=True))
    assert links.links[DUMMY_DEVICE] == {ip("fe80::1")}


def test_dummy_link_missing_in_the_kernel_fails_the_sync() -> None:
    from kubeproxy.backend import ProxySnapshot, SyncError
    from kubeproxy.objects import NodeInfo

    backend = IPVSBackend(
        V4,
        ProxierConfig(node_name="n"),
        ipvs=FakeIPVS(),
        links=FakeLinks(dummy_supported=False),
        ipsets=FakeIPSets(),
        iptables=FakeIptables(),
    )
    with pytest.raises(SyncError, match="not supported"):
        backend.sync(ProxySnapshot(V4, NodeInfo("n"), {}, {}, {}), SyncChanges(full=True))


def test_set_types_cover_upstreams() -> None:
    kinds = {spec.type for spec in set_specs(V4).values()}
    assert kinds == set(SetType)


def _round_trip(attrs: list[tuple[str, object]], cmd: int) -> object:
    from pyroute2.netlink.generic import ipvs as genl

    msg = genl.ipvsmsg()
    msg["cmd"] = cmd
    msg["version"] = genl.GENL_VERSION
    msg["attrs"] = attrs
    msg.encode()
    decoded = genl.ipvsmsg(msg.data)
    decoded.decode()
    return decoded


@pytest.mark.parametrize(
    "vs",
    [
        VirtualServer(ip("10.96.0.1"), Protocol.TCP, 80, "rr", 0x1, 300),
        VirtualServer(ip("fd00::1"), Protocol.SCTP, 9, "mh", 0x10, 0),
    ],
)
def test_pyroute2_messages_encode_and_decode_to_the_same_servers(vs: VirtualServer) -> None:
    from pyroute2.netlink.generic import ipvs as genl

    from kubeproxy.backends.ipvs.netlink import (
        FORWARD_MASQUERADE,
        dest_message,
        parse_dest,
        parse_service,
        service_message,
    )

    decoded = _round_trip(
        [("IPVS_CMD_ATTR_SERVICE", service_message(vs).dump_nla())], genl.IPVS_CMD_NEW_SERVICE
    )
    attrs = dict(decoded.get("IPVS_CMD_ATTR_SERVICE")["attrs"])  # type: ignore[attr-defined]
    assert parse_service(attrs) == vs
    # The kernel wants a host-length netmask (for IPv6 the raw u32 128 on this host).
    assert attrs["IPVS_SVC_ATTR_NETMASK"] == (
        "255.255.255.255" if vs.address.version == 4 else "128.0.0.0"
    )
    rs = RealServer(ip("10.1.0.1") if vs.address.version == 4 else ip("fd00:1::1"), 8080, 0)
    decoded = _round_trip(
        [
            ("IPVS_CMD_ATTR_SERVICE", service_message(vs).dump_key()),
            ("IPVS_CMD_ATTR_DEST", dest_message(rs).dump_nla()),
        ],
        genl.IPVS_CMD_NEW_DEST,
    )
    dest = dict(decoded.get("IPVS_CMD_ATTR_DEST")["attrs"])  # type: ignore[attr-defined]
    assert parse_dest(dest) == rs
    assert dest["IPVS_DEST_ATTR_FWD_METHOD"] == FORWARD_MASQUERADE


def test_timeout_config_message_encodes_u32s() -> None:
    import struct

    from kubeproxy.backends.ipvs.netlink import config_message

    msg = config_message(900, 120, 30)
    msg.encode()
    # genlmsg header (16 + 4 bytes), then three 8-byte u32 attributes (types 4, 5, 6).
    body = msg.data[20:]
    assert [struct.unpack_from("=HHI", body, 8 * i) for i in range(3)] == [
        (8, 4, 900),
        (8, 5, 120),
        (8, 6, 30),
    ]


def test_fwmark_services_are_not_parsed_as_ours() -> None:
    from kubeproxy.backends.ipvs.netlink import parse_service

    assert parse_service({"IPVS_SVC_ATTR_FWMARK": 5, "IPVS_SVC_ATTR_PROTOCOL": 0}) is None


def test_backend_satisfies_the_backend_contract() -> None:
    from kubeproxy.backend import Backend

    backend = IPVSBackend(
        V6,
        ProxierConfig(node_name="n"),
        ipvs=FakeIPVS(),
        links=FakeLinks(),
        ipsets=FakeIPSets(),
        iptables=FakeIptables(),
    )
    assert isinstance(backend, Backend)
    assert backend.family is V6
