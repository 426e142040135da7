"""The wiring of health to the proxier: :class:`HealthObserver`.

Apart from the state and the servers it feeds: this is where syncs become health (a
queued sync, a finished one, repeated failures as a data-plane fault) and where the
Service health servers follow each sync's Services, endpoints and node addresses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from kubeproxy.health.services import ServiceHealthServer
from kubeproxy.health.state import FAULT_SYNC_FAILURES, ProxyHealth
from kubeproxy.objects import IPFamily

if TYPE_CHECKING:
    from kubeproxy.backend import ProxySnapshot, SyncChanges
    from kubeproxy.proxier import FinishedSync, Proxier

__all__ = ["SYNC_FAILURE_THRESHOLD", "HealthObserver"]

SYNC_FAILURE_THRESHOLD: Final = 2
"""Failed syncs of a family in a row that make a data-plane fault.

One failure can be a passing refusal that the retry mends; a second one, a retry
interval later (``syncPeriod``), means the kernel stays behind what the proxy wants.
"""


class HealthObserver:
    """Feeds :class:`ProxyHealth` and the per-family :class:`ServiceHealthServer`\\ s.

    As a :class:`~kubeproxy.proxier.SyncObserver`: a queued sync marks a change as
    waiting, a successful sync marks the family as updated; ``sync_failure_threshold``
    failed syncs of a family in a row report a :data:`FAULT_SYNC_FAILURES` data-plane
    fault (with the last error), which the next successful sync repairs. Give
    :meth:`after_sync` to
    the proxier as a :class:`~kubeproxy.proxier.SyncHook`: after each successful sync
    it records the node (for eligibility), moves the family's Service health server to
    the resolved ``nodePortAddresses`` (all addresses when they match all), and syncs
    its Services and local endpoint counts.
    """

    def __init__(
        self,
        health: ProxyHealth,
        service_health: Mapping[IPFamily, ServiceHealthServer] | None = None,
        *,
        sync_failure_threshold: int = SYNC_FAILURE_THRESHOLD,
    ) -> None:
        if sync_failure_threshold < 1:
            raise ValueError(f"sync failure threshold must be >= 1, got {sync_failure_threshold}")
        self.health = health
        self.service_health: dict[IPFamily, ServiceHealthServer] = dict(service_health or {})
        self.sync_failure_threshold = sync_failure_threshold
        self._failures_in_a_row: dict[IPFamily, int] = {}

    def sync_queued(self, family: IPFamily) -> None:
        """A change waits for ``family``."""
        self.health.queued_update(family)

    def sync_finished(self, sync: FinishedSync) -> None:
        """A successful sync makes ``family`` up to date; failures in a row are a fault."""
        family, error = sync.family, sync.error
        if error is None:
            self._failures_in_a_row.pop(family, None)
            self.health.updated(family)
            self.health.report_data_plane_repaired(family, FAULT_SYNC_FAILURES)
            return
        count = self._failures_in_a_row.get(family, 0) + 1
        self._failures_in_a_row[family] = count
        if count >= self.sync_failure_threshold:
            kind = "full" if sync.full else "partial"
            self.health.report_data_plane_broken(
                family,
                FAULT_SYNC_FAILURES,
                f"{count} syncs in a row failed, the last ({kind}): {_first_line(error)}",
            )

    def endpoints_trigger_times(self, family: IPFamily, times: list[float]) -> None:
        """Not used for health."""

    def after_sync(self, proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        """Update node eligibility and the family's Service health checks.

        A full sync (or a move to other addresses) reconciles every health check; a
        partial one only the changed Services' (60 % of a 30k-Service daemon's partial
        sync went to rebuilding every Service's port and endpoint count before).
        """
        self.health.set_node(snapshot.node)
        server = self.service_health.get(snapshot.family)
        if server is None:
            return
        node_ports = snapshot.node_port_addresses
        moved = server.set_addresses(None if node_ports.match_all else node_ports.addresses)
        if changes.full or moved:
            server.sync_services(proxier.health_check_node_ports())
            server.sync_endpoints(proxier.local_ready_endpoints())
            return
        port, count = proxier.health_check_node_port, proxier.local_ready_count
        server.update_services(
            {service: (port(service), count(service)) for service in changes.changed_services}
        )

    def close(self) -> None:
        """Close every Service health server."""
        for server in self.service_health.values():
            server.close()


def _first_line(error: BaseException, limit: int = 300) -> str:
    """An error as one bounded line (nft's messages run over many lines)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
