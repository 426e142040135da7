"""Kubernetes Events about this proxy's Node (``events.k8s.io/v1``), as upstream posts them.

Upstream's events (``cmd/kube-proxy/app/server.go``): ``Starting`` / ``StartKubeProxy``
once the proxy runs (the "birth cry"), ``FailedToStartProxierHealthcheck`` and
``FailedToStartMetricServer`` (action ``StartKubeProxy``) when a server cannot bind with
``bindAddressHardFail``, ``IPVSDeprecation`` (action ``ProxyModeCheck``) in ipvs mode,
``ProxyModeDefaulted`` (action ``ProxyModeCheck``) when the multi-mode binary runs without
a configured mode (upstream 1.37 posts an event then; its reason was not verified, the
name is ours), ``ProxyRulesChangedExternally`` (action ``RepairProxyRules``, ours) when
someone else removed our rules and a repair started (:mod:`kubeproxy.selfheal`), and
``FailedToStartServiceHealthcheck`` (action ``Listen``) about a Service. Each regards the
Node by a reference whose UID is the node name, like upstream's ``NodeRef``.

:class:`EventRecorder` posts them in a background thread, so a slow or absent API server
never holds the proxy up; a failed post is retried a few times and then logged, never
raised. :class:`FakeEventRecorder` keeps them in memory for unit tests.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

__all__ = [
    "ACTION_LISTEN",
    "ACTION_PROXY_MODE_CHECK",
    "ACTION_REPAIR",
    "ACTION_START",
    "NORMAL",
    "REASON_FAILED_HEALTHCHECK",
    "REASON_FAILED_METRICS",
    "REASON_FAILED_SERVICE_HEALTHCHECK",
    "REASON_IPVS_DEPRECATION",
    "REASON_PROXY_MODE_DEFAULTED",
    "REASON_RULES_CHANGED_EXTERNALLY",
    "REASON_STARTING",
    "WARNING",
    "EventRecorder",
    "EventSink",
    "FakeEventRecorder",
    "NodeEventSink",
    "ObjectReference",
    "RecordedEvent",
]

logger = logging.getLogger(__name__)

NORMAL = "Normal"
WARNING = "Warning"

REASON_STARTING = "Starting"
REASON_FAILED_HEALTHCHECK = "FailedToStartProxierHealthcheck"
REASON_FAILED_METRICS = "FailedToStartMetricServer"
REASON_IPVS_DEPRECATION = "IPVSDeprecation"
REASON_FAILED_SERVICE_HEALTHCHECK = "FailedToStartServiceHealthcheck"
# Upstream 1.37 (PR #139957) posts an event when the mode was defaulted; its exact reason
# could not be verified from the reference material, so this one is ours.
REASON_PROXY_MODE_DEFAULTED = "ProxyModeDefaulted"
# Ours: someone else changed our kernel rules, and we repair them (kubeproxy.selfheal).
REASON_RULES_CHANGED_EXTERNALLY = "ProxyRulesChangedExternally"

ACTION_START = "StartKubeProxy"
ACTION_PROXY_MODE_CHECK = "ProxyModeCheck"
ACTION_LISTEN = "Listen"
ACTION_REPAIR = "RepairProxyRules"

# The API server rejects a longer note.
_NOTE_LIMIT = 1024


@dataclass(frozen=True, slots=True)
class ObjectReference:
    """What an Event is about (``regarding``)."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"

    @classmethod
    def node(cls, name: str) -> ObjectReference:
        """A Node, with the node name as UID (as upstream does)."""
        return cls("Node", name, uid=name)

    @classmethod
    def service(cls, namespace: str, name: str, uid: str = "") -> ObjectReference:
        """A Service."""
        return cls("Service", name, namespace=namespace, uid=uid)

    def to_json(self) -> dict[str, str]:
        """The reference in its JSON form (empty fields left out)."""
        out = {"kind": self.kind, "name": self.name, "apiVersion": self.api_version}
        if self.namespace:
            out["namespace"] = self.namespace
        if self.uid:
            out["uid"] = self.uid
        return out


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """One event as a recorder was asked to post it."""

    type: str
    reason: str
    action: str
    note: str
    regarding: ObjectReference


class EventSink(Protocol):
    """What the proxy needs of an event recorder (:class:`EventRecorder` or the fake)."""

    def starting(self) -> None:
        """The Normal ``Starting``/``StartKubeProxy`` event about the Node."""
        ...

    def warning(self, reason: str, action: str, note: str) -> None:
        """A Warning event about the Node."""
        ...

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> None:
        """Any event; ``regarding`` defaults to the Node."""
        ...


class NodeEventSink:
    """The shared half of every :class:`EventSink`: the Node events in terms of ``record``.

    Subclasses implement :meth:`record` (post, log or keep the event).
    """

    def starting(self) -> None:
        """The Normal ``Starting``/``StartKubeProxy`` event about the Node."""
        self.record(NORMAL, REASON_STARTING, ACTION_START, "")

    def warning(self, reason: str, action: str, note: str) -> None:
        """A Warning event about the Node."""
        self.record(WARNING, reason, action, note)

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> None:
        """Any event; ``regarding`` defaults to the Node."""
        raise NotImplementedError


def _check_type(type_: str) -> None:
    if type_ not in (NORMAL, WARNING):
        raise ValueError(f"event type must be {NORMAL!r} or {WARNING!r}, not {type_!r}")


def _micro_time(seconds: float) -> str:
    # Kubernetes' MicroTime: RFC 3339 with exactly six fractional digits, in UTC.
    moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class EventRecorder(NodeEventSink):
    """Posts ``events.k8s.io/v1`` Events through an official ``ApiClient``.

    ``reporting_instance`` defaults to ``<controller>-<hostname>`` (client-go's choice);
    events regarding a cluster-scoped object go to ``namespace`` (``default``). Events are
    queued and posted by one daemon thread; a post that fails is retried up to
    ``attempts`` times, ``retry_delay`` apart, then logged. ``clock`` gives wall-clock
    seconds for ``eventTime`` and names.
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        *,
        reporting_controller: str = "kube-proxy",
        reporting_instance: str | None = None,
        namespace: str = "default",
        attempts: int = 3,
        retry_delay: float = 1.0,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.reporting_controller = reporting_controller
        self.reporting_instance = (
            reporting_instance or f"{reporting_controller}-{socket.gethostname()}"
        )
        self.namespace = namespace
        self.attempts = max(1, attempts)
        self.retry_delay = retry_delay
        self.request_timeout = request_timeout
        self._clock = clock
        self._sleep = sleep
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    # EventSink

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> None:
        """Queue an event (``regarding`` defaults to the Node); raises only for a bad type."""
        _check_type(type_)
        event = self.build(type_, reason, action, note, regarding)
        with self._lock:
            if self._closed:
                logger.warning(
                    "Not posting event %s about %s: the recorder is closed",
                    reason,
                    event["regarding"]["name"],
                )
                return
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="event-recorder", daemon=True
                )
                self._thread.start()
            self._queue.put(event)

    # The rest

    def build(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> dict[str, Any]:
        """The Event object that :meth:`record` posts."""
        ref = regarding or ObjectReference.node(self.node_name)
        now = self._clock()
        encoded = note.encode()
        if len(encoded) > _NOTE_LIMIT:
            note = encoded[: _NOTE_LIMIT - 3].decode(errors="ignore") + "..."
        return {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {
                # client-go's naming: <regarding name>.<nanoseconds in hex>
                "name": f"{ref.name}.{int(now * 1e9):x}",
                "namespace": ref.namespace or self.namespace,
            },
            "eventTime": _micro_time(now),
            "reportingController": self.reporting_controller,
            "reportingInstance": self.reporting_instance,
            "action": action,
            "reason": reason,
            "type": type_,
            "note": note,
            "regarding": ref.to_json(),
        }

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event was posted or given up; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Queue.join() without its lack of a timeout.
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout: float | None = 5.0) -> bool:
        """Post what is queued (up to ``timeout``), then stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return True
        flushed = self.flush(timeout)
        self._queue.put(None)
        thread.join(timeout)
        return flushed and not thread.is_alive()

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                self._post(event)
            finally:
                self._queue.task_done()

    def _post(self, event: dict[str, Any]) -> bool:
        namespace = event["metadata"]["namespace"]
        for attempt in range(1, self.attempts + 1):
            try:
                self._send(namespace, event)
                logger.debug(
                    "Posted event %s %s about %s %s",
                    event["type"],
                    event["reason"],
                    event["regarding"]["kind"],
                    event["regarding"]["name"],
                )
                return True
            except Exception as err:
                status = getattr(err, "status", None)
                final = attempt == self.attempts or status in (400, 401, 403, 404, 409, 422)
                if final:
                    logger.warning(
                        "Could not post event %s about %s %s (%s); giving up",
                        event["reason"],
                        event["regarding"]["kind"],
                        event["regarding"]["name"],
                        _describe(err),
                    )
                    return False
                logger.debug("Posting event %s failed: %s; retrying", event["reason"], err)
                self._sleep(self.retry_delay)
        return False

    def _send(self, namespace: str, event: dict[str, Any]) -> None:
        # The generated create_namespaced_event would round-trip the body through a
        # pydantic model; the raw request keeps the JSON exactly as built.
        params = self.api.param_serialize(
            method="POST",
            resource_path="/apis/events.k8s.io/v1/namespaces/{namespace}/events",
            path_params={"namespace": namespace},
            header_params={"Content-Type": "application/json", "Accept": "application/json"},
            body=event,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*params, _request_timeout=self.request_timeout)
        try:
            body = response.read()
        finally:
            response.response.release_conn()
        if not 200 <= response.status <= 299:
            from kubernetes.client import ApiException

            raise ApiException(
                status=response.status,
                reason=response.reason,
                body=body.decode(errors="replace") if body else None,
            )


def _describe(err: BaseException) -> str:
    status = getattr(err, "status", None)
    body = getattr(err, "body", None)
    if status is not None:
        message = ""
        if isinstance(body, str):
            try:
                decoded = json.loads(body)
                message = decoded.get("message", "") if isinstance(decoded, dict) else ""
            except ValueError:
                message = body[:200]
        return f"{status} {getattr(err, 'reason', '')}".strip() + (
            f": {message}" if message else ""
        )
    return " ".join(f"{type(err).__name__}: {err}".split())


class FakeEventRecorder(NodeEventSink):
    """An in-memory :class:`EventSink`: events land in :attr:`events`."""

    def __init__(self, node_name: str = "node") -> None:
        self.node_name = node_name
        self.events: list[RecordedEvent] = []
        self._lock = threading.Lock()

    def record(
        self,
        type_: str,
        reason: str,
        action: str,
        note: str,
        regarding: ObjectReference | None = None,
    ) -> None:
        """Record an event (``regarding`` defaults to the Node)."""
        _check_type(type_)
        ref = regarding or ObjectReference.node(self.node_name)
        with self._lock:
            self.events.append(RecordedEvent(type_, reason, action, note, ref))

    def reasons(self) -> list[str]:
        """The reasons recorded, oldest first."""
        with self._lock:
            return [e.reason for e in self.events]
