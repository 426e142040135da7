"""``kubeproxy_nftables_affinity_unrecorded_connections_total{ip_family}``: new
connections to a Service port with ClientIP affinity whose endpoint could not be
recorded, because the shared affinity map holding the port's entries was full.

The shared maps (:func:`~kubeproxy.backends.nftables.layout.affinity_shards`) are bounded
(65535 entries each, by the kernel); a connection whose record chain wrote no entry comes
back to ``affinity-record``, which jumps to the ``affinity-full`` chain, whose one rule
counts the connection. The count is read at each
scrape over netlink (:func:`~kubeproxy.backends.nftables.rulecounters.rule_counters`: a
dump of that chain's one rule, whatever the table holds). Such a connection is served;
only its next connection may go to another endpoint. A count that grows says the node has
more affinity clients (within the timeout) than its maps hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from kubeproxy.backends.nftables.objects import NftError
from kubeproxy.metrics import PerRegistry
from kubeproxy.objects import IPFamily

__all__ = ["AffinityMetric", "Recording", "report_affinity"]

log = logging.getLogger(__name__)


class Recording(Protocol):
    """What the metric reads of a backend."""

    @property
    def family(self) -> IPFamily:
        """The family the backend programs."""
        ...

    def affinity_unrecorded(self) -> int:
        """Connections counted so far."""
        ...


class AffinityMetric:
    """The counter for the backends given to :meth:`add`, read at each scrape. A
    prometheus-client collector; one per registry (:func:`report_affinity`)."""

    def __init__(self) -> None:
        self.backends: dict[IPFamily, Recording] = {}

    def add(self, backend: Recording) -> None:
        """Report ``backend``'s family."""
        self.backends[backend.family] = backend

    def collect(self) -> Iterable[Any]:
        """The one counter family."""
        from prometheus_client.core import CounterMetricFamily

        counter = CounterMetricFamily(
            "kubeproxy_nftables_affinity_unrecorded_connections",
            "[ALPHA] Number of new connections to a Service with ClientIP session affinity"
            " whose endpoint could not be recorded because the affinity map was full",
            labels=["ip_family"],
        )
        for family, backend in sorted(self.backends.items()):
            try:
                count = backend.affinity_unrecorded()
            except NftError as err:
                log.error("Cannot read the session affinity counter (%s): %s", family, err)
                continue
            counter.add_metric([family.value], float(count))
        yield counter


_COLLECTORS = PerRegistry(AffinityMetric)


def report_affinity(registry: Any, backend: Recording) -> AffinityMetric:
    """Report ``backend``'s family in ``registry``'s :class:`AffinityMetric` (registered
    there the first time)."""
    collector = _COLLECTORS.of(registry)
    collector.add(backend)
    return collector
