"""The running proxy: :class:`Daemon` starts its servers and sync loops, and stops them.

:func:`~kubeproxy.daemon.build_daemon` makes one (everything that could stop a start has
happened by then, except binding the servers); :meth:`Daemon.start` runs it, or
:meth:`Daemon.sync_once` syncs once; :meth:`Daemon.stop` leaves the kernel rules in place
for the next instance to take over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kubeproxy.daemon.errors import StartupError
from kubeproxy.daemon.gate import HandlerGate
from kubeproxy.daemon.gctuning import GcTuner
from kubeproxy.daemon.nodeips import NodeIPs
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.daemon.serving import Servers
from kubeproxy.daemon.sources import NODE_WAIT_TIMEOUT, STOP_TIMEOUT, StartedSource
from kubeproxy.daemon.wiring import AfterFirstSync, DaemonPlugins
from kubeproxy.events import (
    ACTION_START,
    REASON_FAILED_HEALTHCHECK,
    REASON_FAILED_METRICS,
    EventSink,
)
from kubeproxy.health import HealthObserver
from kubeproxy.host.httpserving import ServerBindError
from kubeproxy.host.netlink import AddressWatcher
from kubeproxy.objects import IPFamily, NodeInfo
from kubeproxy.proxier import DualStackProxier, Proxier
from kubeproxy.selfheal import SelfHealer, Watcher

__all__ = ["Daemon", "DaemonParts"]

logger = logging.getLogger(__name__)

_POLL: Final = 0.05


@dataclass(frozen=True, slots=True)
class DaemonParts:
    """What :func:`~kubeproxy.daemon.build_daemon` built for a :class:`Daemon`: this node
    (``node``, ``node_ips``), one proxier per family, the started source and the gate
    holding its deliveries, the metrics and health state with their ``servers``
    (``serving``: bound already), the health observer, the event sink, the collector's
    tuner, the ``stop`` that ends the run, the self-healer with its ``watchers``, and the
    host-address watcher (None with a fake lister)."""

    node: NodeInfo
    node_ips: NodeIPs
    proxiers: Mapping[IPFamily, Proxier]
    source: StartedSource
    gate: HandlerGate
    servers: Servers
    health_observer: HealthObserver
    events: EventSink
    gc_tuner: GcTuner
    stop: threading.Event
    healer: SelfHealer | None = None
    watchers: Sequence[Watcher] = ()
    address_watcher: AddressWatcher | None = None
    serving: bool = False


class Daemon:
    """The proxy, built by :func:`~kubeproxy.daemon.build_daemon`: :meth:`start`,
    :meth:`stop`, or :meth:`sync_once`.

    The attributes are the pieces, for tests and for whoever embeds it: ``proxiers`` by
    family, ``handler`` (the proxier, or a :class:`~kubeproxy.proxier.DualStackProxier`),
    the ``metrics`` and ``health`` state and their servers, ``events``, the ``source``,
    the self-healing ``healer`` and its ``watchers`` (started by :meth:`start` only), and
    ``name``, the proxy's name in the logs (from its
    :class:`~kubeproxy.daemon.wiring.DaemonPlugins`, with the start-up warnings and the
    ``before_first_sync`` step).
    """

    def __init__(
        self,
        options: DaemonOptions,
        parts: DaemonParts,
        plugins: DaemonPlugins | None = None,
    ) -> None:
        plugins = plugins if plugins is not None else DaemonPlugins()
        self.options = options
        self.name = plugins.name
        self.node = parts.node
        self.node_ips = parts.node_ips
        self.proxiers = dict(parts.proxiers)
        self.families = list(self.proxiers)
        self.handler: Proxier | DualStackProxier = (
            DualStackProxier(self.proxiers[IPFamily.IPV4], self.proxiers[IPFamily.IPV6])
            if len(self.proxiers) == 2
            else self.proxiers[IPFamily.IPV4]
        )
        self._source = parts.source
        self.source = parts.source.source
        self.gate = parts.gate
        self.metrics = parts.servers.metrics
        self.metrics_server = parts.servers.metrics_server
        self.health = parts.servers.health
        self.health_server = parts.servers.health_server
        self.health_observer = parts.health_observer
        self.events = parts.events
        self.gc_tuner = parts.gc_tuner
        self.healer = parts.healer if parts.healer is not None else SelfHealer(self.proxiers)
        self.watchers = tuple(parts.watchers)
        self.startup_warnings = tuple(plugins.startup_warnings)
        self._before_first_sync = plugins.before_first_sync
        self._after_first_sync = plugins.after_first_sync
        self._serving = parts.serving
        self.address_watcher = parts.address_watcher
        self._stop = parts.stop
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
        """Post the start-up warnings, serve health and metrics (unless they already
        are), run the ``before_first_sync`` step, post ``Starting``, have the source
        deliver (the first sync), and run the sync loops, and the ``after_first_sync``
        step (removing what the node's previous proxy left) once every family synced.

        Raises :class:`StartupError` when a server cannot bind with
        ``bindAddressHardFail`` (after posting the Warning event upstream posts); nothing
        of ``before_first_sync`` has run then.
        """
        if self._threads:
            raise RuntimeError("the daemon is already running")
        for warning in self.startup_warnings:
            self.events.warning(warning.reason, warning.action, warning.note)
        if not self._serving:
            self._serve(self.health_server.start, REASON_FAILED_HEALTHCHECK)
            self._serve(self.metrics_server.start, REASON_FAILED_METRICS)
            self._serving = True
        self._prepare_first_sync()
        self.events.starting()
        # Watching starts before the first sync, so nothing done after it goes unseen.
        self.healer.start(self.watchers, self._stop)
        if self.address_watcher is not None:
            self._spawn("host-addresses", self.address_watcher.run, self._stop)
        self._deliver()
        for proxier in self.proxiers.values():
            self._spawn(f"sync-loop-{proxier.family.value}", self._sync_loop, proxier)
        if self._after_first_sync is not None:
            self._spawn("after-first-sync", self._when_synced, self._after_first_sync)
        if self._source.poll is not None:
            self._spawn("manifests", self._source.poll, self._stop)
        logger.info("%s started for node %s", self.name, self.node.name)

    def _deliver(self) -> None:
        """Bind the source to the proxiers and have it deliver, the collector held off
        until the first full syncs (:meth:`~kubeproxy.daemon.gctuning.GcTuner.hold`)."""
        self.gate.bind(self.handler)
        self.gc_tuner.hold()
        self._source.begin()

    def sync_once(self, timeout: float = NODE_WAIT_TIMEOUT) -> bool:
        """Sync once after the source's initial list (``--once``), then run the
        ``after_first_sync`` step if the sync succeeded; True on success.

        The valid objects are synced even when the source reported input it could not
        use (a manifest file that did not parse); that is still a failure, logged once
        more at the end, so a pre-flight check or CI run notices.
        """
        self._prepare_first_sync()
        self._deliver()
        if not self._source.wait_synced(timeout):
            logger.error("The initial list did not complete within %gs", timeout)
            return False
        deadline = time.monotonic() + timeout
        while not self.handler.initialized:
            if self._stop.is_set() or time.monotonic() > deadline:
                return False
            self._stop.wait(_POLL)
        synced = self.handler.sync_now()
        step, self._after_first_sync = self._after_first_sync, None
        if synced and step is not None:
            step(self.proxiers, self._stop)
        problems = self._source.problems()
        if problems:
            logger.error(
                "Synced what could be used; %d input problem(s): %s",
                len(problems),
                "; ".join(problems),
            )
        return synced and not problems

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop everything this daemon runs, backends' own threads and sockets included
        (their ``close()``); the kernel rules stay as they are."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self.address_watcher is not None:
            self.address_watcher.close()
        if not self._source.join(timeout):
            logger.warning("The source did not stop within %gs", timeout)
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("Thread %s did not stop within %gs", thread.name, timeout)
        for name in self.healer.join(timeout):
            logger.warning("Thread %s did not stop within %gs", name, timeout)
        for proxier in self.proxiers.values():
            # A backend holding more than kernel state (threads, sockets) closes it.
            close = getattr(proxier.backend, "close", None)
            if callable(close):
                close()
        self.health_server.stop()
        self.metrics_server.stop()
        self.health_observer.close()
        self.gc_tuner.release()
        close = getattr(self.events, "close", None)
        if callable(close):
            close(timeout)
        logger.info("%s stopped; the rules stay in place", self.name)

    def _prepare_first_sync(self) -> None:
        step, self._before_first_sync = self._before_first_sync, None
        if step is not None:
            step()

    def _when_synced(self, step: AfterFirstSync) -> None:
        """Run ``step`` once every family has synced successfully (unless stopped first)."""
        while not self._stop.wait(_POLL):
            if set(self.families) <= set(self.health.health().status):
                try:
                    step(self.proxiers, self._stop)
                except Exception:  # the proxy goes on: its rules are in place
                    logger.exception("The step after the first sync failed")
                return

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
