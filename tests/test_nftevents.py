"""The nf_tables event filter on recorded kernel payloads: ours vs. others', and which
objects matter to nftables mode and to iptables-nft mode.

The payloads (``tests/nft_event_payloads.py``) were recorded from the kernel by
``tests/nft_event_recorder.py``: our own commit (libnftables in-process), iptables-nft
run by a child of ours, a foreign table, then a foreign element deletion, chain flush,
iptables-nft chain flush, jump deletion, someone's CNI chain, and ``nft flush ruleset``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from kubeproxy.backends.iptables.monitor import OurChains
from kubeproxy.backends.iptables.proxier import owns_chain
from kubeproxy.backends.ipvs.rules import CHAINS as IPVS_CHAINS
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.monitor import OurTables
from kubeproxy.host.children import ChildProcesses
from kubeproxy.nftevents import (
    Commit,
    CommitAssembler,
    EventsLost,
    EventSocket,
    Generation,
    Interest,
    NftablesEventWatcher,
    ObjectChange,
    OwnWriters,
    own_netlink_portids,
    parse_datagram,
    read_generation,
    summarize,
)
from kubeproxy.objects import IPFamily
from kubeproxy.selfheal import ChangeKind, ExternalChange
from tests.nft_event_payloads import STEPS

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
BOTH = (V4, V6)


def datagrams(*steps: str) -> list[bytes]:
    return [bytes.fromhex(d) for step in steps for d in STEPS[step][1]]


def messages(step: str) -> list[ObjectChange | Generation]:
    return [item for d in datagrams(step) for item in parse_datagram(d)]


OUR_PORTID = messages("ours")[0].portid


def children_of_ours() -> ChildProcesses:
    registry = ChildProcesses()
    for pid in STEPS["iptables-ours"][0].values():
        with registry.spawning() as note:
            note(pid)
    return registry


# --- parsing ---------------------------------------------------------------------------------


def test_parses_our_commit_object_by_object() -> None:
    items = messages("ours")
    changes = [(m.op, m.family, m.table, m.name) for m in items if isinstance(m, ObjectChange)]
    assert changes == [
        ("NEWTABLE", "ip", "kube-proxy", ""),
        ("NEWCHAIN", "ip", "kube-proxy", "services"),
        ("NEWSET", "ip", "kube-proxy", "service-ips"),
        ("NEWCHAIN", "ip", "kube-proxy", "service-web"),
        ("NEWRULE", "ip", "kube-proxy", "service-web"),
        ("NEWSETELEM", "ip", "kube-proxy", "service-ips"),
        ("NEWRULE", "ip", "kube-proxy", "services"),
        ("NEWTABLE", "ip6", "kube-proxy", ""),
        ("NEWCHAIN", "ip6", "kube-proxy", "services"),
    ]
    generation = items[-1]
    assert isinstance(generation, Generation)
    # Every message of a commit carries the committing socket's port id.
    assert {m.portid for m in items} == {OUR_PORTID}
    assert generation.process == "python"


def test_a_child_commits_through_a_socket_named_after_its_pid() -> None:
    ids = STEPS["iptables-ours"][0]
    generations = [m for m in messages("iptables-ours") if isinstance(m, Generation)]
    assert [(g.portid, g.pid, g.process) for g in generations] == [
        (ids["child"], ids["child"], "iptables-nft"),
        (ids["child2"], ids["child2"], "iptables-nft"),
    ]


def test_flush_ruleset_deletes_everything_in_one_commit() -> None:
    items = messages("flush-ruleset")
    assert sum(isinstance(m, Generation) for m in items) == 1
    deleted = {(m.op, m.family, m.table) for m in items if isinstance(m, ObjectChange)}
    assert {("DELTABLE", "ip", "kube-proxy"), ("DELTABLE", "ip6", "kube-proxy")} <= deleted
    assert ("DELTABLE", "inet", "kpxrec-firewall") not in deleted  # named "firewall"
    assert ("DELTABLE", "inet", "firewall") in deleted
    assert ("DELTABLE", "ip", "nat") in deleted


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x10\x00\x00\x00",  # a header cut short
        bytes.fromhex("ffff0000" + "0a0a0000" + "00" * 8),  # a length beyond the datagram
        bytes.fromhex("14000000" + "0001" + "0000" + "00" * 8 + "02000000"),  # NLMSG_ERROR
    ],
)
def test_malformed_or_foreign_messages_are_skipped(data: bytes) -> None:
    assert list(parse_datagram(data)) == []


# --- the watcher on recorded streams ----------------------------------------------------------


class Host:
    """A WatchHost recording reports; ``syncs_held`` takes a lock (as the proxier's)."""

    def __init__(self) -> None:
        self.reports: list[ExternalChange] = []
        self.lock = threading.RLock()

    def report(self, change: ExternalChange) -> None:
        self.reports.append(change)

    repairing: frozenset[IPFamily] = frozenset()

    @contextlib.contextmanager
    def syncs_held(self) -> Iterator[None]:
        with self.lock:
            yield


class FakeEvents:
    """An EventSocket replaying batches of datagrams (or raising), then stopping."""

    def __init__(self, batches: Iterable[list[bytes] | OSError], stop: threading.Event) -> None:
        self.batches: deque[list[bytes] | OSError] = deque(batches)
        self.stop = stop
        self.netns_cookie = None
        self.portid = 4242
        self.filters: list[set[int]] = []
        self.closed = False

    def ignore_portids(self, portids: Iterable[int]) -> None:
        self.filters.append(set(portids))

    def receive(self, timeout: float) -> list[bytes]:
        if not self.batches:
            self.stop.set()
            return []
        batch = self.batches.popleft()
        if isinstance(batch, OSError):
            raise batch
        return batch

    def close(self) -> None:
        self.closed = True


def watch(
    interest: Interest,
    batches: Iterable[list[bytes] | OSError],
    own: OwnWriters,
) -> tuple[list[ExternalChange], FakeEvents]:
    stop = threading.Event()
    events = FakeEvents(batches, stop)
    watcher = NftablesEventWatcher(interest, own=own, socket_factory=lambda _ns: events)  # type: ignore[arg-type,return-value]
    host = Host()
    watcher.run(stop, host)
    assert events.closed
    return host.reports, events


EVERY_STEP = list(STEPS)


def test_nftables_mode_reports_only_others_changes_of_our_tables() -> None:
    own = OwnWriters([children_of_ours()], portids=lambda: {OUR_PORTID})
    reports, events = watch(OurTables(BOTH), [datagrams(s) for s in EVERY_STEP], own)
    element, flush, ruleset4, ruleset6 = reports
    assert (element.kind, element.family) == ("element", V4)
    assert element.detail.startswith(
        "table ip kube-proxy: 1 element deleted (from service-ips), by nft (pid "
    )
    assert (flush.kind, flush.family) == ("rule", V4)
    assert "1 rule deleted (in service-web)" in flush.detail
    assert (ruleset4.kind, ruleset4.family) == ("table", V4)
    assert ruleset4.detail.startswith(
        "table ip kube-proxy: 1 table deleted; 2 chains deleted (service-web, services); "
        "1 set or map deleted (service-ips); 1 rule deleted (in services), by nft (pid "
    )
    assert (ruleset6.kind, ruleset6.family) == ("table", V6)
    assert ruleset6.detail.startswith("table ip6 kube-proxy: 1 table deleted; 1 chain deleted")
    # Our socket is filtered in the kernel from the start.
    assert events.filters[0] == {OUR_PORTID, events.portid}


def test_our_own_commit_is_never_reported_even_before_the_filter_knows_it() -> None:
    sockets: set[int] = set()
    own = OwnWriters(portids=lambda: set(sockets))
    stop = threading.Event()
    # The socket of ours appears only after the watcher started (libnftables binds its
    # socket at its first command): the refresh at its first message finds it.
    events = FakeEvents([datagrams("ours"), datagrams("delete-element")], stop)
    watcher = NftablesEventWatcher(OurTables(BOTH), own=own, socket_factory=lambda _ns: events)  # type: ignore[arg-type,return-value]
    host = Host()
    original = events.receive

    def receive(timeout: float) -> list[bytes]:
        sockets.add(OUR_PORTID)
        return original(timeout)

    events.receive = receive  # type: ignore[method-assign]
    watcher.run(stop, host)
    assert [r.kind for r in host.reports] == ["element"]
    assert events.filters[-1] == {OUR_PORTID, events.portid}


def test_only_our_families_count() -> None:
    own = OwnWriters(portids=lambda: {OUR_PORTID})
    reports, _ = watch(OurTables([V6]), [datagrams("flush-ruleset")], own)
    assert [(r.kind, r.family) for r in reports] == [("table", V6)]


def test_iptables_nft_mode_reports_changes_of_our_chains_only() -> None:
    own = OwnWriters([children_of_ours()], portids=lambda: {OUR_PORTID})
    reports, _ = watch(OurChains(owns_chain, BOTH), [datagrams(s) for s in EVERY_STEP], own)
    added, flushed, jump, ruleset = reports
    # Someone else's iptables -A into our chain, then -F of it: both commits count.
    assert (added.kind, added.family) == ("other", V4)
    assert "1 rule added (in KUBE-SERVICES)" in added.detail
    assert (flushed.kind, flushed.family) == ("rule", V4)
    assert "1 rule deleted (in KUBE-SERVICES), by iptables-nft (pid " in flushed.detail
    # The jump from PREROUTING names our chain in its attributes.
    assert (jump.kind, jump.family) == ("rule", V4)
    assert "1 rule deleted (in PREROUTING)" in jump.detail
    # flush ruleset took the nat table with our chain; the CNI chain did not count.
    assert (ruleset.kind, ruleset.family) == ("table", V4)
    assert ruleset.detail.startswith("table ip nat: 1 table deleted")
    assert "KUBE-SERVICES" in ruleset.detail


def test_iptables_children_unknown_make_their_commits_foreign() -> None:
    own = OwnWriters(portids=lambda: {OUR_PORTID})
    reports, _ = watch(OurChains(owns_chain, BOTH), [datagrams("iptables-ours")], own)
    assert [(r.kind, r.family) for r in reports] == [("other", V4), ("other", V4)]


def test_ipvs_chains_are_judged_by_ipvs_ownership() -> None:
    owned = frozenset(IPVS_CHAINS)
    interest = OurChains(lambda table, chain: (table, chain) in owned, BOTH)
    own = OwnWriters([children_of_ours()], portids=lambda: {OUR_PORTID})
    reports, _ = watch(interest, [datagrams(s) for s in EVERY_STEP], own)
    # KUBE-SERVICES is an ipvs chain too; the CNI chain is nobody's.
    assert [r.kind for r in reports] == ["other", "rule", "rule", "table"]


def test_lost_events_ask_for_one_comparison_and_warn_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    own = OwnWriters(portids=lambda: {OUR_PORTID})
    lost = EventsLost(errno.ENOBUFS, "dropped")
    with caplog.at_level(logging.DEBUG, logger="kubeproxy.nftevents"):
        reports, _ = watch(
            OurTables(BOTH),
            # A commit cut by the loss is forgotten, not misread.
            [datagrams("flush-ruleset")[:1], lost, lost, datagrams("delete-element")],
            own,
        )
    assert [(r.kind, r.family) for r in reports] == [
        ("missed-events", None),
        ("missed-events", None),
        ("element", V4),
    ]
    losses = [r for r in caplog.records if "were lost" in r.getMessage()]
    assert [r.levelno for r in losses] == [logging.WARNING, logging.DEBUG]


def test_without_events_the_generation_is_compared(caplog: pytest.LogCaptureFixture) -> None:
    state = {"generation": 5, "polls": 0}
    polled = threading.Condition()
    host = Host()

    def generation() -> int:
        with polled:
            if threading.current_thread().name == "watcher":
                state["polls"] += 1
                polled.notify_all()
            return state["generation"]

    def after_polls(more: int) -> None:
        with polled:
            wanted = state["polls"] + more
            assert polled.wait_for(lambda: state["polls"] >= wanted, 5)

    def refuse(_netns: str | None) -> Any:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    watcher = NftablesEventWatcher(
        OurTables(BOTH), socket_factory=refuse, generation=generation, fallback_interval=0.001
    )
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="kubeproxy.nftevents"):
        thread = threading.Thread(target=watcher.run, args=(stop, host), name="watcher")
        thread.start()
        try:
            after_polls(2)
            assert host.reports == []
            # A sync of ours: the checks wait for it, and it records what it left.
            with host.syncs_held():
                state["generation"] = 6
                watcher.after_sync(None, None, None)  # type: ignore[arg-type]
            after_polls(2)
            assert host.reports == []
            state["generation"] = 9  # someone else
            after_polls(2)
        finally:
            stop.set()
            thread.join(5)
    assert not thread.is_alive()
    assert [(r.kind, r.family) for r in host.reports] == [("missed-events", None)]
    assert "generation 6 -> 9" in host.reports[0].detail
    (warning,) = caplog.records
    assert "Cannot listen to nf_tables events" in warning.getMessage()


# --- pieces ---------------------------------------------------------------------------------


def test_summarize_names_few_objects_and_counts_all() -> None:
    counts = {("DELRULE", "ip", "kube-proxy", f"chain{i}"): 2 for i in range(5)} | {
        ("NEWSETELEM", "ip", "kube-proxy", "service-ips"): 1
    }
    commit = Commit(7, 100, 1234, "nft", counts)
    (change,) = summarize(commit, {"ip": V4})
    assert change == ExternalChange(
        ChangeKind.RULE,
        "table ip kube-proxy: 10 rules deleted (in chain0, chain1, chain2 and 2 more); "
        "1 element added (to service-ips), by nft (pid 1234) (generation 7)",
        V4,
    )


def test_the_assembler_bounds_what_it_keeps() -> None:
    assembler = CommitAssembler(keep=2)
    for index in range(5):
        assembler.add(ObjectChange("DELCHAIN", "ip", "t", f"c{index}", 9))
    assert assembler.pending
    commit = assembler.close(Generation(3, 9, 99, "nft"))
    assert commit is not None
    assert commit.counts == {
        ("DELCHAIN", "ip", "t", "c0"): 1,
        ("DELCHAIN", "ip", "t", "c1"): 1,
        ("DELCHAIN", "ip", "t", ""): 3,
    }
    # Nothing relevant: no commit.
    assert not assembler.pending
    assert assembler.close(Generation(4, 9, 99, "nft")) is None


def test_a_commit_judged_while_a_child_is_spawned_waits_for_its_pid() -> None:
    registry = ChildProcesses()
    own = OwnWriters([registry], portids=set)
    spawning = threading.Event()
    release = threading.Event()

    def spawn() -> None:
        with registry.spawning() as note:
            spawning.set()
            release.wait(5)
            note(31337)

    thread = threading.Thread(target=spawn)
    thread.start()
    spawning.wait(5)
    threading.Timer(0.05, release.set).start()
    assert own.is_ours(31337, 0)
    thread.join()
    assert not own.is_ours(31338, 0, wait=0.01)
    # The NEWGEN pid is a second key (where we share the initial pid namespace).
    assert own.is_ours(-5, 31337)


def test_own_netlink_portids_finds_our_nfnetlink_sockets() -> None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12) as sock:
        sock.bind((0, 0))
        portid = sock.getsockname()[0]
        # Port ids are per namespace: count only this one's (other tests leave sockets
        # of ours in namespaces of their own, which may hold the same number).
        cookie = int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, 71, 8), "little")
        assert portid in own_netlink_portids(cookie)
        # ... and per protocol: a route socket's is not an nfnetlink one.
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as other:
            other.bind((0x7654321, 0))
            assert 0x7654321 not in own_netlink_portids(cookie)
    assert portid not in own_netlink_portids(cookie)


def test_the_running_children_are_filtered_in_the_kernel_while_they_run() -> None:
    registry = ChildProcesses()
    own = OwnWriters([registry], portids=lambda: {OUR_PORTID})
    stop = threading.Event()
    released = threading.Event()

    class Waiting(FakeEvents):
        def receive(self, timeout: float) -> list[bytes]:
            released.wait(5)
            stop.set()
            return []

    events = Waiting([], stop)
    watcher = NftablesEventWatcher(
        OurChains(owns_chain, BOTH),
        own=own,
        socket_factory=lambda _ns: events,  # type: ignore[arg-type,return-value]
    )
    thread = threading.Thread(target=watcher.run, args=(stop, Host()))
    thread.start()
    assert watcher.ready.wait(5)
    with registry.spawning() as note:
        note(4001)
    with registry.spawning() as note:
        note(4002)
    registry.exited(4001)
    released.set()
    thread.join(5)
    assert events.filters == [
        {OUR_PORTID, events.portid},
        {OUR_PORTID, events.portid, 4001},
        {OUR_PORTID, events.portid, 4001, 4002},
        {OUR_PORTID, events.portid, 4002},
    ]
    # Gone from the filter, still known as ours (its commit may be judged later).
    assert registry.running == {4002}
    assert own.is_ours(4001, 0, wait=0)
    # The watcher stopped listening to the registry.
    with registry.spawning() as note:
        note(4003)
    assert len(events.filters) == 4


@pytest.mark.kernel
def test_the_kernel_filter_drops_our_commits_and_keeps_others() -> None:
    netns = f"kpxev-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        events = EventSocket(netns)
        with LibNftables(netns=netns) as ours:
            ours.run_text("add table ip t\n")  # binds its socket
            events.receive(0.3)
            mine = own_netlink_portids(events.netns_cookie)
            assert mine
            # Hundreds of port ids (more than an 8-bit jump could span), ours among them.
            events.ignore_portids(set(range(70000, 70400)) | mine)
            ours.run_text("add chain ip t c\n")
            assert events.receive(0.3) == []
            subprocess.run(
                ["ip", "netns", "exec", netns, "nft", "add", "chain", "ip", "t", "d"], check=True
            )
            seen = [item for d in events.receive(1.0) for item in parse_datagram(d)]
            assert [(i.op, i.name) for i in seen if isinstance(i, ObjectChange)] == [
                ("NEWCHAIN", "d")
            ]
            assert read_generation(netns) >= 3
        events.close()
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


def test_a_commit_whose_end_was_lost_is_not_counted_into_the_next() -> None:
    own = OwnWriters(portids=lambda: {OUR_PORTID})
    ruleset = datagrams("flush-ruleset")
    # The overflow took the end of flush ruleset (its last datagrams, NEWGEN included);
    # what was read of it must not be counted into the next commit, someone's element
    # deletion.
    cut = [d for d in ruleset if not any(isinstance(i, Generation) for i in parse_datagram(d))]
    lost = EventsLost(errno.ENOBUFS, "dropped")
    reports, _ = watch(OurTables(BOTH), [cut, lost, datagrams("delete-element")], own)
    assert [(r.kind, r.family) for r in reports] == [("missed-events", None), ("element", V4)]
    assert "table" not in reports[1].detail.split(":")[1]
    reports, _ = watch(OurTables(BOTH), [cut + datagrams("delete-element")], own)
    assert [(r.kind, r.family) for r in reports] == [("element", V4)]
    assert reports[0].detail.startswith("table ip kube-proxy: 1 element deleted")
