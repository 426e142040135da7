"""Stale UDP conntrack flows: finding them (the reconciler) and deleting them (executors).

UDP has no connection end, so a conntrack entry that DNATs a client to an endpoint that
went away keeps black-holing that client's packets until the entry times out (and a
client that keeps sending never lets it time out). :class:`ConntrackReconciler` follows
upstream's list-and-diff reconciler (kube-proxy 1.32+, ``pkg/proxy/conntrack``) including
the 1.37 change: after a sync that changed some UDP Service's endpoints, list the
family's UDP flows and delete those whose original destination is a Service frontend
(cluster IP, external IP or load-balancer VIP with the Service port, or any address with
the NodePort) and whose reply source ``IP:port`` is not a *serving* endpoint of that
port. A UDP Service without serving endpoints therefore loses all its flows (1.37;
earlier releases skipped such Services). Traffic policy, topology and terminating
state are deliberately ignored, as upstream; flows of deleted Services are left to
time out, as upstream.

Executors (:class:`ConntrackExecutor`) list and delete flows:

* :class:`NetlinkConntrack` talks ctnetlink over a plain ``AF_NETLINK`` socket, sending
  deletions in batches (why neither pyroute2 nor the ``conntrack`` tool: the figures are
  in :mod:`~kubeproxy.conntrack.ctnetlink`).
* :class:`FakeConntrack` keeps flows in memory for unit tests.

One concept per module, the public names re-exported here (``__all__``):

* :mod:`~kubeproxy.conntrack.flows`: :class:`Flow`, the executor interface
  (:class:`ConntrackExecutor`) and :class:`ConntrackError`;
* :mod:`~kubeproxy.conntrack.reconciler`: which flows are stale
  (:func:`find_stale_flows`, :func:`udp_frontends`) and :class:`ConntrackReconciler`;
* :mod:`~kubeproxy.conntrack.messages`: the ctnetlink requests and answers, by hand over
  :mod:`kubeproxy.host.nlmsg`;
* :mod:`~kubeproxy.conntrack.ctnetlink`: :class:`NetlinkConntrack`, the socket, its
  namespace and batches;
* :mod:`~kubeproxy.conntrack.fake`: :class:`FakeConntrack`.

Every module logs as ``kubeproxy.conntrack``, as the one module did.
"""

from kubeproxy.conntrack.ctnetlink import NetlinkConntrack
from kubeproxy.conntrack.fake import FakeConntrack
from kubeproxy.conntrack.flows import ConntrackError, ConntrackExecutor, Flow
from kubeproxy.conntrack.reconciler import (
    ConntrackMetrics,
    ConntrackReconciler,
    find_stale_flows,
    udp_frontends,
)

__all__ = [
    "ConntrackError",
    "ConntrackExecutor",
    "ConntrackMetrics",
    "ConntrackReconciler",
    "FakeConntrack",
    "Flow",
    "NetlinkConntrack",
    "find_stale_flows",
    "udp_frontends",
]
