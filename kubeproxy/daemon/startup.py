"""Upstream's start-up steps, up to a :class:`~kubeproxy.daemon.daemon.Daemon` ready to run.

:func:`build_daemon` follows upstream's order (``cmd/kube-proxy/app/server.go``): the
source (and, with an API server, the wait for this Node), the node IPs and families, the
event sink, the privileged set-up, one backend per family (making one runs its support
check: a mode that cannot run stops the start here), the health and metrics state, the
conntrack reconciler, and one proxier per family with its hooks; then the self-healing
watchers. No rule is written yet, and only this Node (and the ServiceCIDRs) has been
read: :meth:`Daemon.start` has the source deliver the rest straight into the proxiers.

With ``serve_early`` (what :func:`~kubeproxy.daemon.run_daemon` asks for a daemon) the
health and metrics servers listen before anything else, where upstream starts them
after its proxiers: ``/livez`` answers within a second of the start however big the
cluster, and ``/healthz`` answers 503 until the first sync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kubeproxy.backend import Backend, BackendFactory
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import ConntrackExecutor, ConntrackReconciler, NetlinkConntrack
from kubeproxy.daemon.daemon import Daemon
from kubeproxy.daemon.errors import StartupError
from kubeproxy.daemon.events import StartupWarning, event_sink
from kubeproxy.daemon.gate import HandlerGate
from kubeproxy.daemon.gctuning import GcOps, GcTuner
from kubeproxy.daemon.hooks import BackendContext, BackendHooks, WatcherFactory
from kubeproxy.daemon.nodeips import (
    FamilyNotSupported,
    NodeIPs,
    detect_families,
    detect_node_ips,
    expand_primary,
    host_ips,
    kernel_supports_ipv6,
    node_info,
)
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.daemon.privileged import HostPaths, privileged_setup
from kubeproxy.daemon.serving import Servers, health_checks, servers
from kubeproxy.daemon.sources import (
    NODE_WAIT_TIMEOUT,
    STOP_TIMEOUT,
    SourceTuning,
    StartedSource,
    api_client,
    open_api,
    open_manifests,
)
from kubeproxy.events import (
    ACTION_START,
    REASON_FAILED_HEALTHCHECK,
    REASON_FAILED_METRICS,
    EventSink,
)
from kubeproxy.health import ServerBindError
from kubeproxy.netlink import AddressWatcher, HostAddresses, HostAddressLister
from kubeproxy.objects import IPAddress, IPFamily
from kubeproxy.proxier import ObserverGroup, Proxier, SyncHook, SyncObserver
from kubeproxy.selfheal import SelfHealer
from kubeproxy.sysctl import SysctlFiles

__all__ = ["build_daemon"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Wiring:
    """What :func:`build_daemon` was asked for beyond the options and the factory."""

    name: str
    mode: str
    netns: str | None
    conntrack: ConntrackExecutor | None
    events: EventSink
    privileged: bool
    paths: HostPaths | None
    sysctl_files: SysctlFiles | None
    ipv6_supported: bool | None
    gc_ops: GcOps | None
    backend_hooks: BackendHooks | None
    watchers: WatcherFactory | None
    startup_warnings: Sequence[StartupWarning]
    before_first_sync: Callable[[], object] | None
    watch_addresses: bool
    serving: bool


def build_daemon(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    *,
    mode: str = "nftables",
    name: str = "kube-proxy",
    api: Any = None,
    netns: str | None = None,
    host_addresses: HostAddressLister | None = None,
    conntrack: ConntrackExecutor | None = None,
    events: EventSink | None = None,
    privileged: bool = True,
    paths: HostPaths | None = None,
    sysctl_files: SysctlFiles | None = None,
    ipv6_supported: bool | None = None,
    tuning: SourceTuning | None = None,
    node_timeout: float = NODE_WAIT_TIMEOUT,
    exit: Callable[[int], object] | None = None,
    gc_ops: GcOps | None = None,
    backend_hooks: BackendHooks | None = None,
    watchers: WatcherFactory | None = None,
    startup_warnings: Sequence[StartupWarning] = (),
    stop: threading.Event | None = None,
    before_first_sync: Callable[[], object] | None = None,
    serve_early: bool = False,
) -> Daemon:
    """Build the proxy for ``options``, up to the point where :meth:`Daemon.start` runs it.

    ``mode`` (``nftables``, ``iptables`` or ``ipvs``) picks upstream's mode-specific
    metrics and is what ``/proxyMode`` and the logs say; ``name`` is the proxy's name in
    the logs and the Events' ``reportingController`` (``kube-proxy`` for ours).

    With ``options.manifests`` the directory is loaded; otherwise an API client is made
    from the options (or ``api`` is used) and the Kubernetes source starts, waiting up to
    ``node_timeout`` seconds for this Node (its deliveries are held until the daemon
    starts). Executors default to the real ones of the current network namespace, or of
    ``netns``: ``backend_factory(family, config, netns=netns)``, ``host_addresses``
    (netlink), ``conntrack`` (ctnetlink). ``events`` defaults to an
    :class:`~kubeproxy.events.EventRecorder` with the API, a
    :class:`~kubeproxy.daemon.events.LoggingEventSink` with manifests. ``privileged``
    applies :func:`~kubeproxy.daemon.privileged.privileged_setup` (through ``paths`` and
    ``sysctl_files``). ``exit`` is what the NodeWatcher calls when the Node's IPs change
    (default: end the process). ``backend_hooks`` adds a proxy's own hooks, metrics and
    health conditions per backend (:data:`~kubeproxy.daemon.hooks.BackendHooks`);
    ``watchers`` makes the self-healing watchers (none without it). ``startup_warnings``
    are posted as events when the daemon starts. ``before_first_sync`` runs once every
    backend exists and (for a daemon) the servers are bound, right before the first sync:
    the binaries remove the other modes' rules there, so a mode that cannot run, or a
    server that cannot bind with ``bindAddressHardFail``, leaves them in place.
    ``serve_early`` starts the health and metrics servers first of all (see the module).
    With the real ``host_addresses`` lister, an
    :class:`~kubeproxy.netlink.AddressWatcher` has the proxiers read the host's addresses
    again when one comes or goes. Raises :class:`~kubeproxy.daemon.errors.StartupError`.
    """
    stop = stop if stop is not None else threading.Event()
    gate = HandlerGate()
    lister = host_addresses if host_addresses is not None else HostAddresses()

    def list_host_addresses() -> list[IPAddress]:
        return [a for a in lister.list_addresses(netns) if not a.is_link_local]

    parts = servers(options, mode, options.config.sync_period)
    if not (options.once or options.dry_run):
        # 503 until the first sync, from the start: IPv4 is always proxied (IPv6 joins
        # once the families are known). Set only then, /healthz answered 200 in the
        # moment between learning the Node and knowing the families.
        parts.health.await_first_sync([IPFamily.IPV4])
    # Bound before the API client is made: importing the Kubernetes client alone took
    # 0.35-0.7 s on a loaded machine, and /livez should answer within a second.
    refused = _bind(parts) if serve_early else None
    if options.manifests is not None:
        api = None
    elif api is None:
        try:
            api = api_client(options)
        except StartupError:
            stop_serving(parts)
            raise
    events = events if events is not None else event_sink(api, options.node_name, name)
    if refused is not None:
        _refuse(parts, events, *refused)
    try:
        if options.manifests is not None:
            source = open_manifests(options.manifests, gate, options)
        else:
            source = open_api(
                api,
                gate,
                options,
                tuning=tuning or SourceTuning(),
                node_timeout=node_timeout,
                stop=stop,
                exit=exit,
            )
    except BaseException:
        stop_serving(parts)
        raise
    wiring = _Wiring(
        name=name,
        mode=mode,
        netns=netns,
        conntrack=conntrack,
        events=events,
        privileged=privileged,
        paths=paths,
        sysctl_files=sysctl_files,
        ipv6_supported=ipv6_supported,
        gc_ops=gc_ops,
        backend_hooks=backend_hooks,
        watchers=watchers,
        startup_warnings=startup_warnings,
        before_first_sync=before_first_sync,
        watch_addresses=host_addresses is None,
        serving=serve_early,
    )
    try:
        return _assemble(
            options, backend_factory, source, gate, stop, list_host_addresses, wiring, parts
        )
    except BaseException:
        source.join(STOP_TIMEOUT)
        stop_serving(parts)
        raise


def _bind(parts: Servers) -> tuple[str, ServerBindError] | None:
    """Start both servers; the first refusal (``bindAddressHardFail``) and its reason."""
    for start, reason in (
        (parts.health_server.start, REASON_FAILED_HEALTHCHECK),
        (parts.metrics_server.start, REASON_FAILED_METRICS),
    ):
        try:
            start()
        except ServerBindError as err:
            return reason, err
    return None


def _refuse(parts: Servers, events: EventSink, reason: str, err: ServerBindError) -> None:
    """Post upstream's Warning for a server that could not bind, stop serving, and raise
    :class:`~kubeproxy.daemon.errors.StartupError`."""
    events.warning(reason, ACTION_START, str(err))
    stop_serving(parts)
    close = getattr(events, "close", None)
    if callable(close):
        close(STOP_TIMEOUT)  # post the Warning: no daemon will stop (and flush) it
    raise StartupError(str(err)) from err


def stop_serving(parts: Servers) -> None:
    """Stop the health and metrics servers (nothing if they do not run)."""
    parts.health_server.stop()
    parts.metrics_server.stop()


def _make_backends(
    factory: BackendFactory,
    families: Sequence[IPFamily],
    primary: IPFamily,
    config: ProxierConfig,
    netns: str | None,
) -> dict[IPFamily, Backend]:
    """One backend per family (its support check); the primary family's failing stops the
    start, the other one's only drops it (upstream's ``No iptables support for family``)."""
    backends: dict[IPFamily, Backend] = {}
    for family in families:
        try:
            backends[family] = factory(family, config, netns=netns)
        except Exception as err:
            if family is primary:
                raise StartupError(f"cannot set up the {family} backend: {err}") from None
            logger.warning(
                'Cannot set up the %s backend (%s); running single-stack ipFamily="%s"',
                family,
                err,
                primary,
            )
    return backends


def _log_families(families: Sequence[IPFamily], node_ips: NodeIPs, wiring: _Wiring) -> None:
    # Upstream's lines (klog's key="value" pairs after the message).
    if len(families) == 2:
        logger.info(
            '%s running in dual-stack mode primary ipFamily="%s"',
            wiring.name,
            node_ips.primary_family,
        )
    else:
        logger.info('%s running in single-stack mode ipFamily="%s"', wiring.name, families[0])
    logger.info("Using %s Proxier", wiring.mode)


def _assemble(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    source: StartedSource,
    gate: HandlerGate,
    stop: threading.Event,
    list_host_addresses: Callable[[], list[IPAddress]],
    wiring: _Wiring,
    parts: Servers,
) -> Daemon:
    """Everything after the source, in upstream's order: node IPs and families, the
    privileged set-up, backends, health checks, the conntrack reconciler, proxiers; then
    the self-healing watchers."""
    events = wiring.events
    node = node_info(source.node, options.node_name, list_host_addresses())
    parts.health.set_node(node)  # 503 meanwhile: the first sync is awaited already
    node_ips = detect_node_ips(
        host_ips(node.addresses),
        options.configuration.bind_address,
        explain_loopback=not source.node_explained,
    )
    config = expand_primary(options.config, node_ips)
    supported = kernel_supports_ipv6() if wiring.ipv6_supported is None else wiring.ipv6_supported
    try:
        families = detect_families(node_ips, ipv6_supported=supported)
    except FamilyNotSupported as err:
        raise StartupError(str(err)) from None
    if wiring.privileged:
        privileged_setup(options, wiring.paths, files=wiring.sysctl_files)
    primary = node_ips.primary_family
    backends = _make_backends(backend_factory, families, primary, config, wiring.netns)
    families = list(backends)
    _log_families(families, node_ips, wiring)
    if not (options.once or options.dry_run):
        # /healthz answers 503 until each family's rules are written.
        parts.health.await_first_sync(families)
    observer = health_checks(options, parts.health, families, events)
    metrics = parts.metrics
    executor = wiring.conntrack if wiring.conntrack is not None else NetlinkConntrack(wiring.netns)
    reconciler = ConntrackReconciler(executor, metrics)
    gc_tuner = GcTuner(families, wiring.gc_ops)
    # A process that syncs once and exits has no long life to tune the collector for.
    tuning = () if options.once or options.dry_run else (gc_tuner,)
    make_watchers = wiring.watchers
    watching = list(make_watchers(list(backends.values()), wiring.netns)) if make_watchers else []
    # /healthz answers 503 from a report of rules changed by others until their repair.
    healer = SelfHealer({}, counter=metrics, events=events, kernel_state=parts.health)
    healing = tuple(w.after_sync for w in watching)
    proxiers: dict[IPFamily, Proxier] = {}
    for family, backend in backends.items():
        extra: tuple[SyncHook | SyncObserver, ...] = ()
        if wiring.backend_hooks is not None:
            context = BackendContext(backend, family, metrics, parts.health, events)
            extra = tuple(wiring.backend_hooks(context))
        hooks = [item for item in extra if callable(item)]
        observers = [cast(SyncObserver, o) for o in extra if hasattr(o, "sync_finished")]
        proxiers[family] = Proxier(
            family,
            config,
            backend,
            node=node,
            host_addresses=list_host_addresses,
            observer=ObserverGroup([metrics, observer, *observers, healer]),
            conntrack=reconciler,
            after_sync=(
                metrics.after_sync,
                observer.after_sync,
                *hooks,
                *healing,
                *tuning,
            ),
        )
        metrics.track(proxiers[family])
    healer.proxiers.update(proxiers)
    addresses = (
        AddressWatcher(_told(proxiers.values()), wiring.netns) if wiring.watch_addresses else None
    )
    return Daemon(
        options=options,
        node=node,
        node_ips=node_ips,
        proxiers=proxiers,
        source=source,
        gate=gate,
        metrics=metrics,
        metrics_server=parts.metrics_server,
        health=parts.health,
        health_server=parts.health_server,
        health_observer=observer,
        events=events,
        gc_tuner=gc_tuner,
        stop=stop,
        healer=healer,
        watchers=watching,
        startup_warnings=wiring.startup_warnings,
        before_first_sync=wiring.before_first_sync,
        name=wiring.name,
        serving=wiring.serving,
        address_watcher=addresses,
    )


def _told(proxiers: Iterable[Proxier]) -> Callable[[], None]:
    """What tells every proxier that the host's addresses changed."""
    targets = tuple(proxiers)

    def tell() -> None:
        for proxier in targets:
            proxier.host_addresses_changed()

    return tell
