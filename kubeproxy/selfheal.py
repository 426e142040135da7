"""Self-healing: when someone else changes our kernel rules, put them back at once.

Firewall reloads (``nft flush ruleset``, firewalld's reload, an appliance's
``nft -f /etc/nftables.conf``) and careless operators remove a proxy's rules without
telling it. Without help the proxy notices only at its next full sync (an hour by
default): every Service on the node is dead until then.

The pieces:

* a :class:`Watcher` (backend-specific, started by the binary) notices a change made by
  someone else and reports it as an :class:`ExternalChange` to its :class:`WatchHost`;
  nf_tables events (:mod:`kubeproxy.nftevents`) in nftables and iptables-nft modes, a
  :class:`PeriodicCheck` of the iptables canary chains in iptables modes;
* the :class:`SelfHealer` is that host: for each report it logs one line saying what was
  found changed, counts it (``kubeproxy_sync_proxy_rules_external_changes_total`` by
  ``kind``), posts a Warning Event about the Node (at most one a minute), tells the health
  state (:class:`KernelStateReporter`, the daemon's
  :class:`~kubeproxy.health.ProxyHealth`: ``/healthz`` answers 503 with what was found
  until the repair) and asks the proxier of the family for a full sync
  (:meth:`~kubeproxy.proxier.Proxier.request_full_sync`, coalesced by its runner, so a
  burst of reports costs one sync). Once a full sync has succeeded after the reports, it
  logs how long the repair took and tells the health state again.

Two writers that each repair what the other writes never stop (a second proxy on the
node during a rolling update with surge, say, or a firewall reloading in a loop). So
when a family's reports keep coming, each within :data:`STREAK_WINDOW` of the last, the
first :data:`FREE_REPAIRS` are repaired at once and later ones after 1 s, 2 s, 4 s... up
to :data:`MAX_REPAIR_DELAY` (said once in the log): the fight slows down to one full sync
every half minute instead of one a second.

The healer keeps its last :data:`KEPT_REPAIRS` repairs (and those under way) for
``/debug/repairs`` (:meth:`SelfHealer.recent_repairs`): what was reported, when, how
long the repair took, the syncs that failed meanwhile.

A watcher sees only what changed, never what it means: reacting with a full sync keeps
every backend's structure its own business.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from kubeproxy.events import ACTION_REPAIR, REASON_RULES_CHANGED_EXTERNALLY
from kubeproxy.health import FAULT_RULES_REMOVED
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import FinishedSync, NullObserver

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.events import EventSink
    from kubeproxy.proxier import Proxier

__all__ = [
    "EVENT_INTERVAL",
    "FREE_REPAIRS",
    "KEPT_REPAIRS",
    "MAX_REPAIR_DELAY",
    "STREAK_WINDOW",
    "ChangeKind",
    "ExternalChange",
    "ExternalChangeCounter",
    "KernelStateReporter",
    "PeriodicCheck",
    "RepairRecord",
    "SelfHealer",
    "WatchHost",
    "Watcher",
    "utc_text",
]

logger = logging.getLogger(__name__)


class ChangeKind(enum.StrEnum):
    """What someone else changed in our rules: the ``kind`` label of
    ``kubeproxy_sync_proxy_rules_external_changes_total`` and what ``/debug/repairs``
    lists. A closed set (the metric's label values are created for every member, most
    serious first); a member is the string it stands for, so labels and pages read the
    values below."""

    TABLE = "table"
    """A table of ours was deleted (also what ``nft flush ruleset`` does)."""
    CHAIN = "chain"
    """A chain of ours was deleted."""
    SET = "set"
    """A set or map of ours was deleted."""
    RULE = "rule"
    """Rules of ours were deleted (``nft flush chain``, ``iptables -F``, ``iptables -D``)."""
    ELEMENT = "element"
    """Elements of our sets or maps were deleted."""
    OBJECT = "object"
    """Another object of our tables (a stateful object, a flowtable) was deleted."""
    OTHER = "other"
    """Something was added to our tables or chains (nothing of ours went missing)."""
    CANARY = "canary"
    """A canary chain was gone or flushed (iptables modes: someone flushed the tables)."""
    MISSED = "missed-events"
    """Change events were lost, or cannot be had: we compare with the kernel to be sure."""


EVENT_INTERVAL: Final = 60.0
"""At most one Event a minute: a firewall reloading in a loop must not flood the API."""

STREAK_WINDOW: Final = 10.0
"""Reports of a family closer than this to the previous one make a streak."""

FREE_REPAIRS: Final = 5
"""Repairs of a streak done at once; later ones wait 1 s, 2 s, 4 s... (see below)."""

MAX_REPAIR_DELAY: Final = 30.0
"""The longest wait of a repair in a streak."""

KEPT_REPAIRS: Final = 50
"""Finished repairs kept for ``/debug/repairs`` (a ring: the oldest go)."""

DETAILS_PER_REPAIR: Final = 5
"""Reports' details kept per repair (a firewall reloading in a loop sends hundreds; the
others are counted)."""


@dataclass(frozen=True, slots=True)
class RepairRecord:
    """One repair as ``/debug/repairs`` shows it: the family, when the first report came
    (wall-clock seconds) and when the repairing full sync ended (None: under way), how
    many reports it took in, their kinds and first :data:`DETAILS_PER_REPAIR` details,
    the syncs of the family that failed meanwhile and the last one's error."""

    family: str
    started: float
    ended: float | None
    took_s: float
    reports: int
    kinds: tuple[str, ...]
    details: tuple[str, ...]
    failed_syncs: int = 0
    last_error: str | None = None

    def as_json(self) -> dict[str, Any]:
        """Plain data (times as UTC ISO 8601)."""
        return {
            "family": self.family,
            "outcome": "repaired" if self.ended is not None else "under way",
            "started": utc_text(self.started),
            "ended": None if self.ended is None else utc_text(self.ended),
            "took_s": round(self.took_s, 3),
            "reports": self.reports,
            "kinds": list(self.kinds),
            "details": list(self.details),
            "failed_syncs": self.failed_syncs,
            "last_error": self.last_error,
        }


def utc_text(seconds: float) -> str:
    """Wall-clock ``seconds`` as UTC ISO 8601 to the second, as the ``/debug/`` pages show
    times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass(frozen=True, slots=True)
class ExternalChange:
    """Someone else changed our rules: ``kind`` (for the metric),
    ``detail`` (what was found, for the log line and the Event) and the family it
    concerns (``None``: every family, or no telling which)."""

    kind: ChangeKind
    detail: str
    family: IPFamily | None = None


class WatchHost(Protocol):
    """What a :class:`Watcher` reports to, and how it keeps out of the syncs' way."""

    def report(self, change: ExternalChange) -> None:
        """A change by someone else was found (never blocks for long)."""
        ...

    def syncs_held(self) -> contextlib.AbstractContextManager[None]:
        """A block in which none of our syncs runs (for checks that our own half-done
        sync would fool)."""
        ...

    @property
    def repairing(self) -> frozenset[IPFamily]:
        """The families whose repair was asked for and has not completed yet."""
        ...


class Watcher(Protocol):
    """Notices changes of our kernel state made by others (one thread each)."""

    @property
    def name(self) -> str:
        """For the thread name and log lines."""
        ...

    def run(self, stop: threading.Event, host: WatchHost) -> None:
        """Watch until ``stop`` is set, reporting to ``host``."""
        ...

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Called after each of our successful syncs (a
        :class:`~kubeproxy.proxier.SyncHook`)."""
        ...


class ExternalChangeCounter(Protocol):
    """Counts repairs (:class:`~kubeproxy.metrics.ProxyMetrics` implements it)."""

    def external_change(self, family: IPFamily, kind: str) -> None:
        """One external change of ``kind`` found in ``family``."""
        ...


class KernelStateReporter(Protocol):
    """Where the health state learns that the kernel no longer holds what we wrote
    (:class:`~kubeproxy.health.ProxyHealth` is one: ``/healthz`` then answers 503 with
    the reason, and HealthCheckNodePorts too, until the repair). The self-healer reports
    with the cause :data:`~kubeproxy.health.FAULT_RULES_REMOVED`."""

    def report_data_plane_broken(self, family: IPFamily, cause: str, reason: str) -> None:
        """The kernel lost rules of ``family`` (``reason``); a repair is under way."""
        ...

    def report_data_plane_repaired(self, family: IPFamily, cause: str) -> None:
        """The repair of ``family`` succeeded."""
        ...


class _Repair:
    """A family's repair under way: since when (monotonic, and wall-clock), the latest
    report, what was found, and the syncs that failed meanwhile."""

    __slots__ = ("details", "error", "failed", "kinds", "latest", "reports", "since", "wall")

    def __init__(self, since: float, wall: float) -> None:
        self.since = since
        self.wall = wall
        self.latest = since
        self.kinds: list[str] = []
        self.details: list[str] = []
        self.reports = 0
        self.failed = 0
        self.error: str | None = None

    def record(self, family: IPFamily, took: float, ended: float | None) -> RepairRecord:
        return RepairRecord(
            str(family),
            self.wall,
            ended,
            took,
            self.reports,
            tuple(self.kinds),
            tuple(self.details),
            self.failed,
            self.error,
        )


class _Streak:
    """Reports of a family coming one shortly after the other."""

    __slots__ = ("count", "delayed", "last", "pending")

    def __init__(self) -> None:
        self.count = 0
        self.delayed = 0
        self.last = 0.0
        self.pending = False


def _start_timer(delay: float, action: Callable[[], None]) -> None:
    timer = threading.Timer(delay, action)
    timer.daemon = True
    timer.start()


class SelfHealer(NullObserver):
    """The :class:`WatchHost` of the binaries: reports become full syncs, log lines,
    metrics, Events and health changes (see the module documentation).

    ``proxiers`` by family; ``counter``, ``events`` and ``kernel_state`` are optional.
    It hears every sync of every proxier as a :class:`~kubeproxy.proxier.SyncObserver`
    (the daemon puts it in their observers): a successful full sync that *started* after
    the latest report of its family ends the repair (one already running when the damage
    was done may have listed the kernel before it). ``clock`` is monotonic seconds, the
    proxiers' clock, ``wall_clock`` wall-clock seconds (for :meth:`recent_repairs`);
    ``schedule(delay, action)`` runs a delayed repair request (a daemon timer thread).
    """

    def __init__(
        self,
        proxiers: Mapping[IPFamily, Proxier],
        *,
        counter: ExternalChangeCounter | None = None,
        events: EventSink | None = None,
        kernel_state: KernelStateReporter | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        event_interval: float = EVENT_INTERVAL,
        schedule: Callable[[float, Callable[[], None]], None] = _start_timer,
    ) -> None:
        self.proxiers = dict(proxiers)
        self.counter = counter
        self.events = events
        self.kernel_state = kernel_state
        self.clock = clock
        self.wall_clock = wall_clock
        self.event_interval = event_interval
        self._lock = threading.Lock()
        self._repairs: dict[IPFamily, _Repair] = {}
        self._last_event: float | None = None
        self._unposted = 0
        self._schedule = schedule
        self._streaks: dict[IPFamily, _Streak] = {}
        self.reports: list[ExternalChange] = []
        """Every change reported, in order (for tests and debugging; bounded)."""
        self.repaired: list[tuple[IPFamily, float]] = []
        """(family, seconds from the first report to the repairing sync's end), in order
        (bounded)."""
        self._done: collections.deque[RepairRecord] = collections.deque(maxlen=KEPT_REPAIRS)
        self._threads: list[threading.Thread] = []

    # WatchHost ----------------------------------------------------------------------------

    def report(self, change: ExternalChange) -> None:
        """Log, count, post and request the full sync(s)."""
        families = [change.family] if change.family is not None else list(self.proxiers)
        families = [f for f in families if f in self.proxiers]
        if not families:
            logger.debug("external change about a family we do not proxy: %s", change.detail)
            return
        now = self.clock()
        wall = self.wall_clock()
        with self._lock:
            self.reports.append(change)
            del self.reports[:-1000]
            for family in families:
                repair = self._repairs.get(family)
                if repair is None:
                    repair = self._repairs[family] = _Repair(now, wall)
                if change.kind not in repair.kinds:
                    repair.kinds.append(change.kind)
                if len(repair.details) < DETAILS_PER_REPAIR:
                    repair.details.append(change.detail)
                repair.reports += 1
                repair.latest = now
        logger.warning(
            "Rules changed by someone else (%s, %s): %s; full sync requested",
            "/".join(str(f) for f in families),
            change.kind,
            change.detail,
        )
        for family in families:
            if self.counter is not None:
                _safely(self.counter.external_change, family, change.kind)
            if self.kernel_state is not None:
                _safely(
                    self.kernel_state.report_data_plane_broken,
                    family,
                    FAULT_RULES_REMOVED,
                    f"rules changed by someone else, repairing: {change.detail}",
                )
        self._post(change, now)
        for family in families:
            delay = self._delay(family, now)
            if delay is None:
                continue  # a delayed request is already waiting
            if delay == 0:
                self.proxiers[family].request_full_sync()
            else:
                self._schedule(delay, functools.partial(self._request_late, family))

    def _delay(self, family: IPFamily, now: float) -> float | None:
        """0 to repair at once, the seconds to wait in a long streak, or None when a
        delayed repair is already on its way."""
        with self._lock:
            streak = self._streaks.get(family)
            if streak is None or now - streak.last > STREAK_WINDOW:
                streak = self._streaks[family] = _Streak()
            streak.count += 1
            streak.last = now
            if streak.count <= FREE_REPAIRS:
                return 0.0
            if streak.pending:
                return None
            streak.pending = True
            streak.delayed += 1
            delay = min(2.0 ** (streak.delayed - 1), MAX_REPAIR_DELAY)
        level = logging.WARNING if streak.delayed == 1 else logging.DEBUG
        logger.log(
            level,
            "%s rules keep being changed by someone else (%d times, each within %gs of the "
            "last: another proxy on this node, or a firewall reloading in a loop?); "
            "repairing in %gs, then less and less often while it goes on",
            family,
            streak.count,
            STREAK_WINDOW,
            delay,
        )
        return delay

    def _request_late(self, family: IPFamily) -> None:
        with self._lock:
            streak = self._streaks.get(family)
            if streak is not None:
                streak.pending = False
        self.proxiers[family].request_full_sync()

    @contextlib.contextmanager
    def syncs_held(self) -> Iterator[None]:
        """Hold every proxier's sync lock (in family order, so two holders cannot cross)."""
        with contextlib.ExitStack() as stack:
            for family in sorted(self.proxiers, key=lambda f: f.value):
                stack.enter_context(self.proxiers[family].syncs_held())
            yield

    # SyncObserver (the other events are NullObserver's no-ops) --------------------------------

    def sync_finished(self, sync: FinishedSync) -> None:
        """A successful full sync begun after the family's latest report ends its repair
        (a failed sync meanwhile is counted in it)."""
        family, error = sync.family, sync.error
        if error is not None:
            with self._lock:
                failing = self._repairs.get(family)
                if failing is not None:
                    failing.failed += 1
                    failing.error = f"{type(error).__name__}: {error}"
            return
        if not sync.full:
            return
        now = self.clock()
        with self._lock:
            repair = self._repairs.get(family)
            if repair is None or now - sync.duration < repair.latest:
                return
            del self._repairs[family]
            took = now - repair.since
            self.repaired.append((family, took))
            del self.repaired[:-1000]
            self._done.appendleft(repair.record(family, took, self.wall_clock()))
        logger.info(
            "%s rules repaired %.2fs after someone else changed them (%s)",
            family,
            took,
            ", ".join(repair.kinds),
        )
        if self.kernel_state is not None:
            _safely(self.kernel_state.report_data_plane_repaired, family, FAULT_RULES_REMOVED)

    def recent_repairs(self) -> list[dict[str, Any]]:
        """The repairs under way, then the last :data:`KEPT_REPAIRS` finished ones, newest
        first, as plain data (``/debug/repairs``)."""
        now = self.clock()
        with self._lock:
            going = [
                r.record(f, now - r.since, None)
                for f, r in sorted(self._repairs.items(), key=lambda i: i[1].since, reverse=True)
            ]
            records = [*going, *self._done]
        return [r.as_json() for r in records]

    @property
    def repairing(self) -> frozenset[IPFamily]:
        """The families whose repair has not completed yet."""
        with self._lock:
            return frozenset(self._repairs)

    # Running watchers -------------------------------------------------------------------------

    def start(self, watchers: Sequence[Watcher], stop: threading.Event) -> None:
        """Run each watcher in a thread of its own until ``stop`` is set."""
        for watcher in watchers:
            thread = threading.Thread(
                target=self._run_watcher,
                args=(watcher, stop),
                name=f"watch-{watcher.name}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def join(self, timeout: float) -> list[str]:
        """Wait for the watcher threads; the names of those still running."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]

    def _run_watcher(self, watcher: Watcher, stop: threading.Event) -> None:
        try:
            watcher.run(stop, self)
        except Exception:  # a broken watcher must not take the proxy down
            logger.exception(
                "Watcher %s failed; changes by others are now found by the periodic full sync only",
                watcher.name,
            )

    def _post(self, change: ExternalChange, now: float) -> None:
        if self.events is None:
            return
        with self._lock:
            if self._last_event is not None and now - self._last_event < self.event_interval:
                self._unposted += 1
                return
            self._last_event = now
            unposted, self._unposted = self._unposted, 0
        note = f"{change.detail}; repairing with a full sync"
        if unposted:
            note += f" ({unposted} more such changes since the last event)"
        _safely(self.events.warning, REASON_RULES_CHANGED_EXTERNALLY, ACTION_REPAIR, note)


def _safely(callback: Callable[..., None], *args: object) -> None:
    try:
        callback(*args)
    except Exception:  # metrics, events and health must never stop a repair
        logger.exception("self-healing callback %r failed", callback)


class PeriodicCheck:
    """A :class:`Watcher` that runs ``check`` every ``interval`` seconds, while our syncs
    are held off, and reports what it returns.

    ``check`` returns the changes found (an empty list when all is well); ``ready`` says
    whether checking makes sense yet (e.g. not before our first full sync wrote what is
    checked). A check of ``family`` is skipped while that family's repair is under way:
    what it would find is what is being repaired (another watcher reported it first).
    """

    def __init__(
        self,
        name: str,
        check: Callable[[], list[ExternalChange]],
        interval: float,
        *,
        ready: Callable[[], bool] = lambda: True,
        family: IPFamily | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"{name}: the check interval must be positive, not {interval}")
        self._name = name
        self._check = check
        self.interval = interval
        self._ready = ready
        self.family = family
        self.checks = 0
        """How many checks ran (for tests)."""

    @property
    def name(self) -> str:
        """For the thread name and log lines."""
        return self._name

    def run(self, stop: threading.Event, host: WatchHost) -> None:
        """Check every ``interval`` seconds until ``stop`` is set."""
        logger.info("Checking %s every %gs", self._name, self.interval)
        while not stop.wait(self.interval):
            if not self._ready():
                continue
            try:
                with host.syncs_held():
                    if self.family in host.repairing:
                        continue
                    found = self._check()
                    self.checks += 1
            except Exception as err:  # a failing check must not end the checking
                logger.warning("%s: check failed: %s", self._name, err)
                continue
            if self.family in host.repairing:
                continue  # reported meanwhile by another watcher (events come first)
            for change in found:
                host.report(change)

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Nothing to do after a sync."""
