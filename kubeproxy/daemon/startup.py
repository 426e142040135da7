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
from typing import cast

from kubeproxy.backend import Backend, BackendFactory
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import ConntrackReconciler, NetlinkConntrack
from kubeproxy.daemon.daemon import Daemon, DaemonParts
from kubeproxy.daemon.errors import StartupError
from kubeproxy.daemon.events import event_sink
from kubeproxy.daemon.gate import HandlerGate
from kubeproxy.daemon.gctuning import GcTuner
from kubeproxy.daemon.hooks import BackendContext
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
from kubeproxy.daemon.privileged import privileged_setup
from kubeproxy.daemon.serving import Servers, health_checks, servers
from kubeproxy.daemon.sources import (
    STOP_TIMEOUT,
    SourceTuning,
    StartedSource,
    api_client,
    open_api,
    open_manifests,
)
from kubeproxy.daemon.wiring import DaemonPlugins, DaemonSeams
from kubeproxy.debugpages import DebugState, core_pages
from kubeproxy.events import (
    ACTION_START,
    REASON_FAILED_HEALTHCHECK,
    REASON_FAILED_METRICS,
    EventSink,
)
from kubeproxy.host.httpserving import ServerBindError
from kubeproxy.host.netlink import AddressWatcher, HostAddresses
from kubeproxy.objects import IPAddress, IPFamily
from kubeproxy.proxier import ObserverGroup, Proxier, SyncHook, SyncObserver
from kubeproxy.selfheal import SelfHealer

__all__ = ["build_daemon"]

logger = logging.getLogger(__name__)


def build_daemon(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    *,
    plugins: DaemonPlugins | None = None,
    seams: DaemonSeams | None = None,
    serve_early: bool = False,
) -> Daemon:
    """Build the proxy for ``options``, up to the point where :meth:`Daemon.start` runs it.

    With ``options.manifests`` the directory is loaded; otherwise an API client is made
    from the options (or ``seams.api`` is used) and the Kubernetes source starts, waiting
    up to ``seams.node_timeout`` seconds for this Node (its deliveries are held until the
    daemon starts). Backends are ``backend_factory(family, config, netns=seams.netns)``.
    ``plugins`` (:class:`~kubeproxy.daemon.wiring.DaemonPlugins`) is what the proxy adds:
    its name and mode, hooks, watchers, start-up warnings, ``before_first_sync``;
    ``seams`` (:class:`~kubeproxy.daemon.wiring.DaemonSeams`) replaces what is otherwise
    taken from the host and the process (executors, probes, timing, exit, stop).
    ``serve_early`` starts the health and metrics servers first of all (see the module).
    Raises :class:`~kubeproxy.daemon.errors.StartupError`.
    """
    return _build(
        options, backend_factory, plugins or DaemonPlugins(), seams or DaemonSeams(), serve_early
    )


def _build(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    plugins: DaemonPlugins,
    seams: DaemonSeams,
    serve_early: bool,
) -> Daemon:
    stop = seams.stop if seams.stop is not None else threading.Event()
    gate = HandlerGate()
    lister = seams.host_addresses if seams.host_addresses is not None else HostAddresses()
    netns = seams.netns

    def list_host_addresses() -> list[IPAddress]:
        return [a for a in lister.list_addresses(netns) if not a.is_link_local]

    parts = servers(options, plugins.mode, options.config.sync_period)
    if not (options.once or options.dry_run):
        # 503 until the first sync, from the start: IPv4 is always proxied (IPv6 joins
        # once the families are known). Set only then, /healthz answered 200 in the
        # moment between learning the Node and knowing the families.
        parts.health.await_first_sync([IPFamily.IPV4])
    # Bound before the API client is made: importing the Kubernetes client alone took
    # 0.35-0.7 s on a loaded machine, and /livez should answer within a second.
    refused = _bind(parts) if serve_early else None
    api = seams.api
    if options.manifests is not None:
        api = None
    elif api is None:
        try:
            api = api_client(options)
        except StartupError:
            stop_serving(parts)
            raise
    events = seams.events
    if events is None:
        events = event_sink(api, options.node_name, plugins.name)
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
                tuning=seams.tuning or SourceTuning(),
                node_timeout=seams.node_timeout,
                stop=stop,
                exit=seams.exit,
            )
    except BaseException:
        stop_serving(parts)
        raise
    try:
        return _assemble(
            options,
            backend_factory,
            _Started(source, gate, stop, events, serve_early, parts),
            list_host_addresses,
            plugins,
            seams,
        )
    except BaseException:
        source.join(STOP_TIMEOUT)
        stop_serving(parts)
        raise


@dataclass(frozen=True, slots=True)
class _Started:
    """What :func:`_build` made before the node's IPs were known."""

    source: StartedSource
    gate: HandlerGate
    stop: threading.Event
    events: EventSink
    serving: bool
    parts: Servers


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


def _debug_pages(
    options: DaemonOptions,
    config: ProxierConfig,
    plugins: DaemonPlugins,
    parts: Servers,
    netns: str | None,
) -> DebugState | None:
    """The ``/debug/`` pages on the metrics server when ``enableProfiling`` asks for
    them (a daemon's only), and the state they show (a hook and observer of every
    proxier); None when off."""
    if not options.enable_profiling or options.once or options.dry_run:
        return None
    state = DebugState(config)
    more = plugins.debug_pages(state, netns) if plugins.debug_pages is not None else {}
    routes = core_pages(state, more)
    parts.metrics_server.add_routes(routes)
    logger.info(
        "enableProfiling: serving %s on the metrics server (%s)",
        ", ".join(sorted(routes)),
        options.metrics_bind_address or "disabled",
    )
    return state


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


def _log_families(families: Sequence[IPFamily], node_ips: NodeIPs, plugins: DaemonPlugins) -> None:
    # Upstream's lines (klog's key="value" pairs after the message).
    if len(families) == 2:
        logger.info(
            '%s running in dual-stack mode primary ipFamily="%s"',
            plugins.name,
            node_ips.primary_family,
        )
    else:
        logger.info('%s running in single-stack mode ipFamily="%s"', plugins.name, families[0])
    logger.info("Using %s Proxier", plugins.mode)


def _assemble(
    options: DaemonOptions,
    backend_factory: BackendFactory,
    started: _Started,
    list_host_addresses: Callable[[], list[IPAddress]],
    plugins: DaemonPlugins,
    seams: DaemonSeams,
) -> Daemon:
    """Everything after the source, in upstream's order: node IPs and families, the
    privileged set-up, backends, health checks, the conntrack reconciler, proxiers; then
    the self-healing watchers."""
    events, parts, source = started.events, started.parts, started.source
    node = node_info(source.node, options.node_name, list_host_addresses())
    parts.health.set_node(node)  # 503 meanwhile: the first sync is awaited already
    node_ips = detect_node_ips(
        host_ips(node.addresses),
        options.configuration.bind_address,
        explain_loopback=not source.node_explained,
    )
    config = expand_primary(options.config, node_ips)
    supported = kernel_supports_ipv6() if seams.ipv6_supported is None else seams.ipv6_supported
    try:
        families = detect_families(node_ips, ipv6_supported=supported)
    except FamilyNotSupported as err:
        raise StartupError(str(err)) from None
    if seams.privileged:
        privileged_setup(options, seams.paths, files=seams.sysctl_files)
    primary = node_ips.primary_family
    backends = _make_backends(backend_factory, families, primary, config, seams.netns)
    families = list(backends)
    _log_families(families, node_ips, plugins)
    if not (options.once or options.dry_run):
        # /healthz answers 503 until each family's rules are written.
        parts.health.await_first_sync(families)
    observer = health_checks(options, parts.health, families, events)
    metrics = parts.metrics
    executor = seams.conntrack if seams.conntrack is not None else NetlinkConntrack(seams.netns)
    reconciler = ConntrackReconciler(executor, metrics)
    gc_tuner = GcTuner(families, seams.gc_ops)
    # A process that syncs once and exits has no long life to tune the collector for.
    tuning = () if options.once or options.dry_run else (gc_tuner,)
    make_watchers = plugins.watchers
    watching = list(make_watchers(list(backends.values()), seams.netns)) if make_watchers else []
    # /healthz answers 503 from a report of rules changed by others until their repair.
    healer = SelfHealer({}, counter=metrics, events=events, kernel_state=parts.health)
    healing = tuple(w.after_sync for w in watching)
    proxiers: dict[IPFamily, Proxier] = {}
    debug = _debug_pages(options, config, plugins, parts, seams.netns)
    if debug is not None:
        debug.repairs = healer.recent_repairs
    for family, backend in backends.items():
        extra: tuple[SyncHook | SyncObserver, ...] = () if debug is None else (debug,)
        if plugins.backend_hooks is not None:
            context = BackendContext(backend, family, metrics, parts.health, events)
            extra += tuple(plugins.backend_hooks(context))
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
    # Only with the real lister: a fake one has no kernel addresses to watch.
    addresses = (
        AddressWatcher(_told(proxiers.values()), seams.netns)
        if seams.host_addresses is None
        else None
    )
    built = DaemonParts(
        node=node,
        node_ips=node_ips,
        proxiers=proxiers,
        source=source,
        gate=started.gate,
        servers=parts,
        health_observer=observer,
        events=events,
        gc_tuner=gc_tuner,
        stop=started.stop,
        healer=healer,
        watchers=watching,
        address_watcher=addresses,
        serving=started.serving,
    )
    return Daemon(options, built, plugins)


def _told(proxiers: Iterable[Proxier]) -> Callable[[], None]:
    """What tells every proxier that the host's addresses changed."""
    targets = tuple(proxiers)

    def tell() -> None:
        for proxier in targets:
            proxier.host_addresses_changed()

    return tell
