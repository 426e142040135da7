"""The nftables backend against the real kernel, in network namespaces we create.

* every example and behaviour flow case, with real packets (the flow-case runner);
* a restart: a second backend doing a full sync over the table the first left keeps an
  established connection through a ClusterIP alive, and new connections work throughout;
* a foreign table with base chains at our hooks stays byte for byte unchanged through
  syncs and cleanup, and cleanup removes only our tables;
* a transaction the kernel refuses leaves the previous rules in place.

Namespaces are named ``kpxr-<pid>-<role>`` and deleted whatever happens.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeproxy.backend import Backend, ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.nftables import NftablesBackend, cleanup, create_backend
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.inspect import served_frontends, slots_of
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.owner import OwnedNftables
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
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
from kubeproxy.testing.pytest import flow_test
from kubeproxy.testing.runner import RunOptions
from tests import chain_ruleset
from tests.kernelkit import (
    Topology,
    assert_restart_keeps_connections,
    client_node_server,
    echo_port_name,
    echo_snapshot,
    nft_listing_reloads,
    run_in,
)

REPO = Path(__file__).resolve().parent.parent
CONFIG = ProxierConfig(node_name="kpxr-node")

pytestmark = pytest.mark.kernel

_BYTEORDER = re.compile(r"\[ byteorder reg \d+ = \w+\(reg \d+, (\d+), (\d+)\) \]")


def no_partial_byteorder(netns: str) -> str | None:
    """None unless the kernel holds a byte-order conversion whose length is not its size.

    nft before 1.1.0 writes one (``hton(reg, 2, 1)``) for a one-byte host-order field in
    an interval concatenation, and kernels with "netfilter: nft_byteorder: remove
    multi-register support" (Debian's 6.12.117) refuse it (issue 612). Kernels without
    that change keep it as written, so this catches such a rule on any kernel.
    """
    listed = run_in(netns, "nft", "--debug=netlink", "list", "ruleset")
    if "[ payload load" not in listed:
        return "nft --debug=netlink listed no expressions"
    bad = sorted({m.group(0) for m in _BYTEORDER.finditer(listed) if m.group(1) != m.group(2)})
    return f"byte-order conversions newer kernels refuse: {bad}" if bad else None


def node_checks(netns: str) -> str | None:
    """What every state a flow case reaches must pass: the ruleset lists as one nft loads
    again (an operator's "nft list ruleset > saved; nft -f saved" must work), and holds
    nothing a kernel of the matrix refuses (:func:`no_partial_byteorder`)."""
    return nft_listing_reloads(netns) or no_partial_byteorder(netns)


test_flow_cases = flow_test(
    ["flowcases/examples/*.yaml", "flowcases/behaviour/*.yaml", "flowcases/nftables/*.yaml"],
    backend="nftables",
    options=RunOptions(node_check=node_checks),
    base=REPO,
    marks=[pytest.mark.kernel],
)

PRECREATED_COUNTS = 8
"""The bound of the precreated classes' flow cases: above every count the cases reach."""


def precreated_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> Backend:
    """The shipped backend with the classes of endpoint counts 1-8 precreated (issue 32,
    off by default): the cases' new counts are then element changes, over a class tree of
    a few hundred classes whose numbers have up to 8 bits set."""
    return create_backend(family, config, netns=netns, precreate_counts=PRECREATED_COUNTS)


test_flow_cases_precreated = flow_test(
    [
        "flowcases/examples/*.yaml",
        "flowcases/behaviour/many-endpoints.yaml",
        "flowcases/behaviour/loadbalancer.yaml",
        "flowcases/behaviour/traffic-policy.yaml",
        "flowcases/behaviour/affinity.yaml",
    ],
    backend=precreated_backend,
    options=RunOptions(node_check=node_checks),
    base=REPO,
    marks=[pytest.mark.kernel],
)


# Namespaces and snapshots ----------------------------------------------------------------

PREFIX = "kpxr"
TARGET = echo_port_name(PREFIX)


def nft_in(netns: str, *args: str, stdin: str | None = None) -> str:
    return run_in(netns, "nft", *args, stdin=stdin)


@pytest.fixture
def topology() -> Iterator[Topology]:
    with client_node_server(PREFIX) as topo:
        yield topo


def snapshot(extra: int, offset: int = 0) -> ProxySnapshot:
    """The echo Service (172.30.0.10:80 -> 10.180.0.10:8080) plus ``extra`` others."""
    return echo_snapshot(PREFIX, extra, offset)


def full() -> SyncChanges:
    return SyncChanges(full=True)


# Restart ---------------------------------------------------------------------------------


def test_restart_keeps_connections_and_serves_new_ones(topology: Topology) -> None:
    first = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
    first.sync(snapshot(300), full())

    def restart() -> None:
        # A new process: the same table (the old process gone: an owned table orphaned,
        # and adopted by the new one), now with thousands more Services to add (several
        # transactions), and the fixed chains rewritten.
        close = getattr(first.executor, "close", None)
        if close is not None:
            close()
        second = create_backend(IPFamily.IPV4, CONFIG, netns=topology.node)
        second.sync(snapshot(4000), full())
        assert second.last_transactions >= 2

    assert_restart_keeps_connections(topology, restart)


def test_upgrade_from_per_service_chains_keeps_connections(topology: Topology) -> None:
    """An upgrade in place: the per-Service-chain structure's table (recorded, with the
    echo Service: tests/chain_ruleset.py), then this version."""
    assert chain_ruleset.PREFIX == PREFIX
    nft_in(topology.node, "-f", "-", stdin=chain_ruleset.recorded())
    assert "service-ips" in nft_in(topology.node, "list", "table", "ip", "kube-proxy")
    clock = [100.0]
    new = NftablesBackend(
        IPFamily.IPV4, CONFIG, executor=LibNftables(topology.node), clock=lambda: clock[0]
    )

    def upgrade() -> None:
        new.sync(snapshot(2000), full())
        assert new.last_transactions >= 2

    assert_restart_keeps_connections(topology, upgrade)
    # A second later what the old structure left is deleted, and the Service still works.
    clock[0] += 1.0
    new.sync(snapshot(2000), SyncChanges(full=False))
    assert new.stale_chain_failures == 0
    listing = nft_in(topology.node, "list", "table", "ip", "kube-proxy")
    chains = [
        line.split()[1] for line in listing.splitlines() if line.lstrip().startswith("chain ")
    ]
    assert "service-ips" not in listing
    assert chains and not [c for c in chains if "/" in c]  # per-Service chains all have a '/'

    assert_restart_keeps_connections(topology, lambda: new.sync(snapshot(2000), full()))


# Foreign tables and cleanup --------------------------------------------------------------

FOREIGN = """
table inet kpxr-foreign {
    set blocked { type ipv4_addr ; elements = { 192.0.2.1, 192.0.2.2 } ; }
    set ports { type inet_service ; flags interval ; elements = { 1000-2000, 8080 } ; }
    map marks { type ipv4_addr : mark ; elements = { 192.0.2.3 : 0x1 } ; }
    chain pre { type nat hook prerouting priority -100 ; policy accept ; ip saddr @blocked return ; }
    chain out { type nat hook output priority -100 ; policy accept ; }
    chain post { type nat hook postrouting priority 100 ; policy accept ; }
    chain forwarding { type filter hook forward priority 0 ; policy accept ; tcp dport @ports accept ; }
    chain inbound { type filter hook input priority 0 ; policy accept ; }
    chain outbound { type filter hook output priority 0 ; policy accept ; }
    chain marker { meta mark set ip saddr map @marks ; }
}
"""  # noqa: E501


def test_foreign_table_is_untouched_and_cleanup_removes_only_ours(topology: Topology) -> None:
    node = topology.node
    nft_in(node, "-f", "-", stdin=FOREIGN)
    foreign = nft_in(node, "list", "table", "inet", "kpxr-foreign")
    clock = [100.0]
    v4 = NftablesBackend(IPFamily.IPV4, CONFIG, executor=LibNftables(node), clock=lambda: clock[0])
    v4.sync(snapshot(50), full())
    v4.sync(snapshot(50, offset=20), SyncChanges(full=False, changed_services=_bulk(0, 70)))
    clock[0] += 2
    v4.sync(snapshot(50, offset=20), SyncChanges(full=False))  # stale chains deleted
    v4.sync(snapshot(50, offset=20), full())
    v6 = create_backend(IPFamily.IPV6, CONFIG, netns=node)
    v6.sync(_v6_snapshot(), full())
    tables = nft_in(node, "list", "tables")
    assert "table ip kube-proxy" in tables and "table ip6 kube-proxy" in tables
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign

    if isinstance(v6.executor, OwnedNftables):
        # --cleanup while a proxy runs (and owns its table): refused, saying who owns it.
        with pytest.raises(NftError, match=r"table ip6 kube-proxy belongs to a running proxy"):
            cleanup(netns=node)
        v6.executor.close()  # the proxy ends: its table is orphaned
    cleanup(netns=node)
    tables = nft_in(node, "list", "tables")
    assert "kube-proxy" not in tables
    assert "table inet kpxr-foreign" in tables
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign
    cleanup(netns=node)  # nothing left to delete is fine
    v4.sync(snapshot(5), full())
    v4.cleanup()
    assert "kube-proxy" not in nft_in(node, "list", "tables")
    assert nft_in(node, "list", "table", "inet", "kpxr-foreign") == foreign


def _bulk(start: int, stop: int) -> frozenset[NamespacedName]:
    return frozenset(NamespacedName("bulk", f"s{i}") for i in range(start, stop))


def _v6_snapshot() -> ProxySnapshot:
    name = ServicePortName(NamespacedName("kpxr", "v6"), "", Protocol.TCP)
    eps = (Endpoint(ipaddress.ip_address("fd00:10::a1"), 8080),)
    port = ServicePort(
        name, ipaddress.ip_address("fd00:10:96::10"), 80, Protocol.TCP, session_affinity_seconds=60
    )
    return ProxySnapshot(
        IPFamily.IPV6,
        NodeInfo("kpxr-node"),
        {name: port},
        {name: eps},
        {name: CategorizedEndpoints(eps, (), eps, True)},
    )


# Refused transactions --------------------------------------------------------------------


def test_refused_transaction_leaves_the_previous_rules(topology: Topology) -> None:
    node = topology.node
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=node)
    backend.sync(snapshot(10), full())
    generation = backend.generation
    assert generation is not None
    # An element where our next incremental sync will add its own (slot 0 of bulk/s99,
    # another endpoint), put there through the backend's own executor (an owned table
    # takes no other writer): the kernel refuses the whole transaction.
    conflict = Transaction(Family.IP, "kube-proxy")
    conflict.add_element(
        f"endpoints-tcp-b2.g{generation}",
        ("172.30.16.99", "tcp", "80", "0"),
        ("192.0.2.9", "9"),
    )
    backend.executor.run(conflict)
    before = nft_in(node, "list", "table", "ip", "kube-proxy")
    grown = snapshot(100)
    with pytest.raises(SyncError, match="File exists"):
        backend.sync(grown, SyncChanges(full=False, changed_services=_bulk(10, 100)))
    assert nft_in(node, "list", "table", "ip", "kube-proxy") == before
    assert backend.sync_failures == 1

    def echo() -> bytes:
        with socket.create_connection(("172.30.0.10", 80), timeout=2) as sock:
            sock.sendall(b"still\n")
            return sock.recv(64)

    assert topology.in_namespace(topology.client, echo) == b"still\n"
    # The next sync is a full one: a new generation, written beside the damaged one.
    backend.sync(grown, SyncChanges(full=False))
    assert backend.last_sync_full
    assert backend.generation == generation + 1
    nft = LibNftables(node)
    key = ("172.30.16.99", "tcp", "80")
    assert key in served_frontends(nft, Family.IP)
    assert sorted(slots_of(nft, Family.IP, key)) == [
        ("10.181.1.140", "8080"),
        ("10.181.1.141", "8080"),
        ("10.181.1.142", "8080"),
    ]
    assert topology.in_namespace(topology.client, echo) == b"still\n"
