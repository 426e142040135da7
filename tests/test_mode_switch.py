"""Switching a node between modes (nftables -> iptables -> nftables) in a network namespace.

A node namespace (``kpxm-...``) holds the node IP and routes the Service range towards a
pod namespace whose two endpoint IPs answer on port 8080. Real TCP connections from the
node to the ClusterIP show which mode is proxying; ``nft list tables`` and
``iptables-save`` (nft and legacy variants) show what each mode left behind.

The first test drives the backends and the mode cleanups the binaries use
(:data:`kubeproxy.cmd.modes.MODES`) step by step; the second runs the binaries themselves,
whose start-up removes the other kind of mode's leftovers (upstream's platformCleanup),
and ends with ``kube-proxy --cleanup`` over leftovers of every mode, as far as this kernel
can hold them (no IP_VS, no dummy links: an ipvs-mode ipset, chain and ``kube-ipvs0``
address stand in for an ipvs node), which must not fail for want of IP_VS.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kubeproxy.cmd.modes import MODES
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NodeInfo, Protocol
from kubeproxy.proxier import Proxier
from kubeproxy.testing.runner import default_timeout
from kubeproxy.testing.traffic import ListenerServer, make_listener
from tests import kernelkit
from tests.kernelkit import node_and_pod

pytestmark = pytest.mark.kernel

NODE = "demo-node"  # the node of examples/cluster
NODE_IP = "192.168.50.2"
EP1, EP2 = "10.244.0.11", "10.244.0.12"
WEB = "172.30.0.10"  # demo/web: both endpoints, port 80 -> 8080
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "cluster"
BIN = Path(sys.executable).parent
VARIANTS = (
    "iptables-nft-save",
    "ip6tables-nft-save",
    "iptables-legacy-save",
    "ip6tables-legacy-save",
)


@dataclass
class Node:
    netns: str
    fd: int


@pytest.fixture
def node() -> Iterator[Node]:
    with node_and_pod("kpxm", NODE_IP, (EP1, EP2)) as pair:
        listeners = ListenerServer("kpxm-listeners")
        try:
            for ip in (EP1, EP2):
                listeners.add(
                    make_listener(pair.pod_fd, ipaddress.ip_address(ip), 8080, Protocol.TCP)
                )
            listeners.start()
            yield Node(pair.node, pair.node_fd)
        finally:
            listeners.close()


def answered_by(node: Node, ip: str = WEB, port: int = 80) -> str | None:
    """Connect from the node namespace; the endpoint that answered (None: nobody)."""
    return kernelkit.answered_by(node.fd, ip, port)


def proxied(node: Node) -> set[str]:
    """Endpoints reached through the ClusterIP in a few connections (empty: not proxied).

    Each connection picks one of the two endpoints at random: 40 tries miss one with a
    chance of 2**-39 (12 missed one in about 2,000, and the file asks about 20 times).
    """
    seen = set()
    for _ in range(40):
        who = answered_by(node)
        if who is None:
            return set()
        seen.add(who)
        if len(seen) == 2:
            break
    return seen


def in_ns(node: Node, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``argv`` in the node namespace. A binary's run takes about a second here; under
    emulation (make test-kernels, 6.12) a ``--once`` or ``--cleanup`` took over 60 s, so
    the timeout grows with the flow kit's timeout scale."""
    return subprocess.run(
        ["ip", "netns", "exec", node.netns, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=60 * default_timeout(),
    )


def nft_tables(node: Node) -> list[str]:
    result = in_ns(node, "nft", "list", "tables")
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


# Chains kube-proxy shares with kubelet and, like upstream's cleanup, leaves in place:
# iptables mode adds its localnet DROP rule to KUBE-FIREWALL, kubelet's chain on a real
# node (a fresh namespace has no kubelet, so the proxy created it here).
SHARED_WITH_KUBELET = frozenset({"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"})


def kube_chains(node: Node) -> dict[str, list[str]]:
    """The proxy's KUBE- chains per iptables-save variant and family."""
    found = {}
    for tool in VARIANTS:
        if shutil.which(tool) is None:
            continue
        result = in_ns(node, tool)
        assert result.returncode == 0, result.stderr
        found[tool] = [
            name
            for line in result.stdout.splitlines()
            if line.startswith(":KUBE-")
            and (name := line[1:].split(" ", 1)[0]) not in SHARED_WITH_KUBELET
        ]
    return found


def no_kube_chains(node: Node) -> bool:
    return all(not chains for chains in kube_chains(node).values())


class Program:
    """The core and one mode's backend, programming the node namespace from the example
    cluster's web Service."""

    def __init__(self, mode: str, node: Node) -> None:
        backend = MODES[mode].factory()(IPFamily.IPV4, self.config(), netns=node.netns)
        self.proxier = Proxier(
            IPFamily.IPV4,
            self.config(),
            backend,
            node=NodeInfo(NODE, addresses=(ipaddress.ip_address(NODE_IP),)),
            host_addresses=lambda: [ipaddress.ip_address(NODE_IP)],
        )
        self.proxier.on_service_add(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web", "namespace": "demo"},
                "spec": {
                    "type": "ClusterIP",
                    "clusterIP": WEB,
                    "clusterIPs": [WEB],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                },
            }
        )
        self.proxier.on_endpoint_slice_add(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "web-a",
                    "namespace": "demo",
                    "labels": {"kubernetes.io/service-name": "web"},
                },
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": [ip], "conditions": {"ready": True}, "nodeName": NODE}
                    for ip in (EP1, EP2)
                ],
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            }
        )
        self.proxier.on_services_synced()
        self.proxier.on_endpoint_slices_synced()

    @staticmethod
    def config() -> ProxierConfig:
        return ProxierConfig(node_name=NODE)

    def sync(self) -> None:
        assert self.proxier.sync_now(), "the sync failed"

    def stop(self) -> None:
        """The proxy ends (an owned table is orphaned, for a cleanup or the next proxy)."""
        close = getattr(self.proxier.backend, "close", None)
        if callable(close):
            close()


ENDPOINTS = {f"{EP1}:8080", f"{EP2}:8080"}


def test_switching_nftables_iptables_nftables_with_each_modes_cleanup(node: Node) -> None:
    assert proxied(node) == set()  # nothing proxies yet

    nftables = Program("nftables", node)
    nftables.sync()
    assert proxied(node) == ENDPOINTS
    assert "table ip kube-proxy" in nft_tables(node)
    nftables.stop()
    MODES["nftables"].cleanup(node.netns)
    assert proxied(node) == set()
    assert not [t for t in nft_tables(node) if t.endswith(" kube-proxy")]

    Program("iptables", node).sync()
    assert proxied(node) == ENDPOINTS
    assert not [t for t in nft_tables(node) if t.endswith(" kube-proxy")]
    assert not no_kube_chains(node)
    MODES["iptables"].cleanup(node.netns)
    assert proxied(node) == set()
    assert no_kube_chains(node), kube_chains(node)

    Program("nftables", node).sync()
    assert proxied(node) == ENDPOINTS
    assert no_kube_chains(node), kube_chains(node)


def over_examples(prog: str, *argv: str) -> list[str]:
    """``prog`` proxying the example cluster as its node."""
    return [
        str(BIN / prog),
        "--manifests",
        str(EXAMPLES),
        "--hostname-override",
        NODE,
        "--cluster-cidr=10.244.0.0/16",
        *argv,
    ]


def binary(node: Node, prog: str, *argv: str) -> None:
    result = in_ns(node, *over_examples(prog, *argv))
    assert result.returncode == 0, result.stderr


def test_the_binaries_remove_the_other_modes_leftovers_and_cleanup_removes_all(
    node: Node,
) -> None:
    # Somebody else's rules, in both tools: they must survive every step.
    foreign = (
        "table inet kpxm-foreign {\n\tchain input {\n"
        "\t\ttype filter hook input priority 0;\n\t}\n}\n"
    )
    loaded = in_ns(node, "nft", "-f", "-", stdin=foreign)
    assert loaded.returncode == 0, loaded.stderr
    assert in_ns(node, "iptables-legacy", "-t", "filter", "-N", "KPXM-FOREIGN").returncode == 0

    binary(node, "kube-proxy-nftables", "--once")
    assert proxied(node) == ENDPOINTS
    # iptables mode starts by deleting the nftables tables (upstream's platformCleanup).
    binary(node, "kube-proxy-iptables", "--once")
    assert proxied(node) == ENDPOINTS
    assert not [t for t in nft_tables(node) if t.endswith(" kube-proxy")]
    assert not no_kube_chains(node)
    # nftables mode starts by deleting what iptables (and ipvs) mode made.
    binary(node, "kube-proxy-nftables", "--once")
    assert proxied(node) == ENDPOINTS
    assert no_kube_chains(node), kube_chains(node)

    # A legacy-variant leftover too (a node that once ran iptables-legacy kube-proxy).
    legacy = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\nCOMMIT\n"
    loaded = in_ns(node, "iptables-legacy-restore", "--noflush", stdin=legacy)
    assert loaded.returncode == 0, loaded.stderr
    # ipvs-mode leftovers this kernel can hold (it has no IP_VS and no dummy links): an
    # ipset, an ipvs-mode chain, and the addresses of a kube-ipvs0 (a bridge here).
    ipvs_leftovers = "*filter\n:KUBE-IPVS-FILTER - [0:0]\n-A KUBE-IPVS-FILTER -j RETURN\nCOMMIT\n"
    loaded = in_ns(node, "iptables-nft-restore", "--noflush", stdin=ipvs_leftovers)
    assert loaded.returncode == 0, loaded.stderr
    for argv in (
        ("ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"),
        ("ipset", "add", "KUBE-CLUSTER-IP", f"{WEB},tcp:80"),
        ("ipset", "create", "kpxm-foreign", "hash:ip"),
        ("ip", "link", "add", "kube-ipvs0", "type", "bridge"),
        ("ip", "addr", "add", f"{WEB}/32", "dev", "kube-ipvs0"),
    ):
        assert in_ns(node, *argv).returncode == 0, argv
    result = in_ns(node, str(BIN / "kube-proxy"), "--cleanup")
    assert result.returncode == 0, result.stderr
    sets = in_ns(node, "ipset", "list", "-n").stdout.split()
    assert sets == ["kpxm-foreign"]
    link = in_ns(node, "ip", "-o", "addr", "show", "dev", "kube-ipvs0")
    assert WEB not in link.stdout
    assert proxied(node) == set()
    assert no_kube_chains(node), kube_chains(node)
    assert not [t for t in nft_tables(node) if t.endswith(" kube-proxy")]
    assert "table inet kpxm-foreign" in nft_tables(node)
    saved = in_ns(node, "iptables-legacy-save", "-t", "filter").stdout
    assert ":KPXM-FOREIGN - [0:0]" in saved


def test_ipvs_mode_fails_with_one_clear_line_where_the_kernel_lacks_ip_vs(node: Node) -> None:
    binary(node, "kube-proxy-nftables", "--once")
    assert proxied(node) == ENDPOINTS
    result = in_ns(node, *over_examples("kube-proxy-ipvs", "--once"))
    if Path("/proc/net/ip_vs").exists():  # a kernel with IPVS: the mode runs
        assert result.returncode == 0, result.stderr
        assert proxied(node) == ENDPOINTS
        return
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("E")]
    assert len(errors) == 1, result.stderr
    assert "kernel lacks IP_VS" in errors[0]
    assert "deprecated" in result.stderr
    # The mode could not run, so nothing of the others was removed: still proxied.
    assert "table ip kube-proxy" in nft_tables(node)
    assert proxied(node) == ENDPOINTS


# Node safety: what a start may touch, and with which privileges -------------------------


def legacy_table_names(node: Node) -> dict[str, str]:
    """``/proc/net/ip_tables_names`` and ``ip6_tables_names`` of the node namespace."""
    return {
        name: in_ns(node, "cat", f"/proc/net/{name}").stdout
        for name in ("ip_tables_names", "ip6_tables_names")
    }


def capped(
    node: Node, capabilities: str, prog: str, *argv: str
) -> subprocess.CompletedProcess[str]:
    """``prog`` over the example cluster as root with only ``capabilities`` (setpriv's
    bounding set, e.g. ``+net_admin``), in the node namespace."""
    bounding = f"--bounding-set=-all,{capabilities}" if capabilities else "--bounding-set=-all"
    return in_ns(node, "setpriv", bounding, *over_examples(prog, *argv))


def daemonset_capabilities() -> str:
    """What the shipped DaemonSet's proxy container holds, as setpriv's bounding set."""
    manifests = Path(__file__).resolve().parent.parent / "images" / "manifests"
    daemonset = yaml.safe_load((manifests / "daemonset.yaml").read_text())
    (proxy,) = [
        c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "kube-proxy"
    ]
    return ",".join(f"+{name.lower()}" for name in proxy["securityContext"]["capabilities"]["add"])


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("W")]


@pytest.mark.parametrize("prog", ["kube-proxy-nftables", "kube-proxy-iptables"])
def test_a_start_creates_no_iptables_legacy_tables(node: Node, prog: str) -> None:
    empty = {"ip_tables_names": "", "ip6_tables_names": ""}
    assert legacy_table_names(node) == empty
    binary(node, prog, "--once")
    assert proxied(node) == ENDPOINTS
    # Neither the other modes' cleanup nor iptables mode's variant choice opened a table.
    assert legacy_table_names(node) == empty
    assert in_ns(node, "iptables-legacy-save").stdout == ""


LEGACY_LEFTOVER = (
    "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n"
    f"-A KUBE-SERVICES -d {WEB}/32 -p tcp -j DNAT --to-destination 10.244.0.99:8080\nCOMMIT\n"
)


def test_legacy_cleanup_without_net_raw_is_a_warning_naming_it(node: Node) -> None:
    loaded = in_ns(node, "iptables-legacy-restore", "--noflush", stdin=LEGACY_LEFTOVER)
    assert loaded.returncode == 0, loaded.stderr

    result = capped(node, "+net_admin", "kube-proxy-nftables", "--once")
    assert result.returncode == 0, result.stderr
    assert proxied(node) == ENDPOINTS  # the start went on
    legacy = [w for w in warnings_of(result.stderr) if "iptables-legacy" in w]
    assert legacy, result.stderr
    assert all("CAP_NET_RAW" in w for w in legacy), result.stderr
    assert any(
        "Could not remove another mode's leftovers: iptables mode: " in w
        and "permission denied" in w
        for w in legacy
    ), result.stderr
    assert "Removed what iptables mode made" not in result.stderr
    assert ":KUBE-SERVICES" in in_ns(node, "iptables-legacy-save", "-t", "nat").stdout

    # What the DaemonSet's container holds is enough.
    result = capped(node, daemonset_capabilities(), "kube-proxy-nftables", "--once")
    assert result.returncode == 0, result.stderr
    assert warnings_of(result.stderr) == [], result.stderr
    assert ":KUBE-SERVICES" not in in_ns(node, "iptables-legacy-save", "-t", "nat").stdout
    assert proxied(node) == ENDPOINTS


def test_iptables_mode_sees_legacy_rules_for_its_variant_choice(node: Node) -> None:
    hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
    assert in_ns(node, "iptables-legacy-restore", "--noflush", stdin=hint).returncode == 0
    # With the DaemonSet's capabilities the kubelet hint in legacy picks legacy.
    result = capped(node, daemonset_capabilities(), "kube-proxy-iptables", "--once")
    assert result.returncode == 0, result.stderr
    assert "KUBE-SERVICES" in in_ns(node, "iptables-legacy-save", "-t", "nat").stdout
    assert "KUBE-SERVICES" not in in_ns(node, "iptables-nft-save", "-t", "nat").stdout
    assert proxied(node) == ENDPOINTS
    # Without NET_RAW the legacy tables cannot be read: said, naming the capability.
    blind = capped(node, "+net_admin", "kube-proxy-iptables", "--once")
    variant = [w for w in warnings_of(blind.stderr) if "iptables variant is chosen" in w]
    # Once per family: both run (the kernel has IPv6), as upstream's would.
    assert len(variant) == 2 and all("CAP_NET_RAW" in w for w in variant), blind.stderr
    assert "IPv4" in variant[0] and "IPv6" in variant[1]


def test_without_net_admin_one_line_names_it_before_anything_else(node: Node) -> None:
    for argv in (("--once",), ("--cleanup",)):
        result = capped(node, "", "kube-proxy-nftables", *argv)
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if line[:1] in "EW"]
        assert len(errors) == 1, result.stderr
        assert errors[0].startswith("E") and "CAP_NET_ADMIN" in errors[0]
        assert "Operation not permitted" not in result.stderr
    assert proxied(node) == set()
