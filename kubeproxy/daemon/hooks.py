"""What a proxy plugs into the daemon beside its backend factory.

* :data:`BackendHooks`: called once per backend (one per family) with a
  :class:`BackendContext`; returns after-sync hooks and sync observers for that backend's
  proxier. That is where a proxy adds its own metrics (collectors registered in
  ``context.metrics.registry`` are served on ``/metrics`` with upstream's), its own health
  conditions (``context.health.report_data_plane_broken`` / ``..._repaired`` with a cause
  of its own: ``/healthz`` and the HealthCheckNodePorts answer 503 with the reason until
  the repair) and its own Events (``context.events``). Our modes wire their
  backend-specific metrics this way.
* :data:`WatcherFactory`: the self-healing watchers of the backends (see
  :mod:`kubeproxy.selfheal`), started with the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kubeproxy.backend import Backend
from kubeproxy.events import EventSink
from kubeproxy.health import ProxyHealth
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import SyncHook, SyncObserver
from kubeproxy.selfheal import Watcher

__all__ = ["BackendContext", "BackendHooks", "WatcherFactory"]


@dataclass(frozen=True, slots=True)
class BackendContext:
    """One backend and what the daemon lets its hooks reach.

    ``metrics`` (upstream's metrics; its ``registry`` takes collectors of your own),
    ``health`` (data-plane faults: ``/healthz`` answers 503 while one is reported) and
    ``events`` (Events about the Node) are shared by every family's backend.
    """

    backend: Backend
    family: IPFamily
    metrics: ProxyMetrics
    health: ProxyHealth
    events: EventSink


BackendHooks = Callable[[BackendContext], Iterable[SyncHook | SyncObserver]]
"""Extra pieces for one backend: each item that is callable runs as an after-sync hook of
its proxier (:class:`~kubeproxy.proxier.SyncHook`, after successful syncs), each one with
``sync_finished`` hears every sync of the daemon (failed ones too) as a
:class:`~kubeproxy.proxier.SyncObserver`."""

WatcherFactory = Callable[[Sequence[Backend], str | None], Sequence[Watcher]]
"""Makes a mode's self-healing watchers for its backends (one per family) in a network
namespace (None: the current one); see :mod:`kubeproxy.selfheal`."""
