"""What a daemon is wired with beside its options and backend factory: two option objects.

:func:`~kubeproxy.daemon.build_daemon` and :func:`~kubeproxy.daemon.run_daemon` used to
take some twenty keywords of two different kinds, and ``run_daemon`` forwarded them as
``**Any``, so a typo reached nobody's type checker. They are two objects now, grouped by
who sets them:

* :class:`DaemonPlugins`: what a proxy built on the library adds, whoever runs it: its
  name and mode, its per-backend hooks, its self-healing watchers, the warnings it posts
  at start-up and the step it runs right before the first sync. Our binaries set these.
* :class:`DaemonSeams`: what the daemon otherwise takes from the host and the process:
  the API client, the network namespace, the executors and probes of the node (host
  addresses, conntrack, sysctls, ``/proc`` paths, IPv6 support, the garbage collector),
  the event sink, the source's timing, the exit and stop of the process. A node leaves
  them all at their defaults; tests and benchmarks pass fakes.

The backend factory stays the one positional argument beside the options: every caller
has one, and nothing else is needed to run a proxy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kubeproxy.conntrack import ConntrackExecutor
from kubeproxy.daemon.events import StartupWarning
from kubeproxy.daemon.gctuning import GcOps
from kubeproxy.daemon.hooks import BackendHooks, WatcherFactory
from kubeproxy.daemon.privileged import HostPaths
from kubeproxy.daemon.sources import NODE_WAIT_TIMEOUT, SourceTuning
from kubeproxy.debugpages import ModePages
from kubeproxy.events import EventSink
from kubeproxy.host.netlink import HostAddressLister
from kubeproxy.host.sysctl import SysctlFiles
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import Proxier

__all__ = [
    "AfterFirstSync",
    "DaemonPlugins",
    "DaemonSeams",
]

AfterFirstSync = Callable[[Mapping[IPFamily, Proxier], threading.Event], object]
"""The step a daemon runs once every family has synced (:class:`DaemonPlugins`): given the
proxiers by family and the event that stops the daemon."""


@dataclass(frozen=True, slots=True)
class DaemonPlugins:
    """What a proxy built on the library plugs into the daemon.

    ``mode`` (``nftables``, ``iptables`` or ``ipvs``) picks upstream's mode-specific
    metrics and is what ``/proxyMode`` and the logs say; ``name`` is the proxy's name in
    the logs and the Events' ``reportingController``. ``backend_hooks`` adds the proxy's
    own hooks, metrics and health conditions per backend
    (:data:`~kubeproxy.daemon.hooks.BackendHooks`); ``watchers`` makes the self-healing
    watchers (none without it). ``startup_warnings`` are posted as events when the daemon
    starts. ``before_first_sync`` runs once every backend exists and (for a daemon) the
    servers are bound, right before the first sync, so a mode that cannot run leaves the
    node as it was. ``after_first_sync(proxiers, stop)`` runs once every family has synced
    successfully: in a thread of its own in a daemon (it returns soon after ``stop`` is
    set; a proxier's :meth:`~kubeproxy.proxier.Proxier.syncs_held` keeps its syncs off
    while it touches that backend), right after the sync in a one-shot run. Our binaries
    remove what the node's previous proxy left there (:mod:`kubeproxy.cmd.takeover`):
    its rules served until ours were written.
    """

    mode: str = "nftables"
    name: str = "kube-proxy"
    backend_hooks: BackendHooks | None = None
    watchers: WatcherFactory | None = None
    startup_warnings: Sequence[StartupWarning] = ()
    before_first_sync: Callable[[], object] | None = None
    after_first_sync: AfterFirstSync | None = None
    debug_pages: ModePages | None = None
    """The mode's own ``/debug/`` pages, served with the core's when the pages are on
    (``enableProfiling``: :mod:`kubeproxy.debugpages`)."""


@dataclass(frozen=True, slots=True)
class DaemonSeams:
    """What the daemon takes from the host and the process unless given (tests pass fakes).

    ``api``: the API client (default: one made from the options; unused with manifests).
    ``netns``: the network namespace the executors act in (default: the current one).
    ``host_addresses`` (netlink), ``conntrack`` (ctnetlink): the executors; with the real
    ``host_addresses`` lister an :class:`~kubeproxy.host.netlink.AddressWatcher` has the
    proxiers read the host's addresses again when one comes or goes. ``events``: default
    an :class:`~kubeproxy.events.EventRecorder` with the API, a
    :class:`~kubeproxy.daemon.events.LoggingEventSink` with manifests. ``privileged``
    applies :func:`~kubeproxy.daemon.privileged.privileged_setup` through ``paths`` and
    ``sysctl_files``. ``ipv6_supported``: None probes the kernel. ``gc_ops``: the garbage
    collector the :class:`~kubeproxy.daemon.gctuning.GcTuner` tunes. ``tuning``: how the
    Kubernetes source pages and backs off; ``node_timeout``: how long start-up waits for
    this Node. ``exit``: what the Node watcher calls when the Node's IPs change (default:
    end the process). ``stop``: setting it stops the daemon (and a start that waits).
    """

    api: object | None = None
    netns: str | None = None
    host_addresses: HostAddressLister | None = None
    conntrack: ConntrackExecutor | None = None
    events: EventSink | None = None
    privileged: bool = True
    paths: HostPaths | None = None
    sysctl_files: SysctlFiles | None = None
    ipv6_supported: bool | None = None
    gc_ops: GcOps | None = None
    tuning: SourceTuning | None = None
    node_timeout: float = NODE_WAIT_TIMEOUT
    exit: Callable[[int], object] | None = None
    stop: threading.Event | None = None
