"""The self-healing core without a kernel: what a report turns into (full sync, log line,
metric, Event, health hook), the end of a repair, periodic checks, the iptables canary
check over the in-memory iptables, and the daemon's wiring of watchers."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from kubeproxy.backend import ProxySnapshot, SyncChanges, SyncError
from kubeproxy.backends.iptables import IptablesBackend
from kubeproxy.backends.iptables.exec import IptablesVariant
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.monitor import canary_watcher
from kubeproxy.backends.iptables.monitor import watchers as iptables_watchers
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.cmd.modes import MODES
from kubeproxy.config import ProxierConfig
from kubeproxy.daemon import DaemonPlugins, DaemonSeams, build_daemon
from kubeproxy.events import FakeEventRecorder
from kubeproxy.health import FAULT_RULES_REMOVED, ProxyHealth
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.nftevents import NftablesEventWatcher
from kubeproxy.objects import IPFamily, Protocol, ServicePort
from kubeproxy.proxier import FinishedSync, Proxier
from kubeproxy.selfheal import (
    DETAILS_PER_REPAIR,
    KEPT_REPAIRS,
    ChangeKind,
    ExternalChange,
    PeriodicCheck,
    SelfHealer,
    WatchHost,
)
from kubeproxy.testing.fakeapi import node, service
from tests.gcops import recording_gc
from tests.snapshots import World, ep, spn
from tests.test_daemon import FakeBackends, options_for, slice_of
from tests.test_proxier import (
    RecordingBackend,
    initialized,
    make_proxier,
    two_services,
)

V4, V6 = IPFamily.IPV4, IPFamily.IPV6


class Counter:
    def __init__(self) -> None:
        self.counted: list[tuple[IPFamily, str]] = []

    def external_change(self, family: IPFamily, kind: str) -> None:
        self.counted.append((family, kind))


class KernelState:
    def __init__(self) -> None:
        self.calls: list[tuple[str, IPFamily]] = []

    def report_data_plane_broken(self, family: IPFamily, cause: str, reason: str) -> None:
        assert cause == FAULT_RULES_REMOVED and reason.startswith("rules changed by someone")
        self.calls.append(("diverged", family))

    def report_data_plane_repaired(self, family: IPFamily, cause: str) -> None:
        assert cause == FAULT_RULES_REMOVED
        self.calls.append(("restored", family))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def healer_with(
    *families: IPFamily,
) -> tuple[SelfHealer, dict[IPFamily, tuple[Proxier, RecordingBackend]], Counter, Any, Any, Clock]:
    pairs = {family: make_proxier(family) for family in families}
    for proxier, _ in pairs.values():
        two_services(proxier)
        initialized(proxier)
    counter, events, state, clock = Counter(), FakeEventRecorder("n"), KernelState(), Clock()
    healer = SelfHealer(
        {f: p for f, (p, _) in pairs.items()},
        counter=counter,
        events=events,
        kernel_state=state,
        clock=clock,
    )
    return healer, pairs, counter, events, state, clock


def test_a_report_asks_for_a_full_sync_and_says_what_was_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    healer, pairs, counter, events, state, _ = healer_with(V4, V6)
    proxier, backend = pairs[V4]
    assert proxier.sync_now() and not backend.last.full  # nothing pending: partial
    with caplog.at_level(logging.INFO, logger="kubeproxy.selfheal"):
        healer.report(
            ExternalChange(ChangeKind.ELEMENT, "1 element deleted (from service-ips)", V4)
        )
    (line,) = caplog.records
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        "Rules changed by someone else (IPv4, element): 1 element deleted (from service-ips);"
        " full sync requested"
    )
    assert counter.counted == [(V4, "element")]
    assert state.calls == [("diverged", V4)]
    assert [(e.reason, e.action, e.type) for e in events.events] == [
        ("ProxyRulesChangedExternally", "RepairProxyRules", "Warning")
    ]
    assert "1 element deleted" in events.events[0].note
    assert healer.repairing == {V4}
    # The next sync of that family is full; the other family's is not.
    assert proxier.sync_now() and backend.last.full
    other, other_backend = pairs[V6]
    assert other.sync_now() and not other_backend.last.full


def test_the_first_full_sync_begun_after_the_reports_ends_the_repair(
    caplog: pytest.LogCaptureFixture,
) -> None:
    healer, _, _, _, state, clock = healer_with(V4)
    healer.report(ExternalChange(ChangeKind.TABLE, "table deleted", V4))
    clock.t += 0.5
    healer.report(ExternalChange(ChangeKind.RULE, "rules deleted", V4))
    clock.t += 0.25
    healer.sync_finished(FinishedSync(V4, False, 0.1, None, 1, 1))  # partial: repairs nothing
    healer.sync_finished(FinishedSync(V4, True, 0.1, SyncError("refused"), 1, 1))  # failed
    # A full sync already running at the second report may have listed the kernel
    # before that damage: it does not count.
    healer.sync_finished(FinishedSync(V4, True, 0.3, None, 1, 1))
    assert healer.repairing == {V4}
    caplog.set_level(logging.INFO, logger="kubeproxy.selfheal")
    caplog.clear()
    clock.t += 0.5
    healer.sync_finished(FinishedSync(V4, True, 0.4, None, 1, 1))
    assert healer.repairing == frozenset()
    assert healer.repaired == [(V4, 1.25)]
    assert state.calls == [("diverged", V4), ("diverged", V4), ("restored", V4)]
    (line,) = caplog.records
    assert line.getMessage() == (
        "IPv4 rules repaired 1.25s after someone else changed them (table, rule)"
    )
    # A later full sync with nothing reported is no repair.
    healer.sync_finished(FinishedSync(V4, True, 0.1, None, 1, 1))
    assert healer.repaired == [(V4, 1.25)]
    # The other observer events mean nothing here.
    healer.sync_queued(V4)
    healer.endpoints_trigger_times(V4, [1.0])


def test_recent_repairs_show_what_was_found_how_long_it_took_and_keep_a_bounded_ring() -> None:
    healer, _, _, _, _, clock = healer_with(V4)
    healer.wall_clock = lambda: clock.t + 1_700_000_000.0
    assert healer.recent_repairs() == []
    for n in range(DETAILS_PER_REPAIR + 2):
        healer.report(ExternalChange(ChangeKind.ELEMENT, f"element {n} deleted", V4))
    healer.report(ExternalChange(ChangeKind.TABLE, "table deleted", V4))
    clock.t += 0.5
    healer.sync_finished(FinishedSync(V4, True, 0.1, SyncError("refused"), 1, 1))
    (going,) = healer.recent_repairs()
    assert going["outcome"] == "under way" and going["ended"] is None
    assert going["took_s"] == 0.5 and going["failed_syncs"] == 1
    assert going["last_error"] == "SyncError: refused"
    assert going["reports"] == DETAILS_PER_REPAIR + 3 and going["kinds"] == ["element", "table"]
    assert going["details"] == [f"element {n} deleted" for n in range(DETAILS_PER_REPAIR)]
    clock.t += 0.25
    healer.sync_finished(FinishedSync(V4, True, 0.1, None, 1, 1))
    (done,) = healer.recent_repairs()
    assert done["outcome"] == "repaired" and done["took_s"] == 0.75
    assert done["started"] == "2023-11-14T22:15:00Z" and done["ended"] == "2023-11-14T22:15:00Z"
    assert done["failed_syncs"] == 1 and done["kinds"] == ["element", "table"]
    # The ring keeps the newest KEPT_REPAIRS, newest first, and a repair under way before.
    for n in range(KEPT_REPAIRS + 3):
        healer.report(ExternalChange(ChangeKind.RULE, f"repair {n}", V4))
        clock.t += 20.0  # out of the streak: repaired at once
        healer.sync_finished(FinishedSync(V4, True, 1.0, None, 1, 1))
    healer.report(ExternalChange(ChangeKind.CHAIN, "chain deleted", V4))
    kept = healer.recent_repairs()
    assert len(kept) == KEPT_REPAIRS + 1
    assert kept[0]["outcome"] == "under way" and kept[0]["details"] == ["chain deleted"]
    assert [r["details"][0] for r in kept[1:3]] == [
        f"repair {KEPT_REPAIRS + 2}",
        f"repair {KEPT_REPAIRS + 1}",
    ]
    assert kept[-1]["details"] == ["repair 3"]


def test_a_change_of_no_family_concerns_every_family() -> None:
    healer, pairs, counter, _, _, _ = healer_with(V4, V6)
    healer.report(ExternalChange(ChangeKind.MISSED, "events lost"))
    assert counter.counted == [(V4, "missed-events"), (V6, "missed-events")]
    for proxier, backend in pairs.values():
        assert proxier.sync_now() and backend.last.full


def test_a_change_of_a_family_we_do_not_proxy_is_ignored() -> None:
    healer, _, counter, events, _, _ = healer_with(V4)
    healer.report(ExternalChange(ChangeKind.TABLE, "table ip6 kube-proxy deleted", V6))
    assert counter.counted == [] and events.events == [] and healer.repairing == frozenset()


def test_events_are_posted_at_most_once_a_minute() -> None:
    healer, _, counter, events, _, clock = healer_with(V4)
    for _ in range(3):
        healer.report(ExternalChange(ChangeKind.TABLE, "table deleted", V4))
        clock.t += 20
    clock.t += 10  # 70 s after the first
    healer.report(ExternalChange(ChangeKind.RULE, "rules deleted", V4))
    assert len(counter.counted) == 4
    notes = [e.note for e in events.events]
    assert notes == [
        "table deleted; repairing with a full sync",
        "rules deleted; repairing with a full sync (2 more such changes since the last event)",
    ]


class RequestRecorder:
    """Stands in for a proxier: records full-sync requests (at the fake clock's time)."""

    def __init__(self, family: IPFamily, clock: Clock) -> None:
        self.family = family
        self.clock = clock
        self.requests: list[float] = []

    def request_full_sync(self) -> None:
        self.requests.append(self.clock.t)


def test_repairs_slow_down_when_someone_keeps_undoing_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    start = clock.t
    scheduled: list[tuple[float, Any]] = []
    proxier = RequestRecorder(V4, clock)
    healer = SelfHealer(
        {V4: cast(Proxier, proxier)},
        clock=clock,
        schedule=lambda delay, action: scheduled.append((clock.t + delay, action)),
    )

    def report_at(t: float) -> None:
        clock.t = start + t
        while scheduled and scheduled[0][0] <= clock.t:
            when, action = scheduled.pop(0)
            clock.t = when
            action()
            clock.t = start + t
        healer.report(ExternalChange(ChangeKind.RULE, "rules deleted", V4))

    with caplog.at_level(logging.WARNING, logger="kubeproxy.selfheal"):
        # Another writer undoes our rules every second: five repairs at once, then
        # waits of 1, 2, 4 s; reports while one waits ride on it.
        for second in range(16):
            report_at(second)
    assert [r - start for r in proxier.requests] == [0, 1, 2, 3, 4, 6, 8, 12]
    assert [when - start for when, _ in scheduled] == [12 + 8]
    slowing = [r for r in caplog.records if "keep being changed" in r.getMessage()]
    assert len(slowing) == 1 and "repairing in 1s" in slowing[0].getMessage()
    # Quiet for longer than the streak window: the next one is repaired at once again.
    report_at(40)
    assert proxier.requests[-1] - start == 40


def test_a_failing_metric_or_event_never_stops_the_repair(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def external_change(self, family: IPFamily, kind: str) -> None:
            raise RuntimeError("metrics broke")

        def warning(self, reason: str, action: str, note: str) -> None:
            raise RuntimeError("events broke")

    proxier, backend = make_proxier(V4)
    two_services(proxier)
    initialized(proxier)
    broken: Any = Broken()
    healer = SelfHealer({V4: proxier}, counter=broken, events=broken)
    with caplog.at_level(logging.ERROR, logger="kubeproxy.selfheal"):
        healer.report(ExternalChange(ChangeKind.TABLE, "gone", V4))
    assert len(caplog.records) == 2
    assert proxier.sync_now() and backend.last.full


def test_syncs_held_keeps_syncs_out() -> None:
    healer, pairs, _, _, _, _ = healer_with(V4, V6)
    proxier, backend = pairs[V6]
    synced = threading.Event()
    before = len(backend.syncs)

    def sync() -> None:
        proxier.sync_now()
        synced.set()

    with healer.syncs_held():
        thread = threading.Thread(target=sync)
        thread.start()
        assert not synced.wait(0.2)
        assert len(backend.syncs) == before
    assert synced.wait(5)
    thread.join()


def test_a_request_before_the_proxier_is_initialized_does_nothing() -> None:
    proxier, backend = make_proxier(V4)
    proxier.request_full_sync()
    assert backend.syncs == []
    two_services(proxier)
    initialized(proxier)
    assert backend.syncs and backend.last.full


# --- watchers -----------------------------------------------------------------------------


class Host:
    def __init__(self) -> None:
        self.reports: list[ExternalChange] = []
        self.held = 0

    def report(self, change: ExternalChange) -> None:
        self.reports.append(change)

    repairing: frozenset[IPFamily] = frozenset()

    @contextlib.contextmanager
    def syncs_held(self) -> Iterator[None]:
        self.held += 1
        yield


def run_until(check: PeriodicCheck, host: WatchHost, done: Any) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=check.run, args=(stop, host))
    thread.start()
    deadline = time.monotonic() + 5
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_periodic_check_reports_what_it_finds_while_syncs_are_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes: list[Any] = [
        [],
        RuntimeError("tool missing"),
        [ExternalChange(ChangeKind.CANARY, "gone")],
    ]
    ready = iter([False, True, True, True])

    def check() -> list[ExternalChange]:
        outcome = outcomes.pop(0) if outcomes else []
        if isinstance(outcome, Exception):
            raise outcome
        return list(outcome)

    periodic = PeriodicCheck("test-check", check, 0.001, ready=lambda: next(ready, True))
    host = Host()
    with caplog.at_level(logging.WARNING, logger="kubeproxy.selfheal"):
        run_until(periodic, host, lambda: host.reports)
    assert [r.kind for r in host.reports] == ["canary"]
    assert periodic.checks >= 2 and host.held >= 3
    assert any("tool missing" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        PeriodicCheck("bad", check, 0)


def test_a_periodic_check_waits_while_its_family_is_repaired() -> None:
    calls: list[float] = []

    def check() -> list[ExternalChange]:
        calls.append(time.monotonic())
        return [ExternalChange(ChangeKind.CANARY, "gone", V4)]

    host = Host()
    host.repairing = frozenset({V4})  # another watcher reported it: being repaired
    periodic = PeriodicCheck("canary", check, 0.001, family=V4)
    run_until(periodic, host, lambda: host.held >= 20)
    assert calls == [] and host.reports == []
    host.repairing = frozenset({V6})
    run_until(periodic, host, lambda: bool(host.reports))
    assert calls and [r.family for r in host.reports][:1] == [V4]


def test_a_broken_watcher_is_logged_and_the_proxy_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        name = "broken"

        def run(self, stop: threading.Event, host: WatchHost) -> None:
            raise RuntimeError("watcher bug")

        def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, c: SyncChanges) -> None:
            pass

    healer, _, _, _, _, _ = healer_with(V4)
    with caplog.at_level(logging.ERROR, logger="kubeproxy.selfheal"):
        healer.start([Broken()], threading.Event())
        assert healer.join(5) == []
    (record,) = caplog.records
    assert "Watcher broken failed" in record.getMessage() and record.exc_info


# --- the iptables canary over the in-memory iptables -----------------------------------------


def iptables_backend(
    variant: IptablesVariant = IptablesVariant.NFT,
) -> tuple[IptablesBackend, FakeIptables]:
    fake = FakeIptables(variant)
    return IptablesBackend(V4, ProxierConfig(node_name="n"), executor=fake), fake


def test_the_canary_check_finds_flushed_and_deleted_canaries() -> None:
    backend, fake = iptables_backend()
    world = World()
    world.add(
        ServicePort(spn("web"), ip_address("172.30.0.10"), 80, Protocol.TCP),
        ep("10.244.0.11"),
    )
    assert backend.missing_canaries() == []  # nothing written yet: nothing to compare
    backend.sync(world.snapshot(), SyncChanges(full=True))
    assert backend.missing_canaries() == []
    fake.restore(V4, "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n")  # flushed
    fake.restore(V4, "*nat\n-X KUBE-PROXY-CANARY\nCOMMIT\n")  # deleted
    assert backend.missing_canaries() == ["mangle", "nat"]
    # The mangle canary got its rule back on the way; the nat one waits for the full sync.
    assert backend.missing_canaries() == ["nat"]
    (change,) = canary_watcher(backend)._check()
    assert (change.kind, change.family) == ("canary", V4)
    assert "KUBE-PROXY-CANARY gone from nat" in change.detail
    backend.sync(world.snapshot(), SyncChanges(full=True))
    assert backend.missing_canaries() == []


def test_iptables_watchers_listen_to_events_only_with_iptables_nft() -> None:
    nft_backend, _ = iptables_backend(IptablesVariant.NFT)
    kinds = [type(w) for w in iptables_watchers([nft_backend])]
    assert kinds == [PeriodicCheck, NftablesEventWatcher]
    legacy_backend, _ = iptables_backend(IptablesVariant.LEGACY)
    assert [type(w) for w in iptables_watchers([legacy_backend])] == [PeriodicCheck]


def test_every_mode_has_watchers() -> None:
    from kubeproxy.backends import nftables

    backend = nftables.NftablesBackend(V4, ProxierConfig(node_name="n"), executor=FakeNft())
    watchers = MODES["nftables"].watchers
    assert watchers is not None
    (found,) = watchers([backend], None)
    assert isinstance(found, NftablesEventWatcher)
    assert found.interest.what == "table ip kube-proxy"
    assert all(MODES[m].watchers is not None for m in ("iptables", "ipvs"))


# --- the daemon's wiring -----------------------------------------------------------------


class ReportingWatcher:
    """Reports one change once the proxier has synced, then waits for the stop."""

    name = "test-watcher"

    def __init__(self) -> None:
        self.after = 0

    def run(self, stop: threading.Event, host: WatchHost) -> None:
        while self.after == 0 and not stop.wait(0.01):
            pass
        host.report(ExternalChange(ChangeKind.TABLE, "table ip kube-proxy: 1 table deleted", V4))
        stop.wait()

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.after += 1


def test_the_daemon_runs_the_watchers_and_repairs(tmp_path: Path) -> None:
    (tmp_path / "all.yaml").write_text(
        yaml.safe_dump_all(
            [
                node("kpxe-node", addresses=["203.0.113.7"]),
                service("web", cluster_ip="172.30.0.10"),
                slice_of("web-a", "web", "10.244.0.11"),
            ]
        )
    )
    backends = FakeBackends()
    watcher = ReportingWatcher()
    gc_ops, _ = recording_gc()
    daemon = build_daemon(
        options_for("--manifests", str(tmp_path), "--iptables-min-sync-period=10ms"),
        backends,
        plugins=DaemonPlugins(watchers=lambda found, netns: [watcher]),
        seams=DaemonSeams(privileged=False, ipv6_supported=False, gc_ops=gc_ops),
    )
    assert daemon.watchers == (watcher,)
    metrics: ProxyMetrics = daemon.metrics
    try:
        daemon.start()
        deadline = time.monotonic() + 5
        while not daemon.healer.repaired and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        daemon.stop()
    assert daemon.healer.repaired and daemon.healer.repaired[0][0] is V4
    assert watcher.after >= 2  # the first sync, and the repairing one
    text = metrics.expose().decode()
    assert (
        'kubeproxy_sync_proxy_rules_external_changes_total{ip_family="IPv4",kind="table"} 1' in text
    )
    assert (
        'kubeproxy_sync_proxy_rules_external_changes_total{ip_family="IPv4",kind="rule"} 0' in text
    )
    assert daemon.healer.join(1) == []


def test_healthz_fails_from_the_report_until_the_repair() -> None:
    proxier, _ = make_proxier(V4)
    health = ProxyHealth(60.0)
    healer = SelfHealer({V4: proxier}, kernel_state=health)
    assert health.health().serving
    healer.report(ExternalChange(ChangeKind.TABLE, "table ip kube-proxy: 1 table deleted", V4))
    status = health.health()
    assert not status.serving
    body = json.loads(status.to_json(last_updated=None, node_eligible=True, with_faults=True))
    assert body["healthy"] is False
    assert body["reason"] == (
        "IPv4: rules changed by someone else, repairing: table ip kube-proxy: 1 table deleted"
    )
    healer.sync_finished(FinishedSync(V4, False, 0.0, None, 1, 1))
    assert not health.health().serving  # a partial sync repairs nothing
    healer.sync_finished(FinishedSync(V4, True, 0.0, None, 1, 1))
    assert health.health().serving
