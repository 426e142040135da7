"""Wiring shared by the binaries: upstream kube-proxy's start-up sequence over our core.

A binary parses its options, sets up logging and hands over to :func:`run_daemon`, which
follows upstream's start-up (``cmd/kube-proxy/app/server.go`` and ``server_linux.go``):

1. ``--init-only``: the privileged set-up (:func:`privileged_setup`: conntrack sysctls,
   ``oomScoreAdj``), then exit 0;
2. :func:`build_daemon`: the source (a manifests directory, or the API server with a
   :class:`~kubeproxy.sources.kubernetes.NodeWatcher` waiting up to five minutes for this
   Node), the node IPs and primary family (:func:`detect_node_ips`), the families to
   proxy (:func:`detect_families`), the event recorder, the privileged set-up, metrics
   and health state and servers, the conntrack reconciler and one proxier per family
   (making a backend runs its support check: a mode that cannot run here stops here);
3. :meth:`Daemon.start`: post the mode warnings (:class:`StartupWarning`: ipvs is
   deprecated, the mode was defaulted), bind the health and metrics servers (with
   ``bindAddressHardFail`` a failure is fatal, after a Warning event), run the
   ``before_first_sync`` step (the binaries remove the other modes' rules there, once
   everything that could stop the start has passed), post the ``Starting`` event, hand
   the proxiers what the source delivered so far (the first sync) and start the sync
   loops;
4. SIGTERM or SIGINT: :meth:`Daemon.stop` closes the servers and joins the threads; the
   kernel rules stay in place, for the next instance to take over.

``--once`` (and ``--dry-run``) syncs once after the initial list instead of steps 3-4
(``before_first_sync`` still runs first), without the privileged set-up: a one-shot sync
is a tool run, not a node's proxy, and must not retune the host's conntrack table.

Where we differ from upstream: ``--init-only`` does not contact the API server (the
privileged set-up needs nothing from it, and an init container should not wait for the
Node); the source is started before the proxiers exist (our sources deliver the Node
with everything else), so a :class:`HandlerGate` holds what it delivers until then; the
other modes' rules are removed only once this mode's backends exist and its servers are
bound, so a failed start leaves the node's rules alone; and once every family has
completed its first full sync the process freezes its long-lived objects out of the
garbage collector's reach (:class:`GcTuner`).
"""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, cast

from kubeproxy.backend import Backend, BackendFactory, ProxySnapshot, SyncChanges
from kubeproxy.cmd.options import Options
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import (
    ConntrackExecutor,
    ConntrackReconciler,
    FakeConntrack,
    NetlinkConntrack,
)
from kubeproxy.events import (
    ACTION_LISTEN,
    ACTION_START,
    REASON_FAILED_HEALTHCHECK,
    REASON_FAILED_METRICS,
    REASON_FAILED_SERVICE_HEALTHCHECK,
    WARNING,
    EventRecorder,
    EventSink,
    NodeEventSink,
    ObjectReference,
)
from kubeproxy.handlers import KubeObject, ProxyHandler
from kubeproxy.health import (
    HealthObserver,
    ProxyHealth,
    ProxyHealthServer,
    ServerBindError,
    ServiceHealthServer,
)
from kubeproxy.metrics import MetricsServer, ProxyMetrics
from kubeproxy.netlink import HostAddresses, HostAddressLister
from kubeproxy.objects import IPAddress, IPFamily, IPNetwork, NamespacedName, NodeInfo
from kubeproxy.parse import InvalidObject, parse_node
from kubeproxy.proxier import DualStackProxier, ObserverGroup, Proxier, SyncHook, SyncObserver
from kubeproxy.proxyconfig import KubeProxyConntrackConfiguration, config_document
from kubeproxy.selfheal import SelfHealer, Watcher
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.sysctl import (
    DEFAULT_HASHSIZE_PATH,
    ConntrackSysctls,
    SysctlFiles,
    SysctlResult,
    apply_conntrack_sysctls,
)

if TYPE_CHECKING:
    from kubeproxy.sources.kubernetes import KubernetesSource

__all__ = [
    "GC_THRESHOLDS",
    "LOOPBACK_MESSAGE",
    "NODE_WAIT_TIMEOUT",
    "BackendHooks",
    "Daemon",
    "GcOps",
    "GcTuner",
    "HandlerGate",
    "HostPaths",
    "LoggingEventSink",
    "NodeIPs",
    "SourceTuning",
    "StartupError",
    "StartupInterrupted",
    "StartupWarning",
    "WatcherFactory",
    "apply_oom_score_adj",
    "build_daemon",
    "conntrack_sysctls",
    "detect_families",
    "detect_node_ips",
    "expand_primary",
    "host_ips",
    "kernel_supports_ipv6",
    "privileged_setup",
    "run_daemon",
]

logger = logging.getLogger(__name__)

NODE_WAIT_TIMEOUT: Final = 300.0
"""How long start-up waits for this Node to exist with host IPs (upstream: 5 minutes)."""

LOOPBACK_MESSAGE: Final = (
    "Can't determine this node's IP, assuming loopback; if this is incorrect, please set the "
    "--bind-address flag"
)
"""Upstream's log line when neither the Node nor ``bindAddress`` gives a node IP."""

GC_THRESHOLDS: Final = (20_000, 10, 10)
"""The collector's thresholds once the working set is frozen (Python's default: 700, 10, 10)."""

_STOP_TIMEOUT: Final = 5.0
_POLL: Final = 0.05

BackendHooks = Callable[[Backend, ProxyMetrics], Sequence[SyncHook | SyncObserver]]
"""Extra pieces a binary wires for its kind of backend (backend-specific metrics): a
callable one runs as an after-sync hook, one with ``sync_finished`` hears every sync of
its family (failed ones too) as a :class:`~kubeproxy.proxier.SyncObserver`."""

WatcherFactory = Callable[[Sequence[Backend], str | None], Sequence[Watcher]]
"""Makes a mode's self-healing watchers for its backends (one per family) in a network
namespace (None: the current one); see :mod:`kubeproxy.selfheal`."""


@dataclass(frozen=True, slots=True)
class StartupWarning:
    """A Warning event about the Node that :meth:`Daemon.start` posts first (the binary
    has logged it already): ipvs is deprecated, the proxy mode was defaulted."""

    reason: str
    action: str
    note: str


class StartupError(RuntimeError):
    """The proxy cannot start; the message says why, in one line."""


class StartupInterrupted(StartupError):
    """A stop was requested (SIGTERM, SIGINT) before the proxy had started."""


# --- holding a source's deliveries until the proxiers exist -----------------------------


class HandlerGate:
    """A :class:`~kubeproxy.handlers.ProxyHandler` that holds deliveries until :meth:`bind`.

    Upstream waits for its Node before it builds the proxiers; our sources deliver the
    Node along with everything else. The gate lets a source start first, remembers the
    last Node it delivered (:attr:`node`), and on :meth:`bind` replays what it held, in
    order, into the real handler; later calls go straight through. Thread-safe: a call
    that arrives while :meth:`bind` replays waits, so order is kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: ProxyHandler | None = None
        self._held: list[tuple[str, tuple[Any, ...]]] = []
        self._node: KubeObject | None = None

    @property
    def node(self) -> KubeObject | None:
        """The last Node delivered (None before one, or after a deletion)."""
        with self._lock:
            return self._node

    @property
    def bound(self) -> bool:
        """Whether :meth:`bind` has been called."""
        with self._lock:
            return self._target is not None

    @property
    def held(self) -> int:
        """How many deliveries wait for :meth:`bind`."""
        with self._lock:
            return len(self._held)

    def bind(self, handler: ProxyHandler) -> None:
        """Replay everything held into ``handler``, then forward every later call to it."""
        with self._lock:
            if self._target is not None:
                raise RuntimeError("the handler gate is already bound")
            held, self._held = self._held, []
            for method, args in held:
                _call(handler, method, args)
            self._target = handler

    def _deliver(self, method: str, *args: Any) -> None:
        with self._lock:
            if method == "on_node_update":
                self._node = args[0]
            target = self._target
            if target is None:
                self._held.append((method, args))
                return
        getattr(target, method)(*args)

    def on_service_add(self, service: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_add", service)

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_update", old, new)

    def on_service_delete(self, service: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_service_delete", service)

    def on_services_synced(self) -> None:
        """Hold or forward."""
        self._deliver("on_services_synced")

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_add", slice_)

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_update", old, new)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slice_delete", slice_)

    def on_endpoint_slices_synced(self) -> None:
        """Hold or forward."""
        self._deliver("on_endpoint_slices_synced")

    def on_node_update(self, node: KubeObject | None) -> None:
        """Remember the Node; hold or forward."""
        self._deliver("on_node_update", node)

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        """Hold or forward."""
        self._deliver("on_service_cidrs_changed", list(cidrs))


def _call(handler: ProxyHandler, method: str, args: tuple[Any, ...]) -> None:
    try:
        getattr(handler, method)(*args)
    except Exception:  # one bad delivery must not keep the rest from the proxiers
        logger.exception("Replaying %s into the proxier failed", method)


# --- node IPs and families --------------------------------------------------------------

_LOOPBACK_V4: Final = ipaddress.IPv4Address("127.0.0.1")
_LOOPBACK_V6: Final = ipaddress.IPv6Address("::1")


def _family_of(address: IPAddress) -> IPFamily:
    return IPFamily.IPV4 if address.version == 4 else IPFamily.IPV6


@dataclass(frozen=True, slots=True)
class NodeIPs:
    """This node's IP of each family and its primary family (upstream's ``NodeIPs``).

    A family the node has no address of holds the loopback address, as upstream.
    """

    primary_family: IPFamily = IPFamily.IPV4
    ipv4: ipaddress.IPv4Address = _LOOPBACK_V4
    ipv6: ipaddress.IPv6Address = _LOOPBACK_V6

    def of(self, family: IPFamily) -> IPAddress:
        """The node IP of ``family`` (loopback when the node has none)."""
        return self.ipv4 if family is IPFamily.IPV4 else self.ipv6

    @property
    def primary(self) -> IPAddress:
        """The node IP of the primary family."""
        return self.of(self.primary_family)

    @property
    def real(self) -> tuple[IPAddress, ...]:
        """The node IPs that are not loopback stand-ins, primary first."""
        ordered = [self.primary, self.of(_other(self.primary_family))]
        return tuple(ip for ip in ordered if not ip.is_loopback)


def _other(family: IPFamily) -> IPFamily:
    return IPFamily.IPV6 if family is IPFamily.IPV4 else IPFamily.IPV4


def host_ips(addresses: Sequence[IPAddress]) -> tuple[IPAddress, ...]:
    """Upstream's node host IPs: the first address, then the first of the other family."""
    if not addresses:
        return ()
    first = addresses[0]
    other = next((a for a in addresses if a.version != first.version), None)
    return (first,) if other is None else (first, other)


def detect_node_ips(
    raw: Sequence[IPAddress], bind_address: str = "", *, explain_loopback: bool = True
) -> NodeIPs:
    """Node IPs as upstream decides them: ``bindAddress`` when set and not unspecified
    overrides the primary IP; else the Node's host IPs (the first one's family is
    primary); else loopback, logging upstream's :data:`LOOPBACK_MESSAGE` (unless
    ``explain_loopback`` is False: the caller said why already)."""
    primary = IPFamily.IPV4
    ips: dict[IPFamily, IPAddress] = {}
    for address in host_ips(raw):
        ips.setdefault(_family_of(address), address)
    if raw:
        primary = _family_of(raw[0])
    try:
        bind = ipaddress.ip_address(bind_address) if bind_address else None
    except ValueError:
        bind = None  # validation rejected it already; never guess
    if bind is not None and not bind.is_unspecified:
        primary = _family_of(bind)
        ips[primary] = bind
    v4, v6 = ips.get(IPFamily.IPV4), ips.get(IPFamily.IPV6)
    node_ips = NodeIPs(
        primary,
        v4 if isinstance(v4, ipaddress.IPv4Address) else _LOOPBACK_V4,
        v6 if isinstance(v6, ipaddress.IPv6Address) else _LOOPBACK_V6,
    )
    if node_ips.primary.is_loopback and explain_loopback:
        logger.warning(LOOPBACK_MESSAGE)
    return node_ips


def kernel_supports_ipv6() -> bool:
    """Whether this kernel has IPv6 (the ``ipv6.disable=1`` boot option removes it)."""
    return os.path.exists("/proc/net/if_inet6")


def detect_families(node_ips: NodeIPs, *, ipv6_supported: bool) -> list[IPFamily]:
    """IPv4 always; IPv6 too when the kernel has it and the node has an IPv6 address."""
    families = [IPFamily.IPV4]
    if ipv6_supported and not node_ips.ipv6.is_loopback:
        families.append(IPFamily.IPV6)
    return families


def expand_primary(config: ProxierConfig, node_ips: NodeIPs) -> ProxierConfig:
    """Replace ``primary`` in ``nodePortAddresses`` by the node IPs' host CIDRs.

    Upstream expands it once at start-up, which is how ``bindAddress`` reaches NodePorts;
    a Node IP change later makes the proxy exit and start again. Without a real node IP
    ``primary`` is left for the proxier to resolve.
    """
    spec = config.node_port_addresses
    if "primary" not in spec or not node_ips.real:
        return config
    cidrs = tuple(f"{ip}/{ip.max_prefixlen}" for ip in node_ips.real)
    others = tuple(entry for entry in spec if entry != "primary")
    return replace(config, node_port_addresses=cidrs + others)


# --- privileged set-up ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostPaths:
    """The kernel files the privileged set-up writes (tests point them elsewhere)."""

    proc_sys: Path = Path("/proc/sys")
    conntrack_hashsize: Path = DEFAULT_HASHSIZE_PATH
    oom_score_adj: Path = Path("/proc/self/oom_score_adj")


def conntrack_sysctls(cfg: KubeProxyConntrackConfiguration) -> ConntrackSysctls:
    """The ``conntrack`` section as the sysctl settings to apply (0 leaves a value)."""
    return ConntrackSysctls(
        max_per_core=cfg.max_per_core,
        min=cfg.min,
        tcp_established_timeout=cfg.tcp_established_timeout.seconds,
        tcp_close_wait_timeout=cfg.tcp_close_wait_timeout.seconds,
        tcp_be_liberal=cfg.tcp_be_liberal,
        udp_timeout=cfg.udp_timeout.seconds,
        udp_stream_timeout=cfg.udp_stream_timeout.seconds,
    )


def apply_oom_score_adj(value: int, path: Path) -> bool:
    """Write ``value`` to ``path`` (``/proc/self/oom_score_adj``); log a refusal, never raise.

    Lowering it needs ``CAP_SYS_RESOURCE``.
    """
    try:
        path.write_text(f"{value}\n", encoding="ascii")
    except OSError as err:
        logger.warning("Failed to apply oomScoreAdj %d: %s", value, err.strerror or err)
        return False
    logger.debug("oomScoreAdj set to %d", value)
    return True


def privileged_setup(
    options: Options, paths: HostPaths | None = None, *, files: SysctlFiles | None = None
) -> SysctlResult:
    """What needs more than ``CAP_NET_ADMIN``: the conntrack sysctls and ``oomScoreAdj``.

    Refusals are logged and never fatal (a container's ``/proc/sys`` may be read-only).
    """
    paths = paths or HostPaths()
    result = apply_conntrack_sysctls(
        conntrack_sysctls(options.conntrack),
        proc_root=paths.proc_sys,
        hashsize_path=paths.conntrack_hashsize,
        files=files,
    )
    apply_oom_score_adj(options.oom_score_adj, paths.oom_score_adj)
    return result


# --- events without an API server -------------------------------------------------------


class LoggingEventSink(NodeEventSink):
    """An :class:`~kubeproxy.events.EventSink` with nowhere to post (manifests, dry runs).

    Each event becomes one info log line instead.
    """

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> None:
        """Log the event."""
        ref = regarding or ObjectReference.node(self.node_name)
        where = f"{ref.namespace}/{ref.name}" if ref.namespace else ref.name
        logger.info(
            "Event (not posted: no API server): %s %s/%s about %s %s%s",
            type_,
            reason,
            action,
            ref.kind,
            where,
            f": {note}" if note else "",
        )


# --- the garbage collector --------------------------------------------------------------


def _set_threshold(gen0: int, gen1: int, gen2: int) -> None:
    gc.set_threshold(gen0, gen1, gen2)


@dataclass(frozen=True, slots=True)
class GcOps:
    """The garbage-collector calls :class:`GcTuner` makes (tests record them instead)."""

    collect: Callable[[], int] = gc.collect
    freeze: Callable[[], None] = gc.freeze
    set_threshold: Callable[[int, int, int], None] = _set_threshold


class GcTuner:
    """A :class:`~kubeproxy.proxier.SyncHook`: once every family has completed a full sync,
    collect, :func:`gc.freeze` and raise the collector's thresholds, once.

    After the first full sync the process holds its working set (about 720,000 objects at
    30k Services, proxy core alone) for the rest of its life; frozen, collections no
    longer scan it, and higher thresholds make them rarer. Collecting first keeps start-up
    garbage out of the frozen generation. Measured on this project's machine (proxy core
    with a no-op backend, 30k Services, 5,000 partial syncs): 38 ms in the collector by
    default, 22 ms frozen, none with the raised thresholds as well. The collector is a
    small share of a sync either way; with the in-memory nftables fake as the backend the
    difference was lost in the noise.
    """

    def __init__(
        self,
        families: Iterable[IPFamily],
        ops: GcOps | None = None,
        thresholds: tuple[int, int, int] = GC_THRESHOLDS,
    ) -> None:
        self.ops = ops or GcOps()
        self.thresholds = thresholds
        self._waiting = set(families)
        self._lock = threading.Lock()
        self.done = False

    def __call__(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Note a successful sync; tune the collector after the last family's first full one."""
        if not changes.full:
            return
        with self._lock:
            if self.done:
                return
            self._waiting.discard(snapshot.family)
            if self._waiting:
                return
            self.done = True
        self.ops.collect()
        self.ops.freeze()
        self.ops.set_threshold(*self.thresholds)
        logger.info(
            "First full sync done: %d objects frozen out of the garbage collector; thresholds %s",
            gc.get_freeze_count(),
            self.thresholds,
        )


# --- the daemon -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceTuning:
    """How the Kubernetes source pages, times out and backs off (tests make it brisk)."""

    page_size: int = 500
    watch_timeout: float = 300.0
    request_timeout: float = 60.0
    initial_backoff: float = 0.8
    max_backoff: float = 30.0


@dataclass(slots=True)
class _Source:
    """The started (or loaded) source, and how to run and stop it."""

    source: ManifestSource | KubernetesSource
    node: KubeObject | None
    wait_synced: Callable[[float], bool]
    join: Callable[[float], bool] = field(default=lambda _timeout: True)
    poll: Callable[[threading.Event], None] | None = None
    # What the source could not use (files that did not parse): --once fails on any.
    problems: Callable[[], list[str]] = field(default=lambda: [])
    # Whether a missing Node was already explained (so the loopback warning is not needed).
    node_explained: bool = False


class Daemon:
    """The proxy, built by :func:`build_daemon`: :meth:`start`, :meth:`stop`, or
    :meth:`sync_once`.

    The attributes are the pieces, for tests and for the binaries: ``proxiers`` by family,
    ``handler`` (the proxier, or a :class:`~kubeproxy.proxier.DualStackProxier`), the
    ``metrics`` and ``health`` state and their servers, ``events``, the ``source``, the
    self-healing ``healer`` and its ``watchers`` (started by :meth:`start` only).
    """

    def __init__(
        self,
        *,
        options: Options,
        node: NodeInfo,
        node_ips: NodeIPs,
        proxiers: Mapping[IPFamily, Proxier],
        source: _Source,
        gate: HandlerGate,
        metrics: ProxyMetrics,
        metrics_server: MetricsServer,
        health: ProxyHealth,
        health_server: ProxyHealthServer,
        health_observer: HealthObserver,
        events: EventSink,
        gc_tuner: GcTuner,
        stop: threading.Event,
        healer: SelfHealer | None = None,
        watchers: Sequence[Watcher] = (),
        startup_warnings: Sequence[StartupWarning] = (),
        before_first_sync: Callable[[], object] | None = None,
    ) -> None:
        self.options = options
        self.node = node
        self.node_ips = node_ips
        self.proxiers = dict(proxiers)
        self.families = list(self.proxiers)
        self.handler: Proxier | DualStackProxier = (
            DualStackProxier(self.proxiers[IPFamily.IPV4], self.proxiers[IPFamily.IPV6])
            if len(self.proxiers) == 2
            else self.proxiers[IPFamily.IPV4]
        )
        self._source = source
        self.source = source.source
        self.gate = gate
        self.metrics = metrics
        self.metrics_server = metrics_server
        self.health = health
        self.health_server = health_server
        self.health_observer = health_observer
        self.events = events
        self.gc_tuner = gc_tuner
        self.healer = healer if healer is not None else SelfHealer(self.proxiers)
        self.watchers = tuple(watchers)
        self.startup_warnings = tuple(startup_warnings)
        self._before_first_sync = before_first_sync
        self._stop = stop
        self._threads: list[threading.Thread] = []
        self._stopped = False

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask :meth:`wait` to return (safe from a signal handler)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is requested; False if ``timeout`` seconds passed first."""
        return self._stop.wait(timeout)

    def start(self) -> None:
        """Post the start-up warnings, serve health and metrics, run the
        ``before_first_sync`` step (removing other modes' rules), post ``Starting``, sync,
        and run the sync loops.

        Raises :class:`StartupError` when a server cannot bind with
        ``bindAddressHardFail`` (after posting the Warning event upstream posts); nothing
        of ``before_first_sync`` has run then.
        """
        if self._threads:
            raise RuntimeError("the daemon is already running")
        for warning in self.startup_warnings:
            self.events.warning(warning.reason, warning.action, warning.note)
        self._serve(self.health_server.start, REASON_FAILED_HEALTHCHECK)
        self._serve(self.metrics_server.start, REASON_FAILED_METRICS)
        self._prepare_first_sync()
        self.events.starting()
        # Watching starts before the first sync, so nothing done after it goes unseen.
        self.healer.start(self.watchers, self._stop)
        self.gate.bind(self.handler)
        for proxier in self.proxiers.values():
            self._spawn(f"sync-loop-{proxier.family.value}", self._sync_loop, proxier)
        if self._source.poll is not None:
            self._spawn("manifests", self._source.poll, self._stop)
        logger.info("kube-proxy started for node %s", self.node.name)

    def sync_once(self, timeout: float = NODE_WAIT_TIMEOUT) -> bool:
        """Sync once after the source's initial list (``--once``); True on success.

        The valid objects are synced even when the source reported input it could not
        use (a manifest file that did not parse); that is still a failure, logged once
        more at the end, so a pre-flight check or CI run notices.
        """
        self._prepare_first_sync()
        self.gate.bind(self.handler)
        if not self._source.wait_synced(timeout):
            logger.error("The initial list did not complete within %gs", timeout)
            return False
        deadline = time.monotonic() + timeout
        while not self.handler.initialized:
            if self._stop.is_set() or time.monotonic() > deadline:
                return False
            self._stop.wait(_POLL)
        synced = self.handler.sync_now()
        problems = self._source.problems()
        if problems:
            logger.error(
                "Synced what could be used; %d input problem(s): %s",
                len(problems),
                "; ".join(problems),
            )
        return synced and not problems

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """Stop everything this daemon runs; the kernel rules stay as they are."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if not self._source.join(timeout):
            logger.warning("The source did not stop within %gs", timeout)
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("Thread %s did not stop within %gs", thread.name, timeout)
        for name in self.healer.join(timeout):
            logger.warning("Thread %s did not stop within %gs", name, timeout)
        self.health_server.stop()
        self.metrics_server.stop()
        self.health_observer.close()
        close = getattr(self.events, "close", None)
        if callable(close):
            close(timeout)
        logger.info("kube-proxy stopped; the rules stay in place")

    def _prepare_first_sync(self) -> None:
        step, self._before_first_sync = self._before_first_sync, None
        if step is not None:
            step()

    def _serve(self, start: Callable[[], None], reason: str) -> None:
        try:
            start()
        except ServerBindError as err:
            self.events.warning(reason, ACTION_START, str(err))
            raise StartupError(str(err)) from err

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _sync_loop(self, proxier: Proxier) -> None:
        self.metrics.sync_loop_started(proxier.family)
        proxier.run(self._stop)


# --- building it ------------------------------------------------------------------------


def _open_manifests(directory: Path, gate: HandlerGate, options: Options) -> _Source:
    source = ManifestSource(directory, gate, node_name=options.node_name)
    try:
        source.load()
    except OSError as err:
        raise StartupError(f"--manifests: {err}") from None
    others = source.node_names
    explained = gate.node is None and bool(others)
    if explained:
        whose = (
            "--hostname-override"
            if options.configuration.hostname_override
            else "this host's name (no --hostname-override given)"
        )
        logger.warning(
            "--manifests %s holds no Node named %s (%s) but Nodes %s: set --hostname-override "
            "to the Node this proxy runs as; using this host's addresses meanwhile",
            directory,
            options.node_name,
            whose,
            ", ".join(others),
        )
    return _Source(
        source,
        gate.node,
        wait_synced=lambda _t: True,
        poll=source.run,
        problems=lambda: [f"{path}: did not parse" for path in source.broken],
        node_explained=explained,
    )


def _api_client(options: Options) -> Any:
    from kubeproxy.sources.kubernetes import make_api_client

    try:
        return make_api_client(
            options.kubeconfig,
            options.master,
            qps=options.qps,
            burst=options.burst,
            content_type=options.content_type,
        )
    except Exception as err:  # the client raises its own ConfigException, among others
        raise StartupError(f"cannot build the Kubernetes API client: {err}") from None


def _open_api(
    api: Any,
    gate: HandlerGate,
    options: Options,
    *,
    tuning: SourceTuning,
    node_timeout: float,
    stop: threading.Event,
    exit: Callable[[int], object] | None,
) -> _Source:
    from kubeproxy.sources.kubernetes import KubernetesSource, NodeWatcher, exit_process

    watch_pod_cidrs = options.configuration.detect_local_mode == "NodeCIDR"
    watcher = NodeWatcher(
        options.node_name,
        watch_pod_cidrs=watch_pod_cidrs,
        exit=exit if exit is not None else exit_process,
    )
    source = KubernetesSource(
        api,
        gate,
        options.node_name,
        node_watcher=watcher,
        page_size=tuning.page_size,
        watch_timeout=tuning.watch_timeout,
        request_timeout=tuning.request_timeout,
        initial_backoff=tuning.initial_backoff,
        max_backoff=tuning.max_backoff,
    )
    # The source has a stop of its own: it must also stop when start-up fails.
    source_stop = threading.Event()

    def halt(timeout: float) -> bool:
        source_stop.set()
        return source.join(timeout)

    source.start(source_stop)
    logger.info("Waiting up to %gs for Node %s", node_timeout, options.node_name)
    deadline = time.monotonic() + node_timeout
    while not watcher.wait_until_ready(min(0.5, max(0.0, deadline - time.monotonic()))):
        if stop.is_set():
            halt(_STOP_TIMEOUT)
            raise StartupInterrupted(f"stopped while waiting for Node {options.node_name}")
        if time.monotonic() >= deadline:
            halt(_STOP_TIMEOUT)
            what = "host IPs and pod CIDRs" if watch_pod_cidrs else "host IPs"
            raise StartupError(
                f"Node {options.node_name} did not appear with {what} within {node_timeout:g}s"
            )
    return _Source(source, watcher.node, wait_synced=source.wait_for_sync, join=halt)


def _node_info(node: KubeObject | None, name: str, addresses: Sequence[IPAddress]) -> NodeInfo:
    if node is not None:
        try:
            return parse_node(node)
        except InvalidObject as err:
            logger.warning("%s; using this host's addresses", err)
    found = sorted((a for a in addresses if not a.is_loopback), key=lambda a: (a.version, int(a)))
    return NodeInfo(name=name, addresses=tuple(found))


def _make_backends(
    factory: BackendFactory,
    families: Sequence[IPFamily],
    config: ProxierConfig,
    netns: str | None,
) -> dict[IPFamily, Backend]:
    backends: dict[IPFamily, Backend] = {}
    for family in families:
        try:
            backends[family] = factory(family, config, netns=netns)
        except Exception as err:
            if family is IPFamily.IPV4:
                raise StartupError(f"cannot set up the {family} backend: {err}") from None
            logger.warning("Cannot set up the %s backend (%s); running single-stack", family, err)
    return backends


def _listen_error_reporter(events: EventSink) -> Callable[[NamespacedName, int, str], None]:
    def report(service: NamespacedName, port: int, message: str) -> None:
        ref = ObjectReference.service(service.namespace, service.name, uid=str(service))
        events.record(WARNING, REASON_FAILED_SERVICE_HEALTHCHECK, ACTION_LISTEN, message, ref)

    return report


def build_daemon(
    options: Options,
    backend_factory: BackendFactory,
    *,
    mode: str = "nftables",
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
) -> Daemon:
    """Build the proxy for ``options``, up to the point where :meth:`Daemon.start` runs it.

    With ``options.manifests`` the directory is loaded; otherwise an API client is made
    from the options (or ``api`` is used) and the Kubernetes source starts, waiting up to
    ``node_timeout`` seconds for this Node (its deliveries are held until the daemon
    starts). Executors default to the real ones of the current network namespace, or of
    ``netns``: ``backend_factory(family, config, netns=netns)``, ``host_addresses``
    (netlink), ``conntrack`` (ctnetlink). ``events`` defaults to an
    :class:`~kubeproxy.events.EventRecorder` with the API, a :class:`LoggingEventSink`
    with manifests. ``privileged`` applies :func:`privileged_setup` (through ``paths``
    and ``sysctl_files``). ``exit`` is what the NodeWatcher calls when the Node's IPs
    change (default: end the process). ``watchers`` makes the mode's self-healing
    watchers (none without it). ``startup_warnings`` are posted as events when the
    daemon starts. ``before_first_sync`` runs once every backend exists and (for a
    daemon) the servers are bound, right before the first sync: the binaries remove the
    other modes' rules there, so a mode that cannot run, or a server that cannot bind
    with ``bindAddressHardFail``, leaves them in place. Raises :class:`StartupError`.
    """
    stop = stop if stop is not None else threading.Event()
    gate = HandlerGate()
    lister = host_addresses if host_addresses is not None else HostAddresses()

    def list_host_addresses() -> list[IPAddress]:
        return [a for a in lister.list_addresses(netns) if not a.is_link_local]

    if options.manifests is not None:
        source = _open_manifests(options.manifests, gate, options)
    else:
        api = api if api is not None else _api_client(options)
        source = _open_api(
            api,
            gate,
            options,
            tuning=tuning or SourceTuning(),
            node_timeout=node_timeout,
            stop=stop,
            exit=exit,
        )
    try:
        return _assemble(
            options,
            backend_factory,
            source=source,
            gate=gate,
            stop=stop,
            mode=mode,
            api=api if options.manifests is None else None,
            netns=netns,
            list_host_addresses=list_host_addresses,
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
        )
    except BaseException:
        source.join(_STOP_TIMEOUT)
        raise


@dataclass(frozen=True, slots=True)
class _Health:
    """The metrics and health state, their servers, and the per-family health checks."""

    metrics: ProxyMetrics
    metrics_server: MetricsServer
    health: ProxyHealth
    health_server: ProxyHealthServer
    observer: HealthObserver


def _health_and_metrics(
    options: Options,
    mode: str,
    node: NodeInfo,
    sync_period: float,
    families: Sequence[IPFamily],
    events: EventSink,
) -> _Health:
    """Upstream's servers: metrics, /healthz and /livez (2 x syncPeriod), Service checks."""
    hard_fail = options.bind_address_hard_fail
    metrics = ProxyMetrics(mode=mode)
    health = ProxyHealth(2 * sync_period, node=node)
    report = _listen_error_reporter(events)
    service_health = {
        family: ServiceHealthServer(
            family, health, node_name=options.node_name, on_listen_error=report
        )
        for family in families
    }
    return _Health(
        metrics,
        MetricsServer(
            options.metrics_bind_address,
            metrics,
            hard_fail=hard_fail,
            configz=config_document(options.configuration),
        ),
        health,
        ProxyHealthServer(options.healthz_bind_address, health, metrics, hard_fail=hard_fail),
        HealthObserver(health, service_health),
    )


def _log_families(families: Sequence[IPFamily], node_ips: NodeIPs, mode: str) -> None:
    if len(families) == 2:
        logger.info(
            "kube-proxy running in dual-stack mode (primary IP family %s)",
            node_ips.primary_family,
        )
    else:
        logger.info("kube-proxy running in single-stack mode (IP family %s)", families[0])
    logger.info("Using %s Proxier", mode)


def _assemble(
    options: Options,
    backend_factory: BackendFactory,
    *,
    source: _Source,
    gate: HandlerGate,
    stop: threading.Event,
    mode: str,
    api: Any,
    netns: str | None,
    list_host_addresses: Callable[[], list[IPAddress]],
    conntrack: ConntrackExecutor | None,
    events: EventSink | None,
    privileged: bool,
    paths: HostPaths | None,
    sysctl_files: SysctlFiles | None,
    ipv6_supported: bool | None,
    gc_ops: GcOps | None,
    backend_hooks: BackendHooks | None,
    watchers: WatcherFactory | None,
    startup_warnings: Sequence[StartupWarning],
    before_first_sync: Callable[[], object] | None,
) -> Daemon:
    """Everything after the source, in upstream's order: node IPs and families, events,
    the privileged set-up, backends, servers, the conntrack reconciler, proxiers; then
    the self-healing watchers."""
    node = _node_info(source.node, options.node_name, list_host_addresses())
    node_ips = detect_node_ips(
        host_ips(node.addresses),
        options.configuration.bind_address,
        explain_loopback=not source.node_explained,
    )
    config = expand_primary(options.config, node_ips)
    supported = kernel_supports_ipv6() if ipv6_supported is None else ipv6_supported
    families = detect_families(node_ips, ipv6_supported=supported)
    if events is None:
        events = EventRecorder(api, options.node_name) if api is not None else None
        events = events or LoggingEventSink(options.node_name)
    if privileged:
        privileged_setup(options, paths, files=sysctl_files)
    backends = _make_backends(backend_factory, families, config, netns)
    families = list(backends)
    _log_families(families, node_ips, mode)
    parts = _health_and_metrics(options, mode, node, config.sync_period, families, events)
    metrics = parts.metrics
    executor = conntrack if conntrack is not None else NetlinkConntrack(netns)
    reconciler = ConntrackReconciler(executor, metrics)
    gc_tuner = GcTuner(families, gc_ops)
    # A process that syncs once and exits has no long life to tune the collector for.
    tuning = () if options.once or options.dry_run else (gc_tuner,)
    watching = list(watchers(list(backends.values()), netns)) if watchers is not None else []
    # /healthz answers 503 from a report of rules changed by others until their repair.
    healer = SelfHealer({}, counter=metrics, events=events, kernel_state=parts.health)
    healing = tuple(w.after_sync for w in watching)
    proxiers: dict[IPFamily, Proxier] = {}
    for family, backend in backends.items():
        extra = tuple(backend_hooks(backend, metrics)) if backend_hooks is not None else ()
        hooks = [item for item in extra if callable(item)]
        observers = [cast(SyncObserver, o) for o in extra if hasattr(o, "sync_finished")]
        proxiers[family] = Proxier(
            family,
            config,
            backend,
            node=node,
            host_addresses=list_host_addresses,
            observer=ObserverGroup([metrics, parts.observer, *observers, healer]),
            conntrack=reconciler,
            after_sync=(
                metrics.after_sync,
                parts.observer.after_sync,
                *hooks,
                *healing,
                *tuning,
            ),
        )
        metrics.track(proxiers[family])
    healer.proxiers.update(proxiers)
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
        health_observer=parts.observer,
        events=events,
        gc_tuner=gc_tuner,
        stop=stop,
        healer=healer,
        watchers=watching,
        startup_warnings=startup_warnings,
        before_first_sync=before_first_sync,
    )


# --- running it -------------------------------------------------------------------------


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` inside the block; the old handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return

    def handle(signum: int, _frame: FrameType | None) -> None:
        # Leave the rules in place: the next instance takes the table over as it is.
        logger.info("Received signal %d, stopping (rules stay in place)", signum)
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_daemon(
    options: Options,
    backend_factory: BackendFactory,
    *,
    mode: str = "nftables",
    backend_hooks: BackendHooks | None = None,
    watchers: WatcherFactory | None = None,
    paths: HostPaths | None = None,
    **build: Any,
) -> int:
    """Run the proxy as ``options`` say; returns the process exit code.

    ``--init-only`` does :func:`privileged_setup` and returns; ``--once``/``--dry-run``
    sync once after the initial list, without the privileged set-up (``--dry-run`` also
    without the conntrack cleanup and events, so nothing outside the backend's executor
    is touched); otherwise the daemon runs until SIGTERM or SIGINT, with the self-healing
    ``watchers`` (not for one-shot runs). ``build`` goes to :func:`build_daemon`.
    """
    if options.init_only:
        privileged_setup(options, paths)
        logger.info("System initialized and --init-only specified; exiting")
        return 0
    if options.once or options.dry_run:
        build["privileged"] = False
        watchers = None
    if options.dry_run:
        build.setdefault("conntrack", FakeConntrack())
        build.setdefault("events", LoggingEventSink(options.node_name))
    stop = threading.Event()
    with _stopping_on_signals(stop):
        try:
            daemon = build_daemon(
                options,
                backend_factory,
                mode=mode,
                backend_hooks=backend_hooks,
                watchers=watchers,
                paths=paths,
                stop=stop,
                **build,
            )
        except StartupInterrupted as err:
            logger.info("%s; exiting", err)
            return 0
        except StartupError as err:
            logger.error("%s", err)
            return 1
        try:
            return _run(daemon, once=options.once or options.dry_run)
        finally:
            daemon.stop()


def _run(daemon: Daemon, *, once: bool) -> int:
    """Sync once, or start and run until stopped; the exit code."""
    if once:
        return 0 if daemon.sync_once() else 1
    try:
        daemon.start()
    except StartupError as err:
        logger.error("%s", err)
        return 1
    daemon.wait()
    return 0
