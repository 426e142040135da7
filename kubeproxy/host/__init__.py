"""Host plumbing: the Linux and HTTP machinery under the proxy, with no Service semantics.

What is here talks to the machine, not to the cluster: the one netlink codec
(:mod:`~kubeproxy.host.nlmsg`) and the host-address client built on it
(:mod:`~kubeproxy.host.netlink`), entering a network namespace
(:mod:`~kubeproxy.host.netns`), the processes our kernel-tool executors spawned
(:mod:`~kubeproxy.host.children`), the conntrack sysctls (:mod:`~kubeproxy.host.sysctl`),
the capabilities this process holds (:mod:`~kubeproxy.host.capabilities`) and the
listeners of the proxy's small HTTP servers (:mod:`~kubeproxy.host.httpserving`).

Why a package of its own: the backends, conntrack, the nf_tables event watcher, health,
metrics, the loopback proxy and the daemon all stand on these modules, and none of them
needs a Service, an endpoint or a sync to do its job. Kept apart, they read, test and
change without the proxy's logic, and the top of :mod:`kubeproxy` shows the core.

The rule (``tests/test_layering.py`` holds it): a module here imports nothing of
``kubeproxy`` but other host modules and :mod:`kubeproxy.objects`, the plain value types
(an address family, a network) every layer shares. Code that needs what a Service means
belongs in the core, a backend or the daemon, not here. Nothing is re-exported: import
the module you use (``from kubeproxy.host.netns import run_in_netns``).
"""
