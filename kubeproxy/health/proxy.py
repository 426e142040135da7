"""The proxy's health server: ``/healthz`` and ``/livez`` on the healthz address.

Apart from the per-Service servers (:mod:`kubeproxy.health.services`): one fixed address,
two routes on :mod:`kubeproxy.host.httpserving`'s :class:`~kubeproxy.host.httpserving.
BackgroundServer`, each answer counted in :class:`HealthMetrics`.
"""

from __future__ import annotations

from typing import Final, Protocol

from kubeproxy.health.state import JSON_HEADERS, ProxyHealth
from kubeproxy.host.httpserving import (
    DEFAULT_MAX_HANDLERS,
    RETRY_INTERVAL,
    BackgroundServer,
    Response,
)

__all__ = ["DEFAULT_HEALTHZ_ADDRESS", "HealthMetrics", "ProxyHealthServer"]

DEFAULT_HEALTHZ_ADDRESS: Final = "0.0.0.0:10256"
"""Upstream's default ``healthzBindAddress``."""


class HealthMetrics(Protocol):
    """Counts health responses (``kubeproxy_proxy_healthz_total`` / ``..._livez_total``)."""

    def healthz_response(self, code: int) -> None:
        """A ``/healthz`` answer with status ``code`` was sent."""
        ...

    def livez_response(self, code: int) -> None:
        """A ``/livez`` answer with status ``code`` was sent."""
        ...


class ProxyHealthServer:
    """``/healthz`` and ``/livez`` on the healthz address (default ``0.0.0.0:10256``).

    ``/healthz``: 200 when healthy, with no data-plane fault, and the node is eligible,
    else 503 (a fault adds its ``reason`` to the body). ``/livez``: 200 when healthy,
    else 503. Both send compact JSON (``lastUpdated``, ``currentTime``,
    [``nodeEligible``,] ``healthy``, ``status`` per family) with ``Content-Type:
    application/json`` and ``X-Content-Type-Options: nosniff``; on a 200 ``lastUpdated``
    is the current time (upstream keeps this for old probes). Each answer is counted in
    ``metrics`` when given. Call :meth:`start` and :meth:`stop`. ``backlog`` and
    ``max_handlers`` are :class:`BackgroundServer`'s.
    """

    def __init__(
        self,
        address: str,
        health: ProxyHealth,
        metrics: HealthMetrics | None = None,
        *,
        hard_fail: bool = False,
        retry_interval: float = RETRY_INTERVAL,
        backlog: int | None = None,
        max_handlers: int | None = DEFAULT_MAX_HANDLERS,
    ) -> None:
        self.health = health
        self.metrics = metrics
        self.server = BackgroundServer(
            "healthz",
            address,
            {"/healthz": self.healthz, "/livez": self.livez},
            hard_fail=hard_fail,
            retry_interval=retry_interval,
            backlog=backlog,
            max_handlers=max_handlers,
        )

    @property
    def port(self) -> int | None:
        """The bound port, or None while not bound."""
        return self.server.port

    def start(self) -> None:
        """Start serving (raises :class:`ServerBindError` with ``hard_fail``)."""
        self.server.start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()

    def healthz(self) -> Response:
        """The ``/healthz`` answer."""
        status = self.health.health()
        eligible = self.health.node_eligible()
        code = 200 if status.serving and eligible else 503
        if self.metrics is not None:
            self.metrics.healthz_response(code)
        reported = status.current_time if code == 200 else status.last_updated
        body = status.to_json(last_updated=reported, node_eligible=eligible, with_faults=True)
        return code, JSON_HEADERS, body.encode()

    def livez(self) -> Response:
        """The ``/livez`` answer."""
        status = self.health.health()
        code = 200 if status.healthy else 503
        if self.metrics is not None:
            self.metrics.livez_response(code)
        reported = status.current_time if code == 200 else status.last_updated
        body = status.to_json(last_updated=reported, node_eligible=None)
        return code, JSON_HEADERS, body.encode()
