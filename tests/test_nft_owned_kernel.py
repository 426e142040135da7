"""The owned table (``kubeproxy.backends.nftables.owner``) in the kernel, with real packets.

* every state the nftables flow cases reach, written by the owned table's own encoder
  (rules, chains, sets, elements over our socket) and by nft (libnftables), in two
  namespaces: the kernel holds the same bytes (``tests/nftdump.py``: every attribute of
  every table, chain, set, element and rule expression) and ``nft list ruleset`` prints
  the same, in both families. On a kernel without ``persist`` the encoder writes the
  table with as much ownership as the kernel has (``owner`` alone, or none), so the
  encoder is proven on every kernel of the matrix;
* connections flow to a Service without a single failure while another process runs
  ``nft flush ruleset``, ``nft delete table ip kube-proxy``, ``iptables-nft-restore``
  of an empty ruleset and a firewalld-style reload, in a loop; the table is byte for
  byte what it was. Side by side, once the proxy has ended (its table orphaned), the same
  flush takes the table, as it takes today's unowned table;
* a restart adopts the orphaned table without a failed connection; an unowned table
  (today's, or an earlier version's) is replaced by an owned one in one transaction,
  without a failed connection;
* the binaries: a second proxy on the node is refused in one line naming the first;
  ``--cleanup`` is refused while the proxy runs and works once it ended; iptables mode
  started afterwards removes the orphaned tables (a mode switch).

Namespaces are named ``kpxo-...`` and deleted whatever happens.
"""

from __future__ import annotations

import difflib
import ipaddress
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.disruptions import DISRUPTIONS
from kubeproxy.backend import Backend, ProxySnapshot, SyncChanges
from kubeproxy.backends.nftables import backend_over, create_backend
from kubeproxy.backends.nftables.batchencoder import NFT_TABLE_F_OWNER
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.owner import (
    OWNER_FLAGS,
    OwnedNftables,
    TableState,
    probe_table_flags,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.featuregates import resolve
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
from kubeproxy.testing.cases import Step, load_case_file
from kubeproxy.testing.runner import default_timeout, replay_syncs
from tests.kernelkit import (
    NFTABLES_FLOW_FILES,
    Topology,
    assert_restart_keeps_connections,
    client_node_server,
    connections_flowing,
    echo_snapshot,
    lone_namespace,
    run_in,
    without_owner,
)
from tests.nftdump import dump

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parent.parent
PREFIX = "kpxo"
CONFIG = ProxierConfig(node_name="kpxo-node")
FLOW_FILES = NFTABLES_FLOW_FILES
BIN = Path(sys.executable).parent
EXAMPLES = REPO / "examples" / "cluster"


@pytest.fixture(scope="module")
def kernel_flags() -> tuple[bool, bool]:
    """Whether this kernel takes the owner and the persist table flags (probed in a
    namespace of ours)."""
    with lone_namespace(PREFIX) as ns:
        return probe_table_flags(ns.name)


@pytest.fixture
def owning(kernel_flags: tuple[bool, bool]) -> None:
    """Skips (before any namespace is made) where the table is not owned."""
    if not kernel_flags[1]:
        pytest.skip("kernel lacks the persist table flag (Linux 6.9+): the table is not owned")


# Every flow-case state, written both ways -----------------------------------------------


class _Writers:
    """Backends over new executors of one kind in one namespace (closed by :meth:`close`),
    on a clock that moves 2 s a reading: every sync after a full one deletes what it left
    unused (``stale.py``'s one-second wait), so the deletions are written both ways too."""

    def __init__(self, owned: bool, flags: int) -> None:
        self.owned = owned
        self.flags = flags
        self.made: list[OwnedNftables | LibNftables] = []
        self.now = 0.0

    def clock(self) -> float:
        self.now += 2.0
        return self.now

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        assert netns is not None
        writer: OwnedNftables | LibNftables = (
            OwnedNftables(netns, owner_flags=self.flags) if self.owned else LibNftables(netns)
        )
        self.made.append(writer)
        return backend_over(writer, family, config, netns=netns, clock=self.clock)

    def close(self) -> None:
        for writer in self.made:
            writer.close()
        self.made.clear()


State = tuple[str, list[str], list[str], str]


def _record(case_path: Path, netns: str, writers: _Writers) -> list[State]:
    """What the kernel holds after every sync of every case of a file, as (step, ip
    dump, ip6 dump, listing without owner marks)."""
    states: list[State] = []
    for case in load_case_file(case_path).cases:

        def on_sync(step: Step, ok: bool, case_name: str = case.name) -> None:
            listing = run_in(netns, "nft", "list", "ruleset")
            states.append(
                (
                    f"{case_name} step {step.index} (sync {'ok' if ok else 'failed'})",
                    dump(netns, "ip"),
                    dump(netns, "ip6"),
                    without_owner(listing),
                )
            )

        try:
            replay_syncs(case, writers, netns, on_sync)
        finally:
            writers.close()
    return states


@pytest.fixture(scope="module")
def twins() -> Iterator[tuple[str, str]]:
    with lone_namespace(PREFIX) as ours, lone_namespace(PREFIX) as nfts:
        yield ours.name, nfts.name


@pytest.mark.parametrize("path", FLOW_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_flow_case_state_is_what_nft_writes(
    path: Path, twins: tuple[str, str], kernel_flags: tuple[bool, bool]
) -> None:
    owner, persist = kernel_flags
    flags = OWNER_FLAGS if persist else NFT_TABLE_F_OWNER if owner else 0
    ours = _record(path, twins[0], _Writers(True, flags))
    nfts = _record(path, twins[1], _Writers(False, 0))
    assert [s[0] for s in ours] == [s[0] for s in nfts]
    assert ours, f"{path.name}: no sync"
    for (step, ip4, ip6, listing), (_, nft4, nft6, nft_listing) in zip(ours, nfts, strict=True):
        for family, mine, theirs in (("ip", ip4, nft4), ("ip6", ip6, nft6)):
            if mine != theirs:
                diff = difflib.unified_diff(theirs, mine, "nft", "ours", lineterm="", n=2)
                pytest.fail(f"{step}, {family}: the kernel holds otherwise:\n" + "\n".join(diff))
        if listing != nft_listing:
            diff = difflib.unified_diff(
                nft_listing.splitlines(), listing.splitlines(), "nft", "ours", lineterm="", n=2
            )
            pytest.fail(f"{step}: nft lists it otherwise:\n" + "\n".join(diff))


def _exposed_sticky_snapshot(family: IPFamily) -> ProxySnapshot:
    """A ClientIP port of each protocol with a NodePort and a load-balancer IP: what the
    affinity entries keyed by the cluster-IP frontend write for every protocol (the flow
    cases have TCP ones only); IPv6's keys are hashes of the frontend."""
    services, endpoints, categorized = {}, {}, {}
    if family is IPFamily.IPV4:
        endpoint, cluster, vip = "10.180.9.{}", "172.30.9.{}", "5.6.9.{}"
    else:
        endpoint, cluster, vip = "fd00:180:9::{}", "fd00:96:9::{}", "fd00:5:6:9::{}"
    for n, proto in enumerate((Protocol.TCP, Protocol.UDP, Protocol.SCTP)):
        name = ServicePortName(NamespacedName("kpxo", f"s{n}"), "p", proto)
        eps = (Endpoint(ipaddress.ip_address(endpoint.format(n + 1)), 8080),)
        services[name] = ServicePort(
            name,
            ipaddress.ip_address(cluster.format(n + 1)),
            80,
            proto,
            node_port=30900 + n,
            load_balancer_vips=(ipaddress.ip_address(vip.format(n + 1)),),
            session_affinity_seconds=60 + n,
        )
        endpoints[name] = eps
        categorized[name] = CategorizedEndpoints(eps, (), eps, True)
    return ProxySnapshot(family, NodeInfo("kpxo-node"), services, endpoints, categorized)


@pytest.mark.parametrize("family", [IPFamily.IPV4, IPFamily.IPV6], ids=["ipv4", "ipv6"])
def test_the_frontend_keyed_affinity_of_every_protocol_is_what_nft_writes(
    family: IPFamily, twins: tuple[str, str], kernel_flags: tuple[bool, bool]
) -> None:
    """The canonical maps' rules (payload writes of ``ip``/``ip6 daddr`` and each
    protocol's ``dport``, map lookups as their values, ``ct reply`` keys; IPv6's hashes
    of a concatenation) as the owned table's encoder writes them hold the same bytecode
    as nft's, for TCP, UDP and SCTP."""
    owner, persist = kernel_flags
    flags = OWNER_FLAGS if persist else NFT_TABLE_F_OWNER if owner else 0
    table = "ip" if family is IPFamily.IPV4 else "ip6"
    held = []
    for netns, writers in ((twins[0], _Writers(True, flags)), (twins[1], _Writers(False, 0))):
        try:
            backend = writers(family, ProxierConfig(node_name="kpxo-node"), netns=netns)
            backend.sync(_exposed_sticky_snapshot(family), SyncChanges(full=True))
            held.append(
                (dump(netns, table), without_owner(run_in(netns, "nft", "list", "ruleset")))
            )
            backend.cleanup()
        finally:
            writers.close()
    (ours, our_listing), (nfts, nft_listing) = held
    assert "udp dport set ct reply proto-src" in nft_listing
    assert "sctp dport set meta l4proto . sctp dport map @affinity-canonical-ports" in nft_listing
    if family is IPFamily.IPV6:
        assert "jhash ct original ip6 daddr . meta l4proto . ct original proto-dst" in nft_listing
    if ours != nfts:
        diff = difflib.unified_diff(nfts, ours, "nft", "ours", lineterm="", n=2)
        pytest.fail("the kernel holds otherwise:\n" + "\n".join(diff))
    assert our_listing == nft_listing


# Real packets ------------------------------------------------------------------------------


@pytest.fixture
def topology() -> Iterator[Topology]:
    with client_node_server(PREFIX) as topo:
        yield topo


def snapshot(extra: int) -> ProxySnapshot:
    return echo_snapshot(PREFIX, extra)


def full() -> SyncChanges:
    return SyncChanges(full=True)


def disrupt(netns: str) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each disruption once, as another process in the node namespace."""
    out = {}
    for disruption in DISRUPTIONS:
        out[disruption.name] = subprocess.run(
            ["ip", "netns", "exec", netns, *disruption.argv],
            input=disruption.stdin,
            capture_output=True,
            text=True,
            check=False,
        )
    return out


def test_connections_flow_while_others_flush_delete_and_reload(
    owning: None, topology: Topology
) -> None:
    node = topology.node
    backend = create_backend(IPFamily.IPV4, CONFIG, netns=node)
    executor = backend.executor
    assert isinstance(executor, OwnedNftables)
    backend.sync(snapshot(50), full())
    held = dump(node, "ip")
    with connections_flowing(topology) as flow:
        for _round in range(3):
            done = disrupt(node)
            time.sleep(0.05)
    assert flow.failed == 0, flow.errors[:5]
    assert flow.ok > 0
    # The others ran: the flushes and reloads succeeded (for every other table), the
    # deletion of ours was refused.
    for name in ("flush", "iptables", "reload"):
        assert done[name].returncode == 0, (name, done[name].stderr)
    assert done["delete"].returncode != 0
    assert "Operation not permitted" in done["delete"].stderr
    assert dump(node, "ip") == held
    assert "table inet kpxb-firewalld" in run_in(node, "nft", "list", "tables")

    # Side by side: the proxy ends (its table orphaned, still serving), and the same
    # flush takes the table, as it takes an unowned one: self-healing's case.
    executor.close()
    assert dump(node, "ip") == held
    with connections_flowing(topology) as flow:
        time.sleep(0.1)
        run_in(node, "nft", "flush", "ruleset")
        time.sleep(0.5)
    assert "kube-proxy" not in run_in(node, "nft", "list", "tables")
    assert flow.failed > 0


def test_a_restart_adopts_the_orphaned_table_without_a_gap(
    owning: None, topology: Topology
) -> None:
    node = topology.node
    first = OwnedNftables(node)
    backend = backend_over(first, IPFamily.IPV4, CONFIG)
    assert first.claim(Family.IP) is TableState.MISSING
    backend.sync(snapshot(200), full())
    adopted: list[TableState] = []

    def restart() -> None:
        first.close()  # the old process ends: the table stays, orphaned
        second = OwnedNftables(node)
        adopted.append(second.claim(Family.IP))
        again = backend_over(second, IPFamily.IPV4, CONFIG)
        again.sync(snapshot(1000), full())
        # Adopted: nobody else can change it again.
        refused = subprocess.run(
            ["ip", "netns", "exec", node, "nft", "flush", "table", "ip", "kube-proxy"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert refused.returncode != 0 and "Operation not permitted" in refused.stderr

    assert_restart_keeps_connections(topology, restart)
    assert adopted == [TableState.ORPHANED]


def test_a_replaced_socket_adopts_the_table_again(owning: None) -> None:
    with lone_namespace(PREFIX) as ns:
        executor = OwnedNftables(ns.name)
        backend = backend_over(executor, IPFamily.IPV4, CONFIG)
        backend.sync(snapshot(3), full())
        assert "flags owner" in _listing(ns.name)
        # An answer lost: the socket is replaced, and the old one's close orphaned the table.
        executor.channel.replace()
        assert "flags owner" not in _listing(ns.name)
        backend.sync(snapshot(4), full())
        assert "flags owner" in _listing(ns.name)
        assert executor.state(Family.IP) is TableState.OURS
        executor.close()


def test_an_unowned_table_is_replaced_by_an_owned_one_without_a_gap(
    owning: None, topology: Topology
) -> None:
    node = topology.node
    # Today's table: written through libnftables, owned by nobody.
    unowned = backend_over(LibNftables(node), IPFamily.IPV4, CONFIG)
    unowned.sync(snapshot(300), full())
    assert "flags owner" not in run_in(node, "nft", "list", "table", "ip", "kube-proxy")
    owned = OwnedNftables(node)
    assert owned.claim(Family.IP) is TableState.UNOWNED

    def upgrade() -> None:
        backend = backend_over(owned, IPFamily.IPV4, CONFIG)
        backend.sync(snapshot(1000), full())

    assert_restart_keeps_connections(topology, upgrade)
    assert owned.handovers == 1 and owned.state(Family.IP) is TableState.OURS
    listing = run_in(node, "nft", "list", "table", "ip", "kube-proxy")
    assert "flags owner" in listing
    assert ".g1" in listing and ".g2" not in listing  # a new table: nothing of the old left
    with pytest.raises(subprocess.CalledProcessError):
        run_in(node, "nft", "delete", "table", "ip", "kube-proxy")
    # Writing on through the same executor works (a partial sync after the handover).
    conflict = Transaction(Family.IP, "kube-proxy")
    conflict.add_element("cluster-ips", ("172.30.99.99",))
    owned.run(conflict)
    owned.close()


def test_the_gate_off_or_a_kernel_without_persist_keeps_todays_table(
    kernel_flags: tuple[bool, bool],
) -> None:
    gates = resolve({"NFTablesOwnedTable": False})
    config = ProxierConfig(node_name="kpxo-node", feature_gates=gates)
    with lone_namespace(PREFIX) as ns:
        backend = create_backend(IPFamily.IPV4, config, netns=ns.name)
        assert isinstance(backend.executor, LibNftables)
        backend.executor.close()
        default = create_backend(IPFamily.IPV6, CONFIG, netns=ns.name)
        executor = default.executor
        assert isinstance(executor, OwnedNftables | LibNftables)
        # Owned exactly where the kernel has persist.
        assert isinstance(executor, OwnedNftables) is kernel_flags[1]
        executor.close()


# The binaries --------------------------------------------------------------------------------


def _argv(netns: str, program: str, *args: str) -> list[str]:
    return [
        "ip",
        "netns",
        "exec",
        netns,
        str(BIN / program),
        "--manifests",
        str(EXAMPLES),
        "--hostname-override=demo-node",
        "--conntrack-max-per-core=0",
        *args,
    ]


def test_a_second_proxy_is_refused_and_cleanup_waits_for_the_first(owning: None) -> None:
    with lone_namespace(PREFIX) as ns:
        netns = ns.name
        first = subprocess.Popen(
            _argv(
                netns,
                "kube-proxy-nftables",
                "--healthz-bind-address=127.0.0.1:10256",
                "--metrics-bind-address=127.0.0.1:10249",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 20 * default_timeout()
            while "flags owner" not in _listing(netns) or "172.30.0.10" not in _listing(netns):
                assert first.poll() is None, first.communicate()[1]
                assert time.monotonic() < deadline, "the first proxy never synced"
                time.sleep(0.1)
            second = subprocess.run(
                _argv(
                    netns,
                    "kube-proxy-nftables",
                    "--once",
                    "--healthz-bind-address=127.0.0.1:10257",
                    "--metrics-bind-address=127.0.0.1:10250",
                ),
                capture_output=True,
                text=True,
                check=False,
                timeout=60 * default_timeout(),
            )
            assert second.returncode != 0
            lines = second.stderr.splitlines()
            refusals = [line for line in lines if "owned by another process" in line]
            assert len(refusals) == 1, second.stderr
            assert f"pid {first.pid}" in refusals[0] or "kube-proxy" in refusals[0], refusals
            assert "another proxy runs on this node" in refusals[0]
            cleanup = subprocess.run(
                ["ip", "netns", "exec", netns, str(BIN / "kube-proxy-nftables"), "--cleanup"],
                capture_output=True,
                text=True,
                check=False,
            )
            assert cleanup.returncode != 0
            assert "belongs to a running proxy" in cleanup.stderr
            assert "172.30.0.10" in _listing(netns)
        finally:
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=20 * default_timeout())
        # Ended: the table stays, orphaned, and serves; iptables mode removes it (the
        # mode switch), as --cleanup would.
        assert "172.30.0.10" in _listing(netns)
        assert "flags owner" not in _listing(netns)
        switched = subprocess.run(
            _argv(netns, "kube-proxy-iptables", "--once"),
            capture_output=True,
            text=True,
            check=False,
            timeout=60 * default_timeout(),
        )
        assert switched.returncode == 0, switched.stderr
        assert "kube-proxy" not in run_in(netns, "nft", "list", "tables")


def _listing(netns: str) -> str:
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "table", "ip", "kube-proxy"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout
