"""The proxy modes as the binaries see them: backend, dry run, sync hooks and cleanup.

Each :class:`Mode` says how to make its backend (imported only when the mode is used, so
one mode's missing kernel tool never stops another), what ``--dry-run`` writes into
instead of the kernel, which backend-specific metrics to wire, and how to remove
everything the mode ever made. Cleanup across modes follows upstream's
``platformCleanup`` (``cmd/kube-proxy/app/server_linux.go``), once our first sync is in
(:mod:`kubeproxy.cmd.takeover`): nftables mode removes what the iptables and ipvs modes
left; iptables or ipvs mode removes the nftables tables; ``--cleanup`` removes all of it
(:func:`cleanup_all`), ``--cleanup-leftovers`` what only we make and upstream leaves
(:func:`cleanup_leftovers`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, TextIO, runtime_checkable

from kubeproxy.backend import Backend, BackendFactory
from kubeproxy.config import ProxierConfig
from kubeproxy.daemon import BackendContext, BackendHooks, WatcherFactory
from kubeproxy.debugpages import DebugState, ModePages
from kubeproxy.entrypoints import BackendNotFound, backend_entry_point, load_backend
from kubeproxy.host.capabilities import CAP_NET_ADMIN
from kubeproxy.host.httpserving import Route
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import FinishedSync, NullObserver, Proxier, SyncHook, SyncObserver

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.selfheal import Watcher

__all__ = [
    "IPTABLES_BASED",
    "IPTABLES_HOOKS",
    "MODES",
    "NFTABLES_HOOKS",
    "XTABLES_LOCK_WAIT",
    "BackendCounters",
    "CleanupFailureCounter",
    "DryRun",
    "IPVSDryRun",
    "IptablesCounters",
    "IptablesDryRun",
    "Mode",
    "NftablesDryRun",
    "cleanup_all",
    "cleanup_leftovers",
    "cleanup_modes",
    "iptables_hooks",
    "nftables_hooks",
    "platform_cleanup",
]

logger = logging.getLogger(__name__)

IPTABLES_BASED: Final = frozenset({"iptables", "ipvs"})
"""Modes that program iptables (upstream's ``isIPTablesBased``)."""

_KERNEL_LACKS: Final = "kernel lacks"


def _module(name: str, part: str = "") -> Any:
    """The package of the backend registered as ``name`` (or its module ``part``): found
    through its entry point (:mod:`kubeproxy.entrypoints`), as every backend is."""
    package = backend_entry_point(name).module
    return importlib.import_module(f"{package}.{part}" if part else package)


# --- backend-specific metrics -------------------------------------------------------------


class CleanupFailureCounter:
    """A sync hook counting the nftables backend's failed stale-object cleanups in
    ``kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total``."""

    def __init__(self, backend: Any, metrics: ProxyMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self._seen: int = backend.stale_chain_failures

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Count the failures since the last call."""
        current: int = self.backend.stale_chain_failures
        for _ in range(current - self._seen):
            self.metrics.nftables_cleanup_failed(snapshot.family)
        self._seen = current


@runtime_checkable
class IptablesCounters(Protocol):
    """What an iptables-restore based backend counts (the iptables and ipvs backends)."""

    restore_failures: int


def _counts(backend: object, name: str) -> Mapping[str, int] | None:
    value = getattr(backend, name, None)
    return value if isinstance(value, Mapping) else None


class BackendCounters(NullObserver):
    """A :class:`~kubeproxy.proxier.SyncObserver` feeding an iptables-restore based
    backend's own counts into the metrics after every sync of its family (failed ones
    too): ``..._iptables_restore_failures_total`` from ``restore_failures``,
    ``..._iptables_partial_restore_failures_total`` from ``partial_restore_failures``, and
    the ``..._iptables_total`` / ``..._iptables_last`` gauges from the ``rules_total`` /
    ``rules_last`` dicts (by table), where the backend has them.

    The backend's count replaces the metrics' own counting of failed syncs
    (:meth:`~kubeproxy.metrics.ProxyMetrics.count_failures_from_backend`): upstream counts
    failed restores, and only the backend knows how many of a sync's restores failed.
    The other observer events are ignored (:class:`~kubeproxy.proxier.NullObserver`).
    """

    def __init__(self, backend: IptablesCounters, metrics: ProxyMetrics) -> None:
        self.backend = backend
        self.metrics = metrics
        self.family: IPFamily = getattr(backend, "family", IPFamily.IPV4)
        self._restore = backend.restore_failures
        self._partial: int = getattr(backend, "partial_restore_failures", 0)
        metrics.count_failures_from_backend()

    def sync_finished(self, sync: FinishedSync) -> None:
        """Read the backend's counters (only for a sync of this backend's family)."""
        family = sync.family
        if family is not self.family:
            return
        restore = self.backend.restore_failures
        self.metrics.restore_failed(family, restore - self._restore)
        self._restore = restore
        partial: int = getattr(self.backend, "partial_restore_failures", 0)
        for _ in range(partial - self._partial):
            self.metrics.iptables_partial_restore_failed(family)
        self._partial = partial
        total = _counts(self.backend, "rules_total")
        last = _counts(self.backend, "rules_last")
        if total is not None and last is not None:
            for table in sorted(set(total) | set(last)):
                self.metrics.iptables_rules(family, table, total.get(table, 0), last.get(table, 0))


def nftables_hooks(backend: Backend, metrics: ProxyMetrics) -> Sequence[SyncHook | SyncObserver]:
    """nftables mode: the stale-chain cleanup failure counter, the session affinity
    counter (``kubeproxy_nftables_affinity_unrecorded_connections_total``), the sweeper
    deleting what a restart or a failed sync left without waiting for a change (with its
    ``..._nftables_stale_objects`` gauge), and the localhost NodePort metrics of a backend
    with the ``KubeProxyNFTablesLocalhostNodePorts`` gate on."""
    if hasattr(backend, "rejected_packets"):
        localhost = _module("nftables", "localhost")
        localhost.report_metrics(metrics.registry, backend)
    hooks: list[SyncHook | SyncObserver] = []
    if hasattr(backend, "stale_chain_failures"):
        hooks.append(CleanupFailureCounter(backend, metrics))
    if hasattr(backend, "affinity_unrecorded"):
        _module("nftables", "affinity_metrics").report_affinity(metrics.registry, backend)
    if hasattr(backend, "collect_stale"):
        sweeper = _module("nftables", "sweeper")
        sweeper.report_stale_objects(metrics.registry, backend)
        hooks.append(sweeper.StaleSweeper(backend))
    return tuple(hooks)


def iptables_hooks(backend: Backend, metrics: ProxyMetrics) -> Sequence[SyncHook | SyncObserver]:
    """iptables and ipvs modes: the backend's restore counters (:class:`BackendCounters`),
    and its nfacct packet counters (``packet_counts``, iptables mode) for the scrapes.

    A backend without ``restore_failures`` (our ipvs backend counts ``sync_failures``, any
    kernel refusal) gets none: each failed sync then counts once in
    ``..._iptables_restore_failures_total``, the metrics' own way.
    """
    packet_counts = getattr(backend, "packet_counts", None)
    if callable(packet_counts) and getattr(backend, "nfacct_counters", None):
        metrics.count_packets(packet_counts)
    if isinstance(backend, IptablesCounters):
        return (BackendCounters(backend, metrics),)
    return ()


def _per_backend(
    hooks: Callable[[Backend, ProxyMetrics], Sequence[SyncHook | SyncObserver]],
) -> BackendHooks:
    """``hooks`` as the daemon calls them, with the backend's context."""

    def wire(context: BackendContext) -> Sequence[SyncHook | SyncObserver]:
        return hooks(context.backend, context.metrics)

    return wire


NFTABLES_HOOKS: Final = _per_backend(nftables_hooks)
"""nftables mode's backend hooks for the daemon (:func:`nftables_hooks`)."""

IPTABLES_HOOKS: Final = _per_backend(iptables_hooks)
"""iptables and ipvs modes' backend hooks for the daemon (:func:`iptables_hooks`)."""


# --- dry runs -----------------------------------------------------------------------------


class DryRun(Protocol):
    """A backend factory writing into in-memory fakes, and the printing of what it got."""

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        """A backend over a fresh fake."""
        ...

    def print(self, out: TextIO) -> None:
        """Write what the backends sent to their fakes."""
        ...


class NftablesDryRun:
    """nftables mode's dry run: :class:`~kubeproxy.backends.nftables.fake.FakeNft`; prints
    the transactions (``nft -f`` text)."""

    def __init__(self) -> None:
        self.fakes: list[Any] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        """A backend over a fresh fake."""
        nftables = _module("nftables")
        fake = _module("nftables", "fake").FakeNft()
        self.fakes.append(fake)
        backend: Backend = nftables.NftablesBackend(family, config, executor=fake)
        return backend

    def print(self, out: TextIO) -> None:
        """Every transaction, in order."""
        for fake in self.fakes:
            for tx in fake.transactions:
                out.write(tx.render())


class IptablesDryRun:
    """iptables mode's dry run: ``FakeIptables``; prints every iptables-restore input,
    each after a comment line naming its family."""

    def __init__(self) -> None:
        self.fakes: list[Any] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        """A backend over a fresh fake."""
        iptables = _module("iptables")
        fake = _module("iptables", "fake").FakeIptables()
        self.fakes.append(fake)
        backend: Backend = iptables.IptablesBackend(family, config, executor=fake)
        return backend

    def print(self, out: TextIO) -> None:
        """Every restore input, in order."""
        for fake in self.fakes:
            for family, text in fake.restores:
                command = "iptables-restore" if family is IPFamily.IPV4 else "ip6tables-restore"
                out.write(f"# {command} --noflush\n{text}")
                if not text.endswith("\n"):
                    out.write("\n")


class IPVSDryRun:
    """ipvs mode's dry run: the ipvs package's fakes for IPVS, ``kube-ipvs0`` and ipsets,
    ``FakeIptables`` for the rules; prints, per family, the IPVS and link operations, the
    ``ipset restore`` batches and the iptables-restore inputs."""

    def __init__(self) -> None:
        self.fakes: list[tuple[IPFamily, Any, Any, Any, Any]] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> Backend:
        """A backend over fresh fakes."""
        ipvs = _module("ipvs")
        fakes = _module("ipvs", "fake")
        iptables_fake = _module("iptables", "fake")
        parts = (fakes.FakeIPVS(), fakes.FakeLinks(), fakes.FakeIPSets())
        rules = iptables_fake.FakeIptables()
        self.fakes.append((family, *parts, rules))
        backend: Backend = ipvs.IPVSBackend(
            family, config, ipvs=parts[0], links=parts[1], ipsets=parts[2], iptables=rules
        )
        return backend

    def print(self, out: TextIO) -> None:
        """Every operation, by family and kind."""
        for family, ipvs, links, ipsets, rules in self.fakes:
            out.write(f"# {family} IPVS operations\n")
            out.writelines(f"{op}\n" for op in ipvs.operations)
            out.write(f"# {family} link operations\n")
            out.writelines(f"{op}\n" for op in links.operations)
            for batch in filter(None, ipsets.restores):
                out.write(f"# {family} ipset restore -exist\n{batch}")
                if not batch.endswith("\n"):
                    out.write("\n")
            for _family, text in rules.restores:
                command = "iptables-restore" if family is IPFamily.IPV4 else "ip6tables-restore"
                out.write(f"# {command} --noflush\n{text}")
                if not text.endswith("\n"):
                    out.write("\n")


# --- the modes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mode:
    """One proxy mode as a binary runs it.

    ``factory()`` returns the backend factory (importing the backend then);
    ``cleanup(netns)`` removes everything the mode ever made in the current namespace or
    ``netns`` (raising on a real error; an error saying ``kernel lacks ...`` means there
    can be nothing to remove); ``dry_run()`` makes a :class:`DryRun` (None: not
    available); ``hooks`` wires the mode's own metrics; ``capabilities`` are those the
    mode cannot work without (``CAP_NET_ADMIN`` for ours), checked before anything else;
    ``watchers(backends, netns)`` makes what finds changes others make to the mode's
    rules (self-healing; None: none); ``leftovers(netns)`` removes what only our
    proxy makes in this mode and upstream's kube-proxy leaves when it takes the node back
    (``--cleanup-leftovers``; None: nothing of the kind); ``handover(netns, stop)`` is
    ``cleanup`` once another mode serves the node, letting established connections that
    still need this mode's state end first (ipvs mode's IPVS connections; None: the
    cleanup does it); ``debug_pages`` are the mode's own ``/debug/`` pages
    (:data:`~kubeproxy.debugpages.ModePages`; None: the core's only).
    """

    name: str
    factory: Callable[[], BackendFactory]
    cleanup: Callable[[str | None], None]
    hooks: BackendHooks
    dry_run: Callable[[], DryRun] | None = None
    capabilities: tuple[str, ...] = ()
    watchers: WatcherFactory | None = None
    leftovers: Callable[[str | None], None] | None = None
    handover: Callable[[str | None, threading.Event], None] | None = None
    debug_pages: ModePages | None = None

    @property
    def iptables_based(self) -> bool:
        """Whether the mode programs iptables (upstream's ``isIPTablesBased``)."""
        return self.name in IPTABLES_BASED


XTABLES_LOCK_WAIT: Final = 30.0
"""Seconds an iptables-legacy cleanup waits for the host-wide xtables lock (a one-shot
cleanup can wait for whoever holds it, kubelet say, rather than fail; syncs keep the
backend's own, shorter wait)."""


def _backend_mode(
    name: str,
    hooks: BackendHooks,
    dry_run: Callable[[], DryRun] | None,
    **cleanup_options: Any,
) -> Mode:
    def factory() -> BackendFactory:
        return load_backend(name)

    def installed() -> Any:
        """The backend's package; None in an installation without it (which never made
        anything with it)."""
        try:
            entry = backend_entry_point(name)
            return importlib.import_module(entry.module)
        except (BackendNotFound, ModuleNotFoundError) as err:
            if isinstance(err, ModuleNotFoundError) and err.name != entry.module:
                raise
            logger.warning("%s mode is not part of this installation: nothing to remove", name)
            return None

    def cleanup(netns: str | None) -> None:
        module = installed()
        if module is not None:
            module.cleanup(netns=netns, **cleanup_options)

    def leftovers(netns: str | None) -> None:
        module = installed()
        remove = getattr(module, "cleanup_leftovers", None)
        if remove is not None:
            remove(netns=netns, **cleanup_options)

    def handover(netns: str | None, stop: threading.Event) -> None:
        module = installed()
        hand = getattr(module, "handover", None)
        if hand is not None:
            hand(netns=netns, stop=stop)
        elif module is not None:
            module.cleanup(netns=netns, **cleanup_options)

    def watchers(backends: Sequence[Backend], netns: str | None) -> Sequence[Watcher]:
        found: Sequence[Watcher] = _module(name).watchers(backends, netns)
        return found

    return Mode(
        name, factory, cleanup, hooks, dry_run, (CAP_NET_ADMIN,), watchers, leftovers, handover
    )


def _nftables_pages(state: DebugState, netns: str | None) -> Mapping[str, Route]:
    """nftables mode's ``/debug/`` pages (the backend imported only when they are on)."""
    found: Mapping[str, Route] = _module("nftables", "debugpages").pages(state, netns)
    return found


MODES: Final[Mapping[str, Mode]] = {
    "nftables": dataclasses.replace(
        _backend_mode("nftables", NFTABLES_HOOKS, NftablesDryRun), debug_pages=_nftables_pages
    ),
    "iptables": _backend_mode("iptables", IPTABLES_HOOKS, IptablesDryRun, wait=XTABLES_LOCK_WAIT),
    "ipvs": _backend_mode("ipvs", IPTABLES_HOOKS, IPVSDryRun),
}
"""Our modes, in the order ``--cleanup`` removes their leftovers."""


# --- cleanup ------------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def cleanup_modes(
    modes: Iterable[Mode], netns: str | None = None, *, stop: threading.Event | None = None
) -> list[str]:
    """Run the cleanup of each mode in turn; the errors, one line each (``mode: why``).

    With ``stop`` (another mode serves the node now) a mode's ``handover`` runs instead
    where it has one, which ``stop`` cuts short. A mode whose cleanup says the kernel
    lacks what it needs (``kernel lacks IP_VS``) made nothing here: logged, not an error.
    One mode failing does not stop the others, and a mode that failed while another
    succeeded is tried once more after them.
    """
    listed = list(modes)
    errors: dict[str, str] = {}
    for mode in listed:
        error = _clean(mode, netns, stop)
        if error is not None:
            errors[mode.name] = error
    if errors and len(errors) < len(listed):
        # The modes share chain names (KUBE-SERVICES, KUBE-MARK-MASQ...): what one could
        # not delete may have been held by another's chains, gone now. Once more.
        for mode in listed:
            if mode.name in errors and _clean(mode, netns, stop) is None:
                del errors[mode.name]
    return [f"{name} mode: {message}" for name, message in errors.items()]


def _clean(mode: Mode, netns: str | None, stop: threading.Event | None) -> str | None:
    """Run one mode's cleanup (or handover); its error in one line, None when it worked
    or there was nothing to do."""
    try:
        if stop is not None and mode.handover is not None:
            mode.handover(netns, stop)
        else:
            mode.cleanup(netns)
    except Exception as err:  # any backend's error: report it, go on with the rest
        message = _one_line(err)
        if _KERNEL_LACKS in message.lower():
            logger.info("Nothing to clean up for %s mode: %s", mode.name, message)
            return None
        return message
    logger.info("Removed what %s mode made (if anything)", mode.name)
    return None


def cleanup_all(modes: Mapping[str, Mode] | None = None, netns: str | None = None) -> int:
    """``--cleanup``: remove what every mode made; the exit code (0, or 1 after one error
    line per mode that failed)."""
    errors = cleanup_modes((modes or MODES).values(), netns)
    for error in errors:
        logger.error("Cleanup failed: %s", error)
    if not errors:
        logger.info("Cleanup done: nftables tables, iptables chains and ipvs state of ours removed")
    return 1 if errors else 0


def cleanup_leftovers(modes: Mapping[str, Mode] | None = None, netns: str | None = None) -> int:
    """``--cleanup-leftovers``: remove what only our proxy makes and upstream's kube-proxy,
    having taken the node back, leaves unused (each mode's ``leftovers``); the exit code
    (0, or 1 after one error line per mode that failed, for instance because our rules
    are still in use there).

    Unlike ``--cleanup`` it never touches a name upstream's kube-proxy writes, so it is
    safe while upstream's kube-proxy runs, and it changes nothing while ours still does.
    """
    errors: list[str] = []
    for mode in (modes or MODES).values():
        if mode.leftovers is None:
            continue
        try:
            mode.leftovers(netns)
        except Exception as err:  # any backend's error: report it, go on with the rest
            message = _one_line(err)
            if _KERNEL_LACKS in message.lower():
                continue
            errors.append(f"{mode.name} mode: {message}")
    for error in errors:
        logger.error("Removing our leftovers failed: %s", error)
    if not errors:
        logger.info("Leftovers removed: what only this proxy makes, and nothing in use")
    return 1 if errors else 0


def platform_cleanup(
    mode: str,
    modes: Mapping[str, Mode] | None = None,
    netns: str | None = None,
    *,
    stop: threading.Event | None = None,
) -> list[str]:
    """Remove what the other kind of mode left (upstream's ``platformCleanup``, which
    upstream runs at start-up; ours once our first sync is in: :mod:`~.takeover`):
    iptables and ipvs leftovers in nftables mode, the nftables tables in iptables or ipvs
    mode. ``stop``: as :func:`cleanup_modes`' (a daemon's handover). Failures are logged
    as warnings (the proxy goes on) and returned."""
    table = modes or MODES
    if mode in IPTABLES_BASED:
        others = [m for m in table.values() if not m.iptables_based]
    else:
        others = [m for m in table.values() if m.iptables_based]
    errors = cleanup_modes(others, netns, stop=stop)
    for error in errors:
        logger.warning("Could not remove another mode's leftovers: %s", error)
    return errors
