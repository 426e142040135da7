"""The whole node daemon as a library: upstream kube-proxy's start-up and run loop over the core.

Give it options and a backend factory and it does what a kube-proxy does on a node::

    from kubeproxy.daemon import DaemonOptions, DaemonPlugins, run_daemon

    options = DaemonOptions.from_file("/var/lib/kube-proxy/config.conf", mode="nftables")
    plugins = DaemonPlugins(mode="nftables", name="my-proxy")
    sys.exit(run_daemon(options, my_backend_factory, plugins=plugins))

What a proxy adds (its name, hooks, watchers...) is a
:class:`~kubeproxy.daemon.wiring.DaemonPlugins`; what tests replace of the host and the
process (executors, probes, clocks, the API client) a
:class:`~kubeproxy.daemon.wiring.DaemonSeams` (:mod:`~kubeproxy.daemon.wiring`).

The binaries (:mod:`kubeproxy.cmd`) are this plus upstream's flags, the table of our
modes (their dry runs, backend-specific metrics, self-healing watchers, and the removal
of what the node's previous proxy left) and ``main()``. The steps, each in the module
named after it, follow upstream (``cmd/kube-proxy/app/server.go`` and ``server_linux.go``):

1. :mod:`~kubeproxy.daemon.options`: :class:`DaemonOptions`, the validated
   configuration (from a ``KubeProxyConfiguration`` or upstream's flags);
2. ``init_only``: the privileged set-up (:mod:`~kubeproxy.daemon.privileged`: conntrack
   sysctls, ``oomScoreAdj``), then exit 0;
3. :func:`build_daemon` (:mod:`~kubeproxy.daemon.startup`): for a daemon, the health
   and metrics servers first (``/livez`` within a second of the start, ``/healthz`` 503
   until the first sync); the source
   (:mod:`~kubeproxy.daemon.sources`: this Node and the ServiceCIDRs of a manifests
   directory, or of the API server with a wait of up to five minutes for this Node;
   what it delivers waits in a :class:`~kubeproxy.daemon.gate.HandlerGate`), the node
   IPs and families
   (:mod:`~kubeproxy.daemon.nodeips`), the event sink (:mod:`~kubeproxy.daemon.events`),
   the privileged set-up, one backend per family (a mode that cannot run stops here),
   health and metrics (:mod:`~kubeproxy.daemon.serving`), the conntrack reconciler, one
   proxier per family with the proxy's own hooks (:mod:`~kubeproxy.daemon.hooks`), the
   self-healing watchers;
4. :meth:`Daemon.start` (:mod:`~kubeproxy.daemon.daemon`): post the start-up warnings,
   bind the health and metrics servers unless bound already (with
   ``bindAddressHardFail`` a failure is fatal, after a Warning event), run the
   ``before_first_sync`` step, post ``Starting``, hand the proxiers what the source
   delivered and have it deliver the Services and EndpointSlices straight into them (the
   first sync; the collector held off meanwhile), start the sync loops and the
   host-address watcher, and once every family has synced the ``after_first_sync`` step
   (the binaries remove what the node's previous proxy left there: it served until ours
   were written);
5. SIGTERM or SIGINT (:func:`run_daemon`, :mod:`~kubeproxy.daemon.run`): stop the servers
   and threads; the kernel rules stay in place, for the next instance to take over.

``once`` (and ``dry_run``) syncs once after the initial list instead of steps 4-5
(``before_first_sync`` still runs first, ``after_first_sync`` after a successful sync),
without the privileged set-up: a one-shot sync
is a tool run, not a node's proxy, and must not retune the host's conntrack table.

Where we differ from upstream: ``init_only`` does not contact the API server (the
privileged set-up needs nothing from it, and an init container should not wait for the
Node); the source is started before the proxiers exist (our sources deliver the Node
with everything else), so the gate holds what it delivers until then; what the node's
previous proxy left (another mode, upstream's kube-proxy) is removed only once our first
sync of every family is in, so a failed start leaves the node's rules alone and a switch
never leaves the node without rules; and once every family has completed its
first full sync the process freezes its long-lived objects out of the garbage
collector's reach (:class:`~kubeproxy.daemon.gctuning.GcTuner`).

Nothing here imports a backend or :mod:`kubeproxy.cmd`.
"""

from kubeproxy.daemon.daemon import Daemon
from kubeproxy.daemon.errors import StartupError, StartupInterrupted
from kubeproxy.daemon.events import LoggingEventSink, StartupWarning
from kubeproxy.daemon.hooks import BackendContext, BackendHooks, WatcherFactory
from kubeproxy.daemon.options import DaemonOptions
from kubeproxy.daemon.run import run_daemon
from kubeproxy.daemon.startup import build_daemon
from kubeproxy.daemon.wiring import AfterFirstSync, DaemonPlugins, DaemonSeams

__all__ = [
    "AfterFirstSync",
    "BackendContext",
    "BackendHooks",
    "Daemon",
    "DaemonOptions",
    "DaemonPlugins",
    "DaemonSeams",
    "LoggingEventSink",
    "StartupError",
    "StartupInterrupted",
    "StartupWarning",
    "WatcherFactory",
    "build_daemon",
    "run_daemon",
]
