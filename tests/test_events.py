"""Events about the Node, posted to the fake API server (or kept by the fake recorder)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from kubeproxy.events import (
    ACTION_LISTEN,
    ACTION_PROXY_MODE_CHECK,
    ACTION_START,
    NORMAL,
    REASON_FAILED_SERVICE_HEALTHCHECK,
    REASON_IPVS_DEPRECATION,
    REASON_STARTING,
    WARNING,
    EventRecorder,
    EventSink,
    FakeEventRecorder,
    ObjectReference,
    RecordedEvent,
)
from kubeproxy.testing.fakeapi import FakeAPIServer

NODE = "node-a"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


@pytest.fixture
def fake() -> Iterator[FakeAPIServer]:
    server = FakeAPIServer().start()
    try:
        yield server
    finally:
        server.stop()


def recorder_for(fake: FakeAPIServer, **kwargs: object) -> EventRecorder:
    options: dict[str, object] = {"retry_delay": 0.01, "reporting_instance": "kube-proxy-host1"}
    options.update(kwargs)
    return EventRecorder(fake.api_client(), NODE, **options)  # type: ignore[arg-type]


def test_starting_event_regards_the_node(fake: FakeAPIServer) -> None:
    recorder = recorder_for(fake, clock=lambda: 1_700_000_000.25)
    recorder.starting()
    assert recorder.flush(5)
    [event] = fake.posted_events
    assert event["apiVersion"] == "events.k8s.io/v1" and event["kind"] == "Event"
    assert (event["type"], event["reason"], event["action"]) == (
        NORMAL,
        "Starting",
        "StartKubeProxy",
    )
    assert event["regarding"] == {"kind": "Node", "name": NODE, "uid": NODE, "apiVersion": "v1"}
    assert event["reportingController"] == "kube-proxy"
    assert event["reportingInstance"] == "kube-proxy-host1"
    assert event["metadata"]["namespace"] == "default"
    assert event["metadata"]["name"] == f"{NODE}.{int(1_700_000_000.25 * 1e9):x}"
    assert event["eventTime"] == "2023-11-14T22:13:20.250000Z"
    assert MICRO_TIME.match(event["eventTime"])
    assert [(r.verb, r.group, r.resource, r.namespace) for r in fake.requests] == [
        ("create", "events.k8s.io", "events", "default")
    ]
    assert recorder.close(5)


def test_warnings_and_events_about_services(fake: FakeAPIServer) -> None:
    recorder = recorder_for(fake)
    recorder.warning(
        REASON_IPVS_DEPRECATION,
        ACTION_PROXY_MODE_CHECK,
        "The ipvs proxier is now deprecated and may be removed in a future release. "
        "Please use 'nftables' instead.",
    )
    recorder.record(
        WARNING,
        REASON_FAILED_SERVICE_HEALTHCHECK,
        ACTION_LISTEN,
        "node 10.0.0.1:30000 already in use",
        ObjectReference.service("shop", "web", uid="1234"),
    )
    assert recorder.close(5)
    by_reason = {e["reason"]: e for e in fake.posted_events}
    deprecation = by_reason[REASON_IPVS_DEPRECATION]
    assert deprecation["type"] == WARNING and deprecation["action"] == ACTION_PROXY_MODE_CHECK
    assert "deprecated" in deprecation["note"]
    health = by_reason[REASON_FAILED_SERVICE_HEALTHCHECK]
    assert health["regarding"] == {
        "kind": "Service",
        "name": "web",
        "namespace": "shop",
        "uid": "1234",
        "apiVersion": "v1",
    }
    assert health["metadata"]["namespace"] == "shop"


def test_default_reporting_instance_names_the_host(fake: FakeAPIServer) -> None:
    recorder = EventRecorder(fake.api_client(), NODE)
    assert recorder.reporting_instance.startswith("kube-proxy-")
    assert len(recorder.reporting_instance) > len("kube-proxy-")


def test_a_server_error_is_retried(fake: FakeAPIServer) -> None:
    fake.fail_next("events", 503)
    recorder = recorder_for(fake)
    recorder.starting()
    assert recorder.close(5)
    assert [e["reason"] for e in fake.posted_events] == [REASON_STARTING]
    assert sum(1 for r in fake.requests if r.resource == "events") == 2


def test_forbidden_is_logged_once_and_never_raised(
    fake: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kubeproxy.events")
    fake.fail_next("events", 403, count=10)
    recorder = recorder_for(fake)
    recorder.starting()
    assert recorder.close(5)
    assert fake.posted_events == []
    assert sum(1 for r in fake.requests if r.resource == "events") == 1  # 403 is not retried
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "Could not post event Starting about Node node-a" in message
    assert "403" in message and "giving up" in message


def test_an_absent_server_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeAPIServer().start()
    api = fake.api_client()
    fake.stop()
    recorder = EventRecorder(api, NODE, attempts=2, retry_delay=0.01, request_timeout=1)
    recorder.warning("FailedToStartMetricServer", ACTION_START, "bind: address already in use")
    assert recorder.close(5)
    warnings = [
        r for r in caplog.records if r.name == "kubeproxy.events" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1 and "giving up" in warnings[0].getMessage()


def test_long_notes_are_cut_to_what_the_server_takes(fake: FakeAPIServer) -> None:
    recorder = recorder_for(fake)
    event = recorder.build(WARNING, "X", "Y", "é" * 2000)
    assert len(event["note"].encode()) <= 1024 and event["note"].endswith("...")


def test_bad_type_is_a_programming_error(fake: FakeAPIServer) -> None:
    with pytest.raises(ValueError, match="Normal"):
        recorder_for(fake).record("Info", "X", "Y", "z")
    with pytest.raises(ValueError):
        FakeEventRecorder().record("Info", "X", "Y", "z")


def test_closed_recorder_drops_events(
    fake: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = recorder_for(fake)
    assert recorder.close(1)
    recorder.starting()
    assert fake.posted_events == []
    assert any("recorder is closed" in r.getMessage() for r in caplog.records)


def test_fake_recorder_keeps_events_in_memory() -> None:
    sink: EventSink = FakeEventRecorder(NODE)
    sink.starting()
    sink.warning(REASON_IPVS_DEPRECATION, ACTION_PROXY_MODE_CHECK, "deprecated")
    assert isinstance(sink, FakeEventRecorder)
    assert sink.events == [
        RecordedEvent(NORMAL, REASON_STARTING, ACTION_START, "", ObjectReference.node(NODE)),
        RecordedEvent(
            WARNING,
            REASON_IPVS_DEPRECATION,
            ACTION_PROXY_MODE_CHECK,
            "deprecated",
            ObjectReference.node(NODE),
        ),
    ]
    assert sink.reasons() == [REASON_STARTING, REASON_IPVS_DEPRECATION]
    assert ObjectReference.node(NODE).uid == NODE
