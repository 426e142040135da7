"""The takeover and the handback over the in-memory fakes: what goes, in which order.

A node's nftables table as upstream's kube-proxy leaves it (its structure from
:mod:`bench.upstream_structure`, loaded into :class:`FakeNft`, which checks references
as the kernel does) is synced over by our backend; :class:`~kubeproxy.cmd.takeover.Takeover`
then sweeps it before the other modes' cleanups run. The handback's classification
(:func:`~kubeproxy.backends.nftables.handback.is_ours`) is checked against every name
both structures write. The real kernel's side is ``tests/test_takeover_kernel.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.synthetic import SyntheticService
from bench.upstream_structure import UpstreamOptions, upstream_ruleset
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.proxier import IptablesBackend, cleanup_leftovers_family
from kubeproxy.backends.ipvs.fake import FakeIPSets, FakeIPVS, FakeLinks
from kubeproxy.backends.ipvs.handover import Executors, handover, restore_sysctls
from kubeproxy.backends.ipvs.netlink import DUMMY_DEVICE, VirtualServer
from kubeproxy.backends.ipvs.proxier import IPVSBackend
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.handback import cleanup_leftovers, is_ours
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.stale import STALE_DELAY, TableObject, chain_object, set_object
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.cmd import modes as cmd_modes
from kubeproxy.cmd.modes import MODES, Mode
from kubeproxy.cmd.takeover import Takeover
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily, NodeInfo
from kubeproxy.proxier import Proxier

V4 = IPFamily.IPV4
NODE = "kpxt-node"
SERVICES = [SyntheticService(i, 3, affinity_seconds=600 if i == 1 else 0) for i in range(4)]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def upstream_fake(layout: str = "1.34") -> FakeNft:
    """A fake holding upstream's table for :data:`SERVICES`."""
    fake = FakeNft()
    fake.run_text("\n".join(upstream_ruleset(SERVICES, UpstreamOptions(layout=layout))) + "\n")
    return fake


def proxier_over(fake: FakeNft, clock: Clock) -> Proxier:
    """Our backend over ``fake``, proxying :data:`SERVICES` once synced."""
    config = ProxierConfig(node_name=NODE)
    backend = NftablesBackend(V4, config, executor=fake, clock=clock)
    proxier = Proxier(V4, config, backend, node=NodeInfo(NODE), clock=clock)
    for service in SERVICES:
        proxier.on_service_add(service.service_dict())
        for slice_ in service.slice_dicts():
            proxier.on_endpoint_slice_add(slice_)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    return proxier


def names(fake: FakeNft) -> set[TableObject]:
    chains = {chain_object(c) for c in fake.list_chains(Family.IP, TABLE)}
    return chains | {set_object(s) for s in fake.list_sets(Family.IP, TABLE)}


def ours_fresh() -> set[TableObject]:
    """What our backend writes for :data:`SERVICES` into an empty table."""
    fake = FakeNft()
    assert proxier_over(fake, Clock()).sync_now()
    return names(fake)


class Recorded:
    """The mode table with its cleanups recorded, and how many objects that are not ours
    the table held at each."""

    def __init__(self, fake: FakeNft) -> None:
        self.fake = fake
        self.cleaned: list[tuple[str, int]] = []  # (mode, upstream objects then)
        self.modes = {name: self._mode(mode) for name, mode in MODES.items()}

    def _mode(self, real: Mode) -> Mode:
        def cleanup(netns: str | None) -> None:
            self.cleaned.append((real.name, len(names(self.fake) - ours_fresh())))

        # Never the real ones: they would act on this host's namespace.
        return dataclasses.replace(real, cleanup=cleanup, handover=None, leftovers=None)


# --- the takeover -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["1.34", "1.33"])
def test_the_sweep_leaves_only_ours_before_the_other_modes_go(layout: str) -> None:
    fake, clock = upstream_fake(layout), Clock()
    proxier = proxier_over(fake, clock)
    assert proxier.sync_now()
    held = names(fake)
    upstreams = held - ours_fresh()
    assert len(upstreams) > 20  # every Service's chains, the endpoints', the maps
    assert any("/" in o.name for o in upstreams)
    if layout == "1.33":
        assert chain_object("filter-output-post-dnat") in upstreams

    recorded = Recorded(fake)
    clock.now += STALE_DELAY
    result = Takeover("nftables", recorded.modes, delay=0)({V4: proxier}, threading.Event())

    assert names(fake) == ours_fresh()
    assert result.deleted == len(upstreams) and result.complete
    # The other modes' leftovers went after our table was clean (upstream's platform
    # cleanup for nftables mode: iptables and ipvs).
    assert recorded.cleaned == [("iptables", 0), ("ipvs", 0)]


def test_what_the_daemons_sweeper_deleted_first_counts_as_taken_over() -> None:
    fake, clock = upstream_fake(), Clock()
    proxier = proxier_over(fake, clock)
    assert proxier.sync_now()
    upstreams = names(fake) - ours_fresh()
    recorded = Recorded(fake)
    backend = proxier.backend
    assert isinstance(backend, NftablesBackend)
    collect = backend.collect_stale

    class SweptMeanwhile(threading.Event):
        """The daemon's sweeper (its own timer) deletes them during the takeover's wait."""

        def wait(self, timeout: float | None = None) -> bool:
            clock.now += STALE_DELAY
            with proxier.syncs_held():
                assert collect()
            return False

    result = Takeover("nftables", recorded.modes, delay=0)({V4: proxier}, SweptMeanwhile())
    assert names(fake) == ours_fresh()
    assert result.deleted == len(upstreams) and result.complete


def test_objects_not_yet_unused_long_enough_are_reported_and_left_to_the_syncs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, clock = upstream_fake(), Clock()
    proxier = proxier_over(fake, clock)
    assert proxier.sync_now()
    recorded = Recorded(fake)
    # The clock stands still: nothing becomes due within the attempts.
    result = Takeover("nftables", recorded.modes, delay=0, attempts=2)(
        {V4: proxier}, threading.Event()
    )
    assert result.deleted == 0 and not result.complete
    assert result.left[V4] > 20
    assert "unused objects are still in our table; the next syncs delete them" in caplog.text
    # The next sync after the delay deletes them.
    clock.now += STALE_DELAY
    proxier.request_full_sync()
    assert proxier.sync_now()
    clock.now += STALE_DELAY
    assert proxier.sync_now()
    assert names(fake) <= ours_fresh() | {o for o in names(fake) if o.name.endswith(".g2")}
    assert not any("/" in o.name and not o.name.startswith("affinity-") for o in names(fake))


def test_a_stopped_daemon_stops_the_takeover() -> None:
    fake, clock = upstream_fake(), Clock()
    proxier = proxier_over(fake, clock)
    assert proxier.sync_now()
    recorded = Recorded(fake)
    stop = threading.Event()
    stop.set()
    result = Takeover("nftables", recorded.modes, delay=0)({V4: proxier}, stop)
    assert result.deleted == 0 and recorded.cleaned == []


def test_iptables_mode_removes_the_nftables_tables_after_its_sync() -> None:
    recorded = Recorded(FakeNft())
    backend = IptablesBackend(V4, ProxierConfig(node_name=NODE), executor=FakeIptables())
    proxier = Proxier(V4, ProxierConfig(node_name=NODE), backend, node=NodeInfo(NODE))
    result = Takeover("iptables", recorded.modes, delay=0)({V4: proxier}, threading.Event())
    assert [mode for mode, _ in recorded.cleaned] == ["nftables"]
    assert result.complete and result.deleted == 0


def test_a_failed_cleanup_is_a_warning_naming_the_way_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def failing(netns: str | None) -> None:
        raise OSError("iptables-legacy-restore: permission denied (you must be root)")

    modes = {
        name: dataclasses.replace(mode, cleanup=failing, handover=None)
        for name, mode in MODES.items()
    }
    caplog.set_level(logging.WARNING)
    result = Takeover("nftables", modes, delay=0)({}, threading.Event())
    assert not result.complete and len(result.errors) == 2
    assert "--cleanup" in caplog.text and "permission denied" in caplog.text


# --- the handback -------------------------------------------------------------------------


def upstream_names() -> set[TableObject]:
    """Every name upstream's nftables mode writes for :data:`SERVICES`, both layouts."""
    found: set[TableObject] = set()
    for layout in ("1.33", "1.34"):
        found |= names(upstream_fake(layout))
    return found


def test_is_ours_tells_every_name_of_ours_from_every_name_of_upstreams() -> None:
    upstream = upstream_names()
    ours = ours_fresh()
    assert not [o for o in upstream if is_ours(o)]
    assert not [o for o in ours - upstream if not is_ours(o)]
    # Names both write (the base chains, the fixed chains, cluster-ips...) stay.
    assert ours & upstream and not [o for o in ours & upstream if is_ours(o)]


def held_by_upstream_after_handback() -> tuple[FakeNft, set[TableObject]]:
    """Our table, then upstream's first sync over it (its transaction as ``nft -f``)."""
    fake = FakeNft()
    assert proxier_over(fake, Clock()).sync_now()
    fake.run_text("\n".join(upstream_ruleset(SERVICES, UpstreamOptions())) + "\n")
    return fake, names(upstream_fake())


def test_cleanup_leftovers_deletes_ours_and_keeps_upstreams() -> None:
    fake, upstream = held_by_upstream_after_handback()
    assert names(fake) > upstream
    deleted = cleanup_leftovers(executor=fake)
    assert names(fake) == upstream
    assert deleted == len(ours_fresh() - upstream)
    assert cleanup_leftovers(executor=fake) == 0  # nothing left to do


def test_cleanup_leftovers_changes_nothing_while_our_rules_are_in_use() -> None:
    fake = FakeNft()
    assert proxier_over(fake, Clock()).sync_now()
    before = names(fake)
    with pytest.raises(NftError, match="our rules are still in use") as raised:
        cleanup_leftovers(executor=fake)
    assert raised.value.errno == errno.EBUSY
    assert names(fake) == before


def iptables_proxier(executor: FakeIptables, config: ProxierConfig) -> Proxier:
    backend = IptablesBackend(V4, config, executor=executor)
    proxier = Proxier(V4, config, backend, node=NodeInfo(NODE))
    for service in SERVICES:
        proxier.on_service_add(service.service_dict())
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    return proxier


def test_cleanup_leftovers_of_iptables_mode_only_when_nothing_jumps_to_it() -> None:
    executor = FakeIptables()
    config = ProxierConfig(node_name=NODE)
    ours = dataclasses.replace(config, service_cidrs=(ipaddress.ip_network("10.96.0.0/12"),))
    assert iptables_proxier(executor, ours).sync_now()
    assert "-j KUBE-SERVICE-IPS" in executor.dump(V4)
    # Still jumped to: left alone.
    assert not cleanup_leftovers_family(executor, V4)
    assert ":KUBE-SERVICE-IPS" in executor.dump(V4)
    # Upstream's first sync (ours without a service CIDR writes exactly its rules): the
    # jump goes, the chain stays.
    assert iptables_proxier(executor, config).sync_now()
    assert ":KUBE-SERVICE-IPS" in executor.dump(V4)
    assert "-j KUBE-SERVICE-IPS" not in executor.dump(V4)
    assert cleanup_leftovers_family(executor, V4)
    assert "KUBE-SERVICE-IPS" not in executor.dump(V4)
    assert not cleanup_leftovers_family(executor, V4)


def test_cleanup_leftovers_runs_every_modes_part_and_reports_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    def leftovers_of(name: str, fail: bool) -> Callable[[str | None], None]:
        def remove(netns: str | None) -> None:
            ran.append(name)
            if fail:
                raise NftError("table ip kube-proxy: our rules are still in use", errno.EBUSY)

        return remove

    modes = {
        name: dataclasses.replace(mode, leftovers=leftovers_of(name, name == "nftables"))
        for name, mode in MODES.items()
    }
    assert cmd_modes.cleanup_leftovers(modes) == 1
    assert ran == ["nftables", "iptables", "ipvs"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [
        "Removing our leftovers failed: nftables mode: table ip kube-proxy: our rules are "
        "still in use"
    ]


# --- ipvs mode's handover: IPVS connections end first -------------------------------------


class IPVSNode:
    """ipvs mode's state over the fakes, for two Services: TCP (``svc-0``) and UDP
    (``svc-1``)."""

    def __init__(self) -> None:
        self.ipvs, self.links, self.ipsets = FakeIPVS(), FakeLinks(), FakeIPSets()
        self.iptables = FakeIptables()
        config = ProxierConfig(node_name=NODE)
        backend = IPVSBackend(
            V4, config, ipvs=self.ipvs, links=self.links, ipsets=self.ipsets, iptables=self.iptables
        )
        proxier = Proxier(V4, config, backend, node=NodeInfo(NODE))
        for service in (SyntheticService(0, 2), SyntheticService(1, 2, protocol="UDP")):
            proxier.on_service_add(service.service_dict())
            for slice_ in service.slice_dicts():
                proxier.on_endpoint_slice_add(slice_)
        proxier.on_services_synced()
        proxier.on_endpoint_slices_synced()
        assert proxier.sync_now()
        self.restored: list[str | None] = []

    def executors(self) -> Executors:
        return Executors(self.ipvs, self.links, self.ipsets, self.iptables)  # type: ignore[arg-type]

    def servers(self) -> dict[str, VirtualServer]:
        return {vs.protocol.lower: vs for vs in self.ipvs.virtual_servers()}

    def connect(self, protocol: str, active: int, inactive: int) -> None:
        vs = self.servers()[protocol]
        rs = self.ipvs.real_servers(vs)[0]
        self.ipvs.set_connections(vs, rs.address, rs.port, active, inactive)

    def sysctls(self, netns: str | None) -> list[str]:
        self.restored.append(netns)
        return ["net.ipv4.vs.conntrack"]


def test_ipvs_handover_keeps_the_virtual_servers_of_connections_until_they_end() -> None:
    node, clock = IPVSNode(), Clock()
    node.connect("tcp", active=1, inactive=3)
    node.connect("udp", active=0, inactive=1)  # IPVS counts UDP flows as inactive
    looks: list[set[str]] = []
    stop = threading.Event()

    class Polls(threading.Event):
        """Each wait is one poll: the connections change as a test script says."""

        def wait(self, timeout: float | None = None) -> bool:
            looks.append(set(node.servers()))
            if len(looks) == 1:
                node.connect("tcp", active=0, inactive=4)  # closed: TIME_WAIT needs nothing
            if len(looks) == 2:
                clock.now += 900
            return stop.is_set()

    handover(node.executors(), Polls(), limit=900, poll=0, clock=clock, sysctls=node.sysctls)
    # At once: ipvs mode's chains and sets would go, and every idle virtual server; both
    # of these carry connections, so both stay, with their addresses.
    assert looks[0] == {"tcp", "udp"}
    assert looks[1] == {"udp"}  # the TCP one ended
    assert node.servers() == {}  # the UDP flow outlived the limit: removed anyway
    assert DUMMY_DEVICE not in node.links.links
    assert not node.ipsets.save()
    assert node.restored == [None]


def test_ipvs_cleanup_and_a_stopped_handover_do_not_wait() -> None:
    node = IPVSNode()
    node.connect("tcp", active=1, inactive=0)
    stop = threading.Event()
    stop.set()
    handover(node.executors(), stop, limit=900, poll=0, sysctls=node.sysctls)
    # Stopped while draining: the busy server and what identifies it stay for the next
    # start to find; nothing else of ipvs mode does.
    assert set(node.servers()) == {"tcp"}
    assert node.ipsets.save() and node.restored == []
    handover(node.executors(), None, limit=0, sysctls=node.sysctls)  # --cleanup
    assert node.servers() == {} and not node.ipsets.save()
    assert node.restored == [None]


def test_restoring_the_ipvs_sysctls_only_where_they_hold_ipvs_modes_values(
    tmp_path: Path,
) -> None:
    (tmp_path / "net/ipv4/vs").mkdir(parents=True)
    values = {"conntrack": "1", "expire_nodest_conn": "1", "expire_quiescent_template": "0"}
    for name, value in values.items():
        (tmp_path / "net/ipv4/vs" / name).write_text(f"{value}\n")
    assert restore_sysctls(proc_root=tmp_path) == [
        "net.ipv4.vs.conntrack",
        "net.ipv4.vs.expire_nodest_conn",
    ]
    assert (tmp_path / "net/ipv4/vs/conntrack").read_text() == "0\n"
    assert restore_sysctls(proc_root=tmp_path) == []
    assert restore_sysctls(proc_root=tmp_path / "missing") == []  # no IPVS loaded


def test_a_kernel_that_releases_chains_late_gets_the_references_removed_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, clock = upstream_fake(), Clock()
    proxier = proxier_over(fake, clock)
    assert proxier.sync_now()
    # Kernels before 6.2 (upstream's word) refuse to delete a chain that a verdict map's
    # element named until a moment after the element went: the deletion of both at once.
    fake.fail_next = NftError("delete chain service-...: Device or resource busy", errno.EBUSY)
    clock.now += STALE_DELAY
    transactions = len(fake.transactions)

    class Later(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            clock.now += STALE_DELAY  # the sweep's delay passes on the backend's clock
            return False

    caplog.set_level(logging.INFO)
    result = Takeover("nftables", Recorded(fake).modes, delay=0)({V4: proxier}, Later())
    assert result.complete and names(fake) == ours_fresh()
    refused, references, rest = fake.transactions[transactions:]
    assert "delete chain" in refused.render()
    first = references.render()
    assert "flush chain" in first and "delete chain" not in first and "delete set" in first
    assert "delete chain" in rest.render()
    assert "the references went first" in caplog.text
