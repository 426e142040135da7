"""The daemon's Events about its Node: where they go, and the warnings it posts at start.

With an API server the daemon posts through an :class:`~kubeproxy.events.EventRecorder`
(``reportingController`` is the proxy's name: ``kube-proxy`` for ours); without one
(manifests, dry runs) a :class:`LoggingEventSink` logs each event instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kubeproxy.events import EventRecorder, EventSink, NodeEventSink, ObjectReference

__all__ = ["LoggingEventSink", "StartupWarning", "event_sink"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StartupWarning:
    """A Warning event about the Node that :meth:`~kubeproxy.daemon.Daemon.start` posts
    first (whoever passed it has logged it already): ipvs is deprecated, the proxy mode was
    defaulted (our binaries' two)."""

    reason: str
    action: str
    note: str


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


def event_sink(api: Any, node_name: str, name: str = "kube-proxy") -> EventSink:
    """Where the daemon's events go: posted through ``api`` as ``name`` (the reporting
    controller), or, without an API client, logged."""
    if api is None:
        return LoggingEventSink(node_name)
    return EventRecorder(api, node_name, reporting_controller=name)
