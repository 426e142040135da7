"""KubernetesSource against the fake API server: list, watch, and every way it goes wrong."""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.config import ProxierConfig
from kubeproxy.events import EventRecorder
from kubeproxy.handlers import KubeObject
from kubeproxy.objects import IPFamily, IPNetwork, ServicePortName
from kubeproxy.proxier import Proxier
from kubeproxy.sources import kubernetes as kube
from kubeproxy.sources.kubernetes import (
    IN_CLUSTER_MESSAGE,
    KubernetesSource,
    NodeWatcher,
    RateLimitedApiClient,
    TokenBucket,
    make_api_client,
)
from kubeproxy.testing.fakeapi import (
    APIRequest,
    FakeAPIServer,
    allowed_by,
    endpoint_slice,
    node,
    service,
    service_cidr,
)

NODE = "node-a"
SOURCE_LOGGER = "kubeproxy.sources.kubernetes"
WAIT = 30.0
"""Seconds a wait for the source (a sync, a watch, an event) may take before the test
fails: each takes milliseconds, and a wait returns as soon as it is over; 5 s was one
stall of a loaded machine from a failure."""


def _key(obj: KubeObject) -> str:
    return f"{obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


def _rv(obj: KubeObject) -> str:
    return str(obj["metadata"]["resourceVersion"])


def _identity(obj: KubeObject) -> tuple[Any, ...]:
    metadata = obj["metadata"]
    service = (metadata.get("labels") or {}).get("kubernetes.io/service-name")
    return (
        obj["kind"],
        metadata.get("namespace"),
        metadata["name"],
        metadata.get("resourceVersion"),
        service,
        obj.get("addressType"),
    )


class RecordingHandler:
    """A ProxyHandler that records every call and checks the source's promises.

    ``errors`` collects broken promises: an add for an object already there, an update or
    delete for one never added, an update whose ``old`` is not the identity of what was
    last delivered (the source keeps identities, not objects: same kind, name,
    namespace, resourceVersion and, for a slice, Service and address type).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.services: dict[str, KubeObject] = {}
        self.slices: dict[str, KubeObject] = {}
        self.node_states: list[KubeObject | None] = []
        self.cidr_calls: list[list[IPNetwork]] = []
        self.errors: list[str] = []
        self.services_synced = 0
        self.slices_synced = 0
        self._cond = threading.Condition()
        self.fail_on: str | None = None

    def _record(self, *call: str) -> None:
        with self._cond:
            self.calls.append(call)
            self._cond.notify_all()
        if self.fail_on is not None and any(part.endswith(self.fail_on) for part in call):
            raise RuntimeError("the handler broke on purpose")

    def _add(self, store: dict[str, KubeObject], kind: str, obj: KubeObject) -> None:
        key = _key(obj)
        if key in store:
            self.errors.append(f"{kind} add for {key} already there")
        store[key] = obj
        self._record(f"{kind}_add", key, _rv(obj))

    def _update(
        self, store: dict[str, KubeObject], kind: str, old: KubeObject, new: KubeObject
    ) -> None:
        key = _key(new)
        delivered = store.get(key)
        if delivered is None or _identity(delivered) != _identity(old):
            self.errors.append(f"{kind} update for {key}: old is not what was delivered")
        if _rv(old) == _rv(new):
            self.errors.append(f"{kind} update for {key} without a change")
        store[key] = new
        self._record(f"{kind}_update", key, _rv(new))

    def _delete(self, store: dict[str, KubeObject], kind: str, obj: KubeObject) -> None:
        key = _key(obj)
        if store.pop(key, None) is None:
            self.errors.append(f"{kind} delete for unknown {key}")
        self._record(f"{kind}_delete", key)

    def on_service_add(self, service: KubeObject) -> None:
        self._add(self.services, "service", service)

    def on_service_update(self, old: KubeObject, new: KubeObject) -> None:
        self._update(self.services, "service", old, new)

    def on_service_delete(self, service: KubeObject) -> None:
        self._delete(self.services, "service", service)

    def on_services_synced(self) -> None:
        self.services_synced += 1
        self._record("services_synced")

    def on_endpoint_slice_add(self, slice_: KubeObject) -> None:
        self._add(self.slices, "slice", slice_)

    def on_endpoint_slice_update(self, old: KubeObject, new: KubeObject) -> None:
        self._update(self.slices, "slice", old, new)

    def on_endpoint_slice_delete(self, slice_: KubeObject) -> None:
        self._delete(self.slices, "slice", slice_)

    def on_endpoint_slices_synced(self) -> None:
        self.slices_synced += 1
        self._record("slices_synced")

    def on_node_update(self, node: KubeObject | None) -> None:
        self.node_states.append(node)
        self._record("node", "deleted" if node is None else _rv(node))

    def on_service_cidrs_changed(self, cidrs: Sequence[IPNetwork]) -> None:
        self.cidr_calls.append(list(cidrs))
        self._record("cidrs", ",".join(map(str, cidrs)))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
            return True

    def since(self, mark: int) -> list[tuple[str, ...]]:
        with self._cond:
            return self.calls[mark:]


def server_state(
    fake: FakeAPIServer, kind: str, *, keep: Callable[[KubeObject], bool]
) -> dict[str, str]:
    return {_key(o): _rv(o) for o in fake.objects(kind) if keep(o)}


def proxied_service(obj: KubeObject) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return (
        obj["spec"].get("clusterIP") != "None"
        and "service.kubernetes.io/service-proxy-name" not in labels
        and "service.kubernetes.io/headless" not in labels
    )


def proxied_slice(obj: KubeObject) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return (
        "service.kubernetes.io/service-proxy-name" not in labels
        and "service.kubernetes.io/headless" not in labels
    )


def handler_state(store: Mapping[str, KubeObject]) -> dict[str, str]:
    return {key: _rv(obj) for key, obj in store.items()}


@pytest.fixture
def fake() -> Iterator[FakeAPIServer]:
    server = FakeAPIServer(bookmark_interval=0.2).start()
    try:
        yield server
    finally:
        server.on_request = None
        server.stop()


class Running:
    """A source running against the fake, stopped at teardown."""

    def __init__(self, fake: FakeAPIServer) -> None:
        self.fake = fake
        self.handler = RecordingHandler()
        self.stop = threading.Event()
        self.source: KubernetesSource | None = None

    def start(self, **kwargs: Any) -> KubernetesSource:
        options: dict[str, Any] = {
            "page_size": 3,
            "watch_timeout": 2.0,
            "request_timeout": 2.0,
            "connect_timeout": 1.0,
            "initial_backoff": 0.02,
            "max_backoff": 0.1,
            "rng": random.Random(7),
        }
        options.update(kwargs)
        api = options.pop("api", None) or self.fake.api_client()
        self.source = KubernetesSource(api, self.handler, NODE, **options)
        self.source.start(self.stop)
        return self.source

    def close(self) -> None:
        self.stop.set()
        if self.source is not None:
            assert self.source.join(5.0), "reflector threads did not stop"


@pytest.fixture
def running(fake: FakeAPIServer) -> Iterator[Running]:
    run = Running(fake)
    try:
        yield run
    finally:
        run.close()


def populate(fake: FakeAPIServer, services: int = 7) -> None:
    for i in range(services):
        fake.apply(service(f"svc-{i}", cluster_ip=f"10.96.0.{i + 1}"))
        fake.apply(endpoint_slice(f"svc-{i}-abc", f"svc-{i}", addresses=[f"10.244.0.{i + 1}"]))
    fake.apply(node(NODE, zone="zone-a"))
    fake.apply(node("node-b"))
    fake.apply(service_cidr("kubernetes", "10.96.0.0/16", "fd00:10:96::/112"))


def count(fake: FakeAPIServer, verb: str, resource: str) -> int:
    return sum(1 for r in fake.requests if r.verb == verb and r.resource == resource)


def source_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SOURCE_LOGGER and r.levelno >= level]


# Initial list


def test_initial_list_is_paginated_filtered_and_synced_once(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake)
    fake.apply(service("headless", cluster_ip="None"))
    fake.apply(service("elsewhere", labels={"service.kubernetes.io/service-proxy-name": "other"}))
    fake.apply(
        endpoint_slice("headless-xyz", "headless", labels={"service.kubernetes.io/headless": ""})
    )
    fake.apply(
        endpoint_slice(
            "elsewhere-xyz",
            "elsewhere",
            labels={"service.kubernetes.io/service-proxy-name": "other"},
        )
    )
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler

    assert sorted(handler.services) == [f"default/svc-{i}" for i in range(7)]
    assert sorted(handler.slices) == [f"default/svc-{i}-abc" for i in range(7)]
    assert handler.services_synced == 1
    assert handler.slices_synced == 1
    calls = handler.calls
    assert calls.index(("services_synced",)) > max(
        i for i, c in enumerate(calls) if c[0] == "service_add"
    )
    # Objects keep kind/apiVersion even though list items come without them.
    assert handler.services["default/svc-0"]["kind"] == "Service"
    assert handler.slices["default/svc-0-abc"]["apiVersion"] == "discovery.k8s.io/v1"
    # 7 Services in pages of 3: three list requests, one watch.
    assert count(fake, "list", "services") == 3
    assert count(fake, "list", "endpointslices") == 3
    assert handler.node_states and handler.node_states[-1] is not None
    assert handler.node_states[-1]["metadata"]["name"] == NODE
    assert handler.cidr_calls == [
        [ipaddress.ip_network("10.96.0.0/16"), ipaddress.ip_network("fd00:10:96::/112")]
    ]
    assert handler.errors == []


def test_not_synced_before_every_resource_listed(fake: FakeAPIServer, running: Running) -> None:
    populate(fake)
    fake.fail_next("nodes", 503, count=1000)
    source = running.start()
    assert running.handler.wait_for(lambda: running.handler.slices_synced == 1)
    assert not source.wait_for_sync(0.3)
    assert not source.synced
    fake.clear_failures()
    assert source.wait_for_sync(WAIT)


def test_large_list_in_many_pages(fake: FakeAPIServer, running: Running) -> None:
    for i in range(1200):
        fake.apply(service(f"svc-{i:04d}", cluster_ip=f"10.96.{i // 250}.{i % 250 + 1}"))
    source = running.start(page_size=100)
    assert source.wait_for_sync(WAIT)
    assert len(running.handler.services) == 1200
    assert count(fake, "list", "services") == 12
    assert running.handler.errors == []


# Watch


def test_watch_delivers_each_change_once_with_the_cached_old_object(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake, services=2)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    mark = len(handler.calls)
    before = handler.services["default/svc-0"]

    modified = fake.apply(service("svc-0", cluster_ip="10.96.1.1"))
    added = fake.apply(service("svc-new", cluster_ip="10.96.1.2"))
    fake.delete("Service", "default", "svc-1")
    fake.apply(endpoint_slice("svc-0-abc", "svc-0", addresses=["10.244.9.9"]))

    assert handler.wait_for(lambda: len(handler.since(mark)) >= 4)
    time.sleep(0.3)  # nothing more may come
    assert sorted(handler.since(mark)) == sorted(
        [
            ("service_update", "default/svc-0", _rv(modified)),
            ("service_add", "default/svc-new", _rv(added)),
            ("service_delete", "default/svc-1"),
            ("slice_update", "default/svc-0-abc", _rv(fake.objects("EndpointSlice")[0])),
        ]
    )
    assert handler.services["default/svc-0"]["spec"]["clusterIP"] == "10.96.1.1"
    assert before["spec"]["clusterIP"] == "10.96.0.1"
    assert handler.errors == []


def test_relabelled_out_of_the_selector_is_a_delete(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=1)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    mark = len(running.handler.calls)
    fake.apply(service("svc-0", labels={"service.kubernetes.io/service-proxy-name": "other"}))
    assert running.handler.wait_for(lambda: len(running.handler.since(mark)) >= 1)
    assert running.handler.since(mark) == [("service_delete", "default/svc-0")]


def test_bookmarks_advance_the_resource_version(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=2)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    listed_rv = int(source.resource_version("services") or 0)
    # Changes to other kinds move the global counter; only bookmarks tell the Service
    # watch about it.
    for i in range(5):
        fake.apply(node(f"other-{i}"))
    target = str(fake.resource_version)
    assert int(target) > listed_rv
    assert running.handler.wait_for(lambda: source.resource_version("services") == target)
    # Compacting up to now does not hurt a watch resumed from the bookmark: no relist.
    lists = count(fake, "list", "services")
    fake.compact()
    fake.drop_watches("services")
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    time.sleep(0.3)
    assert count(fake, "list", "services") == lists
    assert running.handler.errors == []


def test_dropped_watches_resume_from_the_last_resource_version(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    populate(fake, services=3)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    lists = count(fake, "list", "services")
    for round_ in range(4):
        assert fake.wait_for_watches("services", 1, timeout=WAIT)
        assert fake.drop_watches("services") == 1
        fake.apply(service(f"svc-{round_}", cluster_ip=f"10.96.2.{round_ + 1}"))
        fake.apply(service(f"added-{round_}", cluster_ip=f"10.96.3.{round_ + 1}"))
    want = server_state(fake, "Service", keep=proxied_service)
    assert handler.wait_for(lambda: handler_state(handler.services) == want)
    time.sleep(0.3)
    assert handler_state(handler.services) == want
    assert handler.errors == []
    assert count(fake, "list", "services") == lists  # resumed, never relisted
    watches = [r for r in fake.requests if r.verb == "watch" and r.resource == "services"]
    assert len(watches) >= 5
    # One line per drop, saying it resumes.
    drops = [r for r in source_records(caplog, logging.WARNING) if "watch of services" in r.message]
    assert drops and all("resuming from resourceVersion" in r.message for r in drops)


# 410


def test_410_while_away_relists_and_delivers_only_the_difference(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    for name in ("a", "b", "c"):
        fake.apply(service(name, cluster_ip="10.96.0.1"))
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    lists = count(fake, "list", "services")
    mark = len(handler.calls)

    fake.stop()
    updated = fake.apply(service("a", cluster_ip="10.96.0.2"))
    fake.delete("Service", "default", "b")
    added = fake.apply(service("d", cluster_ip="10.96.0.4"))
    # Churn that ends where it started is not a difference.
    fake.apply(service("e", cluster_ip="10.96.0.5"))
    fake.delete("Service", "default", "e")
    fake.compact()
    time.sleep(0.2)
    assert handler.since(mark) == []  # nothing is deleted while the API server is away
    fake.start()

    assert handler.wait_for(lambda: len(handler.since(mark)) >= 3)
    time.sleep(0.3)
    assert sorted(handler.since(mark)) == sorted(
        [
            ("service_update", "default/a", _rv(updated)),
            ("service_add", "default/d", _rv(added)),
            ("service_delete", "default/b"),
        ]
    )
    assert handler.services_synced == 1
    assert handler.errors == []
    assert count(fake, "list", "services") == lists + 1
    assert any("expired" in r.message and "relisting" in r.message for r in caplog.records)


def test_expired_watch_event_relists_without_spurious_calls(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake, services=4)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    mark = len(handler.calls)
    lists = count(fake, "list", "services")
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    assert fake.expire_watches("services") == 1
    assert handler.wait_for(lambda: count(fake, "list", "services") > lists)
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    fake.apply(service("after", cluster_ip="10.96.5.5"))
    assert handler.wait_for(lambda: "default/after" in handler.services)
    assert [c for c in handler.since(mark) if c[0].startswith("service")] == [
        ("service_add", "default/after", _rv(fake.get("Service", "default", "after") or {}))
    ]


def test_410_answer_to_a_watch_relists(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=3)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    lists = count(fake, "list", "services")
    mark = len(running.handler.calls)
    fake.fail_next("services", 410, verb="watch")
    fake.drop_watches("services")
    assert running.handler.wait_for(lambda: count(fake, "list", "services") > lists)
    fake.apply(service("later", cluster_ip="10.96.5.6"))
    assert running.handler.wait_for(lambda: "default/later" in running.handler.services)
    assert [c[:2] for c in running.handler.since(mark)] == [("service_add", "default/later")]
    assert running.handler.errors == []


def test_expired_continue_token_restarts_the_list(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=7)
    seen: list[APIRequest] = []

    def compact_between_pages(request: APIRequest) -> None:
        if request.resource == "services" and request.verb == "list":
            seen.append(request)
            if len(seen) == 2:
                # After the first page: a new Service, then history is gone.
                fake.apply(service("late", cluster_ip="10.96.9.9"))
                fake.compact()

    fake.on_request = compact_between_pages
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    # First page, expired continue, then a full list again (4 pages of 3 for 8).
    assert len(seen) == 2 + 3
    assert sorted(handler.services) == sorted(
        [f"default/svc-{i}" for i in range(7)] + ["default/late"]
    )
    assert [c for c in handler.calls if c[0] == "service_add"].__len__() == 8
    assert handler.services_synced == 1
    assert handler.errors == []


# Errors


def test_forbidden_is_one_clear_line_per_attempt_and_retried(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    populate(fake, services=2)
    fake.fail_next("endpointslices", 403, count=2, verb="list")
    source = running.start()
    assert source.wait_for_sync(WAIT)
    lines = [r for r in source_records(caplog, logging.WARNING) if "endpointslices" in r.message]
    assert len(lines) == 2
    for record in lines:
        assert record.levelno == logging.ERROR
        message = record.getMessage()
        assert message.startswith("kubernetes: cannot list endpointslices: 403 Forbidden")
        assert (
            'must allow verb "list" on "endpointslices" in API group "discovery.k8s.io"' in message
        )
        assert "\n" not in message
    assert len(running.handler.slices) == 2
    assert any("answers again" in r.message for r in caplog.records)


def test_server_errors_on_watch_are_logged_and_retried(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    populate(fake, services=2)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    lists = count(fake, "list", "services")
    fake.fail_next("services", 500, count=1, verb="watch")
    fake.fail_next("services", 503, count=1, verb="watch")
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    fake.drop_watches("services")
    fake.apply(service("svc-0", cluster_ip="10.96.7.7"))
    handler = running.handler
    assert handler.wait_for(
        lambda: handler.services["default/svc-0"]["spec"]["clusterIP"] == "10.96.7.7"
    )
    messages = [r.getMessage() for r in source_records(caplog, logging.WARNING)]
    assert any(m.startswith("kubernetes: watch of services failed: 500") for m in messages)
    assert any(m.startswith("kubernetes: watch of services failed: 503") for m in messages)
    assert all("resuming from resourceVersion" in m for m in messages if "services" in m)
    assert count(fake, "list", "services") == lists
    assert handler.errors == []


def test_slow_responses_are_waited_for(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=4)
    fake.delay = 0.2
    source = running.start()
    assert source.wait_for_sync(WAIT)
    fake.apply(service("slow", cluster_ip="10.96.8.8"))
    assert running.handler.wait_for(lambda: "default/slow" in running.handler.services, 5)
    assert running.handler.errors == []


def test_responses_slower_than_the_timeout_are_retried(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    populate(fake, services=2)
    fake.delay = 0.8
    source = running.start(request_timeout=0.3)
    time.sleep(1.0)
    assert not source.synced
    fake.delay = 0.0
    assert source.wait_for_sync(WAIT)
    assert any(
        "did not answer in time" in r.getMessage() for r in source_records(caplog, logging.WARNING)
    )
    assert running.handler.errors == []


def test_handler_failures_do_not_stop_the_watch(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    populate(fake, services=1)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    running.handler.fail_on = "boom"
    fake.apply(service("boom", cluster_ip="10.96.4.4"))
    fake.apply(service("fine", cluster_ip="10.96.4.5"))
    assert running.handler.wait_for(lambda: "default/fine" in running.handler.services)
    assert any("the handler failed" in r.getMessage() for r in caplog.records)


# Kill and restart


def test_kill_and_restart_the_server_mid_watch_loses_and_duplicates_nothing(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake, services=6)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    expected_calls: list[tuple[str, ...]] = []
    for round_ in range(3):
        mark = len(handler.calls)
        assert fake.wait_for_watches("services", 1, timeout=WAIT)
        assert fake.wait_for_watches("endpointslices", 1, timeout=WAIT)
        fake.stop()
        changed = fake.apply(service(f"svc-{round_}", cluster_ip=f"10.96.6.{round_ + 1}"))
        added = fake.apply(service(f"new-{round_}", cluster_ip=f"10.96.7.{round_ + 1}"))
        fake.delete("Service", "default", f"svc-{5 - round_}")
        slice_ = fake.apply(
            endpoint_slice(f"svc-{round_}-abc", f"svc-{round_}", addresses=["10.244.5.5"])
        )
        time.sleep(0.15)  # the reflectors find the server gone and back off
        assert handler.since(mark) == []
        fake.start()
        expected_calls = [
            ("service_update", f"default/svc-{round_}", _rv(changed)),
            ("service_add", f"default/new-{round_}", _rv(added)),
            ("service_delete", f"default/svc-{5 - round_}"),
            ("slice_update", f"default/svc-{round_}-abc", _rv(slice_)),
        ]

        def all_four_arrived(mark: int = mark) -> bool:
            return len(handler.since(mark)) >= 4

        assert handler.wait_for(all_four_arrived, 10)
        time.sleep(0.2)
        assert sorted(handler.since(mark)) == sorted(expected_calls)
    assert handler_state(handler.services) == server_state(fake, "Service", keep=proxied_service)
    assert handler_state(handler.slices) == server_state(fake, "EndpointSlice", keep=proxied_slice)
    assert handler.services_synced == 1
    assert handler.errors == []


def test_an_absent_api_server_is_one_clear_line_per_attempt(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    populate(fake, services=2)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    mark = len(running.handler.calls)
    caplog.clear()
    fake.stop()
    time.sleep(0.4)
    assert running.handler.since(mark) == []
    fake.start()
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert failures
    # Only our lines: the client's own transport retries stay silent.
    assert {r.name for r in failures} == {SOURCE_LOGGER}
    for record in failures:
        message = record.getMessage()
        assert "\n" not in message
        assert (
            "connection lost" in message
            or "cannot reach the API server (Connection re" in message  # refused or reset
        )
        assert "resuming from resourceVersion" in message


def test_random_churn_with_faults_ends_in_the_servers_state(
    fake: FakeAPIServer, running: Running
) -> None:
    rng = random.Random(42)
    populate(fake, services=5)
    source = running.start(page_size=2)
    assert source.wait_for_sync(WAIT)
    handler = running.handler
    for step in range(60):
        name = f"svc-{rng.randrange(12)}"
        roll = rng.random()
        if roll < 0.5:
            fake.apply(service(name, cluster_ip=f"10.96.{rng.randrange(200)}.{step + 1}"))
        elif roll < 0.7:
            fake.delete("Service", "default", name)
        elif roll < 0.8:
            fake.drop_watches()
        elif roll < 0.85:
            fake.compact()
            fake.expire_watches()
        elif roll < 0.9:
            fake.restart()
        else:
            fake.fail_next(
                "services", rng.choice([403, 500, 503]), verb=rng.choice(["list", "watch"])
            )
        if rng.random() < 0.3:
            time.sleep(0.02)
    want = server_state(fake, "Service", keep=proxied_service)
    assert handler.wait_for(lambda: handler_state(handler.services) == want, 15)
    assert handler.errors == []


# End to end: the proxy core fed by the source


class SnapshotBackend:
    """A backend that keeps the last snapshot it was given."""

    def __init__(self) -> None:
        self.family = IPFamily.IPV4
        self.syncs = 0
        self.services: dict[ServicePortName, Any] = {}
        self.endpoints: dict[ServicePortName, tuple[str, ...]] = {}
        self.service_cidrs: tuple[IPNetwork, ...] = ()
        self.lock = threading.Lock()

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        with self.lock:
            self.syncs += 1
            self.services = dict(snapshot.services)
            self.endpoints = {
                name: tuple(sorted(f"{e.ip}:{e.port}" for e in endpoints))
                for name, endpoints in snapshot.endpoints.items()
            }
            self.service_cidrs = snapshot.service_cidrs

    def cleanup(self) -> None:
        pass

    def view(self) -> dict[str, tuple[str, ...]]:
        with self.lock:
            return {str(name.service): self.endpoints.get(name, ()) for name in self.services}


def test_the_proxy_core_programs_exactly_the_servers_state(fake: FakeAPIServer) -> None:
    for i in range(4):
        fake.apply(service(f"svc-{i}", cluster_ip=f"10.96.0.{i + 1}"))
        fake.apply(endpoint_slice(f"svc-{i}-a", f"svc-{i}", addresses=[f"10.244.0.{i + 1}"]))
    fake.apply(endpoint_slice("empty", "svc-3", addresses=[]))  # endpoints: null
    fake.apply(node(NODE))
    fake.apply(service_cidr("kubernetes", "10.96.0.0/16"))
    backend = SnapshotBackend()
    proxier = Proxier(IPFamily.IPV4, ProxierConfig(node_name=NODE, min_sync_period=0.0), backend)
    stop = threading.Event()
    loop = threading.Thread(target=proxier.run, args=(stop,), daemon=True)
    loop.start()
    source = KubernetesSource(
        fake.api_client(),
        proxier,
        NODE,
        page_size=2,
        watch_timeout=2,
        request_timeout=2,
        initial_backoff=0.02,
        max_backoff=0.1,
    )
    try:
        source.start(stop)
        assert source.wait_for_sync(WAIT)

        def programmed() -> dict[str, tuple[str, ...]]:
            want: dict[str, tuple[str, ...]] = {}
            slices = fake.objects("EndpointSlice")
            for svc in fake.objects("Service"):
                name = svc["metadata"]["name"]
                want[f"default/{name}"] = tuple(
                    sorted(
                        f"{ep['addresses'][0]}:8080"
                        for s in slices
                        if s["metadata"]["labels"]["kubernetes.io/service-name"] == name
                        for ep in s["endpoints"] or ()
                    )
                )
            return want

        cidrs = (ipaddress.ip_network("10.96.0.0/16"),)
        deadline = time.monotonic() + 5
        while (backend.view(), backend.service_cidrs) != (programmed(), cidrs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert backend.view() == programmed()
        assert backend.service_cidrs == cidrs

        fake.stop()
        fake.apply(endpoint_slice("svc-0-a", "svc-0", addresses=["10.244.9.1", "10.244.9.2"]))
        fake.delete("Service", "default", "svc-1")
        fake.delete("EndpointSlice", "default", "svc-1-a")
        fake.apply(service("svc-9", cluster_ip="10.96.0.9"))
        fake.apply(endpoint_slice("svc-9-a", "svc-9", addresses=["10.244.0.9"]))
        fake.compact()
        time.sleep(0.2)
        fake.start()
        deadline = time.monotonic() + 5
        while backend.view() != programmed() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert backend.view() == programmed()
        assert backend.view()["default/svc-0"] == ("10.244.9.1:8080", "10.244.9.2:8080")
    finally:
        stop.set()
        source.join()
        loop.join(5)


# Node


def test_node_updates_reach_the_handler_and_the_watcher(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake, services=1)
    exits: list[int] = []
    watcher = NodeWatcher(NODE, exit=exits.append)
    source = running.start(node_watcher=watcher)
    assert source.wait_for_sync(WAIT)
    assert watcher.ready and watcher.node_ips == (ipaddress.ip_address("192.168.0.10"),)
    handler = running.handler
    assert handler.node_states[-1] is not None
    assert handler.node_states[-1]["metadata"]["labels"]["topology.kubernetes.io/zone"] == "zone-a"
    # Other nodes are never asked for.
    assert all(s is None or s["metadata"]["name"] == NODE for s in handler.node_states)

    fake.apply(node(NODE, zone="zone-b"))
    assert handler.wait_for(
        lambda: (
            (handler.node_states[-1] or {})
            .get("metadata", {})
            .get("labels", {})
            .get("topology.kubernetes.io/zone")
            == "zone-b"
        )
    )
    assert exits == []
    fake.apply(node(NODE, zone="zone-b", taints=[{"key": "ToBeDeletedByClusterAutoscaler"}]))
    assert handler.wait_for(lambda: not watcher.eligible)
    fake.apply(node(NODE, zone="zone-b", addresses=["192.168.0.99"]))
    assert handler.wait_for(lambda: exits == [1])
    fake.delete("Node", "", NODE)
    assert handler.wait_for(lambda: handler.node_states[-1] is None)
    assert exits == [1, 1]


def test_node_deleted_while_away_is_seen_on_relist(fake: FakeAPIServer, running: Running) -> None:
    populate(fake, services=1)
    exits: list[int] = []
    source = running.start(node_watcher=NodeWatcher(NODE, exit=exits.append))
    assert source.wait_for_sync(WAIT)
    fake.stop()
    fake.delete("Node", "", NODE)
    fake.compact()
    fake.start()
    assert running.handler.wait_for(lambda: running.handler.node_states[-1] is None)
    assert exits == [1]


def test_missing_node_does_not_block_sync(fake: FakeAPIServer, running: Running) -> None:
    fake.apply(service("a"))
    watcher = NodeWatcher(NODE, exit=lambda code: None)
    source = running.start(node_watcher=watcher)
    assert source.wait_for_sync(WAIT)
    assert not watcher.wait_until_ready(0.1)
    fake.apply(node(NODE))
    assert watcher.wait_until_ready(5)
    assert running.handler.node_states[-1] is not None


def node_obj(
    addresses: Sequence[str] = ("192.168.0.10",),
    pod_cidrs: Sequence[str] = ("10.244.0.0/24",),
    **kwargs: Any,
) -> dict[str, Any]:
    return node(NODE, addresses=addresses, pod_cidrs=pod_cidrs, **kwargs)


def test_node_watcher_waits_for_host_ips_and_pod_cidrs() -> None:
    exits: list[int] = []
    watcher = NodeWatcher(NODE, watch_pod_cidrs=True, exit=exits.append)
    watcher.observe(node_obj(addresses=(), pod_cidrs=()))
    assert not watcher.ready
    watcher.observe(node_obj(pod_cidrs=()))
    assert not watcher.ready
    watcher.observe(node_obj())
    assert watcher.wait_until_ready(0)
    assert watcher.pod_cidrs == (ipaddress.ip_network("10.244.0.0/24"),)
    assert exits == []


def test_node_watcher_exits_when_host_ips_change() -> None:
    exits: list[int] = []
    watcher = NodeWatcher(NODE, exit=exits.append)
    watcher.observe(node_obj(addresses=("192.168.0.10", "fd00::10")))
    assert watcher.node_ips == (
        ipaddress.ip_address("192.168.0.10"),
        ipaddress.ip_address("fd00::10"),
    )
    # A third address of a family already seen is not a host IP: no change.
    watcher.observe(node_obj(addresses=("192.168.0.10", "fd00::10", "192.168.0.11")))
    assert exits == []
    # Pod CIDRs are not watched: no exit.
    watcher.observe(node_obj(addresses=("192.168.0.10", "fd00::10"), pod_cidrs=("10.9.0.0/24",)))
    assert exits == []
    # Losing every address is logged and ignored, as upstream does.
    watcher.observe(node_obj(addresses=()))
    assert exits == []
    watcher.observe(node_obj(addresses=("192.168.0.10",)))
    assert exits == [1]


def test_node_watcher_exits_on_pod_cidr_change_only_when_watching_them() -> None:
    exits: list[int] = []
    watcher = NodeWatcher(NODE, watch_pod_cidrs=True, exit=exits.append)
    watcher.observe(node_obj())
    watcher.observe(node_obj(zone="zone-a"))
    assert exits == []
    watcher.observe(node_obj(pod_cidrs=("10.244.1.0/24",)))
    assert exits == [1]


def test_node_watcher_exits_on_delete_and_tracks_eligibility() -> None:
    exits: list[int] = []
    watcher = NodeWatcher(NODE, exit=exits.append)
    watcher.observe(None)  # never seen: nothing to exit for
    assert exits == []
    watcher.observe(node_obj())
    assert watcher.eligible
    deleting = node_obj()
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    watcher.observe(deleting)
    assert not watcher.eligible and exits == []
    watcher.observe(node_obj())
    assert watcher.eligible
    watcher.observe(None)
    assert exits == [1] and watcher.node is None and not watcher.eligible


# ServiceCIDRs


def test_service_cidrs_follow_changes_and_skip_bad_ones(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    populate(fake, services=1)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    assert source.service_cidrs_served is True
    handler = running.handler
    assert len(handler.cidr_calls) == 1
    fake.apply(service_cidr("extra", "10.100.0.0/24", "not-a-cidr", "10.100.1.1/24"))
    assert handler.wait_for(lambda: len(handler.cidr_calls) == 2)
    assert handler.cidr_calls[-1] == [
        ipaddress.ip_network("10.96.0.0/16"),
        ipaddress.ip_network("10.100.0.0/24"),
        ipaddress.ip_network("fd00:10:96::/112"),
    ]
    bad = [r for r in caplog.records if "ServiceCIDR extra" in r.getMessage()]
    assert len(bad) == 2  # one line per bad CIDR
    # A change that does not change the CIDRs is not a call; the bad ones are not re-logged.
    fake.apply(
        {
            **service_cidr("extra", "10.100.0.0/24", "not-a-cidr", "10.100.1.1/24"),
            "metadata": {"name": "extra", "labels": {"x": "y"}},
        }
    )
    fake.delete("ServiceCIDR", "", "kubernetes")
    assert handler.wait_for(lambda: len(handler.cidr_calls) == 3)
    assert handler.cidr_calls[-1] == [ipaddress.ip_network("10.100.0.0/24")]
    assert len([r for r in caplog.records if "ServiceCIDR extra" in r.getMessage()]) == 2


def test_service_cidrs_not_served_are_never_asked_for() -> None:
    with FakeAPIServer(service_cidrs=False) as fake:
        populate_without_cidrs(fake)
        run = Running(fake)
        try:
            source = run.start()
            assert source.wait_for_sync(WAIT)
            assert source.service_cidrs_served is False
            time.sleep(0.2)
        finally:
            run.close()
        assert run.handler.cidr_calls == []
        assert not [r for r in fake.requests if r.resource == "servicecidrs"]
        assert any(r.path.rstrip("/") == "/apis/networking.k8s.io/v1" for r in fake.requests)


def populate_without_cidrs(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    fake.apply(endpoint_slice("a-1", "a"))
    fake.apply(node(NODE))


def test_service_cidr_discovery_is_retried(
    fake: FakeAPIServer, running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=SOURCE_LOGGER)
    populate(fake, services=1)
    failures = iter([True, True])

    def fail_discovery(request: APIRequest) -> None:
        if request.path.rstrip("/") == "/apis/networking.k8s.io/v1" and next(failures, False):
            fake.stop()
            fake.start()

    fake.on_request = fail_discovery
    source = running.start()
    assert source.wait_for_sync(WAIT)
    assert source.service_cidrs_served is True
    assert running.handler.cidr_calls
    retries = [r for r in caplog.records if "cannot tell whether" in r.getMessage()]
    assert len(retries) == 2


# RBAC: exactly the calls the proxy makes


def test_api_calls_are_exactly_what_the_cluster_role_needs(
    fake: FakeAPIServer, running: Running
) -> None:
    populate(fake, services=2)
    source = running.start()
    assert source.wait_for_sync(WAIT)
    recorder = EventRecorder(fake.api_client(), NODE)
    recorder.starting()
    assert recorder.close(5)
    fake.drop_watches()
    assert fake.wait_for_watches("services", 1, timeout=WAIT)
    expected = {
        ("", "services", "list"),
        ("", "services", "watch"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("networking.k8s.io", "servicecidrs", "list"),
        ("networking.k8s.io", "servicecidrs", "watch"),
        ("events.k8s.io", "events", "create"),
    }
    assert fake.resource_requests() == expected
    # The rules of a minimal node-proxier role allow every request made.
    rules = [
        {"apiGroups": [""], "resources": ["services", "nodes"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": ["networking.k8s.io"],
            "resources": ["servicecidrs"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
        {"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/version"], "verbs": ["get"]},
    ]
    assert all(allowed_by(rules, r) for r in fake.requests)
    # and each rule (verb by verb) is used.
    for rule in rules[:-1]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert (group, resource, verb) in expected
    # The node is only ever asked for by name.
    node_requests = [r for r in fake.requests if r.resource == "nodes"]
    assert node_requests


# Client construction


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(
        textwrap.dedent(
            f"""\
            apiVersion: v1
            kind: Config
            clusters:
            - name: test
              cluster: {{server: "{server}"}}
            users:
            - name: proxy
              user: {{token: "{token}"}}
            contexts:
            - name: test
              context: {{cluster: test, user: proxy}}
            current-context: test
            """
        )
    )
    return path


def list_services(api: client.ApiClient) -> int:
    # The raw request, as the source makes it (the generated CoreV1Api takes seconds to build).
    params = api.param_serialize("GET", "/api/v1/services", auth_settings=["BearerToken"])
    response: Any = api.call_api(*params, _request_timeout=5)
    data = response.read()
    if response.status != 200:
        raise client.ApiException(status=response.status, reason=response.reason)
    return len(json.loads(data)["items"])


def test_make_api_client_from_a_kubeconfig(tmp_path: Path) -> None:
    with FakeAPIServer(token="s3cret") as fake:
        fake.apply(service("a"))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url, "s3cret")
        api = make_api_client(
            str(kubeconfig), None, qps=50, burst=5, content_type="application/json"
        )
        assert isinstance(api, RateLimitedApiClient)
        assert list_services(api) == 1
        assert fake.requests[-1].verb == "list"


def test_make_api_client_master_overrides_the_kubeconfig_server(tmp_path: Path) -> None:
    with FakeAPIServer(token="s3cret") as fake:
        fake.apply(service("a"))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:1", "s3cret")
        api = make_api_client(str(kubeconfig), fake.url, qps=50, burst=5)
        assert api.configuration.host == fake.url
        assert list_services(api) == 1


def test_make_api_client_with_master_alone() -> None:
    with FakeAPIServer() as fake:
        fake.apply(service("a"))
        api = make_api_client(None, fake.url)
        assert list_services(api) == 1
    with FakeAPIServer(token="needed") as fake:
        api = make_api_client(None, fake.url)
        with pytest.raises(client.ApiException) as raised:
            list_services(api)
        assert raised.value.status == 401


def test_make_api_client_falls_back_to_in_cluster(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[Any] = []

    def fake_in_cluster(client_configuration: Any = None, **_: Any) -> None:
        seen.append(client_configuration)
        client_configuration.host = "https://10.96.0.1:443"

    monkeypatch.setattr(config, "load_incluster_config", fake_in_cluster)
    caplog.set_level(logging.WARNING, logger=SOURCE_LOGGER)
    api = make_api_client(None, None)
    assert api.configuration.host == "https://10.96.0.1:443"
    assert len(seen) == 1
    assert [r.getMessage() for r in caplog.records] == [IN_CLUSTER_MESSAGE]


def test_make_api_client_in_cluster_outside_a_pod_raises() -> None:
    with pytest.raises(config.ConfigException):
        make_api_client(None, None)


def test_make_api_client_rejects_unknown_content_types() -> None:
    with pytest.raises(ValueError, match="content type"):
        make_api_client(None, "http://127.0.0.1:1", content_type="text/plain")


class CountingBucket(TokenBucket):
    def __init__(self) -> None:
        super().__init__(1000.0, 2)
        self.calls = 0

    def acquire(self) -> float:
        self.calls += 1
        return super().acquire()


def test_rate_limit_applies_to_every_request() -> None:
    with FakeAPIServer() as fake:
        api = make_api_client(None, fake.url, qps=1000, burst=2)
        bucket = CountingBucket()
        api.bucket = bucket
        for _ in range(4):
            list_services(api)
        recorder = EventRecorder(api, NODE)
        recorder.starting()
        assert recorder.close(5)
        assert bucket.calls == 5 == len(fake.requests)


def test_token_bucket_bursts_then_paces() -> None:
    now = [100.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(2.0, 3, clock=lambda: now[0], sleep=sleep)
    waits = [bucket.acquire() for _ in range(5)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3] == pytest.approx(0.5)
    assert waits[4] == pytest.approx(0.5)
    now[0] += 10  # idle time refills up to the burst, no more
    assert [bucket.acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.acquire() == pytest.approx(0.5)
    assert TokenBucket(0, 1, sleep=sleep).acquire() == 0.0


def test_backoff_is_jittered_exponential_and_capped() -> None:
    handler = RecordingHandler()
    source = KubernetesSource(
        FakeAPIServer().api_client(),
        handler,
        NODE,
        initial_backoff=1.0,
        max_backoff=30.0,
        rng=random.Random(3),
    )
    reflector = source._services
    delays = [reflector._next_delay() for _ in range(10)]
    bases = [min(30.0, 2.0**i) for i in range(10)]
    for delay, base in zip(delays, bases, strict=True):
        assert base / 2 <= delay <= base
    assert max(delays) <= 30.0
    assert len(set(delays)) == len(delays)


def test_source_module_exports() -> None:
    assert set(kube.__all__) >= {"KubernetesSource", "NodeWatcher", "make_api_client"}
