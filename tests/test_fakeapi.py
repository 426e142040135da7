"""The fake API server behaves like kube-apiserver for the calls a proxy makes."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from kubeproxy.testing.fakeapi import (
    APIRequest,
    FakeAPIServer,
    allowed_by,
    endpoint_slice,
    make_certificates,
    node,
    service,
    service_cidr,
)


@pytest.fixture
def fake() -> Iterator[FakeAPIServer]:
    server = FakeAPIServer(bookmark_interval=0.1).start()
    try:
        yield server
    finally:
        server.stop()


def get(
    fake: FakeAPIServer, path: str, headers: dict[str, str] | None = None, **query: Any
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(fake.host, fake.port, timeout=5)
    try:
        url = path + ("?" + urlencode(query) if query else "")
        conn.request("GET", url, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def watch(fake: FakeAPIServer, path: str, **query: Any) -> tuple[int, list[dict[str, Any]], bool]:
    """Read a watch to its end: (status, events, ended cleanly)."""
    conn = http.client.HTTPConnection(fake.host, fake.port, timeout=5)
    try:
        conn.request("GET", path + "?" + urlencode({"watch": "true", **query}))
        response = conn.getresponse()
        clean = True
        try:
            data = response.read()
        except http.client.IncompleteRead as err:
            data, clean = err.partial, False
        events = [json.loads(line) for line in data.splitlines() if line.strip()]
        return response.status, events, clean
    finally:
        conn.close()


def names(items: list[dict[str, Any]]) -> list[str]:
    return [i["metadata"]["name"] for i in items]


# Discovery


def test_version_and_discovery(fake: FakeAPIServer) -> None:
    status, version = get(fake, "/version")
    assert status == 200 and version["gitVersion"] == "v1.36.0" and version["minor"] == "36"
    status, apis = get(fake, "/apis")
    groups = {g["name"] for g in apis["groups"]}
    assert {"discovery.k8s.io", "networking.k8s.io", "events.k8s.io"} <= groups
    status, core = get(fake, "/api/v1")
    assert {"services", "nodes"} <= {r["name"] for r in core["resources"]}
    status, networking = get(fake, "/apis/networking.k8s.io/v1/")
    assert status == 200
    assert "servicecidrs" in {r["name"] for r in networking["resources"]}
    status, _ = get(fake, "/apis/nothing.example.com/v1")
    assert status == 404


def test_service_cidrs_can_be_absent() -> None:
    with FakeAPIServer(service_cidrs=False) as fake:
        status, networking = get(fake, "/apis/networking.k8s.io/v1")
        assert status == 200
        assert "servicecidrs" not in {r["name"] for r in networking["resources"]}
        status, body = get(fake, "/apis/networking.k8s.io/v1/servicecidrs")
        assert status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"


# Lists


def test_list_pages_with_continue_and_one_snapshot(fake: FakeAPIServer) -> None:
    for i in range(5):
        fake.apply(service(f"s{i}"))
    status, first = get(fake, "/api/v1/services", limit=2)
    assert status == 200 and first["kind"] == "ServiceList"
    assert names(first["items"]) == ["s0", "s1"]
    assert first["metadata"]["remainingItemCount"] == 3
    # Items come without kind/apiVersion, like the real server's lists.
    assert "kind" not in first["items"][0]
    rv = first["metadata"]["resourceVersion"]
    # Changes after the first page do not show in the rest of this list.
    fake.apply(service("s2", cluster_ip="10.96.9.9"))
    fake.delete("Service", "default", "s4")
    status, second = get(
        fake, "/api/v1/services", limit=2, **{"continue": first["metadata"]["continue"]}
    )
    assert names(second["items"]) == ["s2", "s3"]
    assert second["items"][0]["spec"]["clusterIP"] == "10.96.0.10"
    status, third = get(
        fake, "/api/v1/services", limit=2, **{"continue": second["metadata"]["continue"]}
    )
    assert names(third["items"]) == ["s4"] and "continue" not in third["metadata"]
    assert third["metadata"]["resourceVersion"] == rv


def test_compaction_expires_continue_tokens(fake: FakeAPIServer) -> None:
    for i in range(3):
        fake.apply(service(f"s{i}"))
    _, first = get(fake, "/api/v1/services", limit=1)
    fake.compact()
    status, body = get(
        fake, "/api/v1/services", limit=1, **{"continue": first["metadata"]["continue"]}
    )
    assert status == 410 and body["reason"] == "Expired"


def test_selectors(fake: FakeAPIServer) -> None:
    fake.apply(service("plain"))
    fake.apply(service("headless", cluster_ip="None"))
    fake.apply(service("other", labels={"service.kubernetes.io/service-proxy-name": "x"}))
    fake.apply(service("app", labels={"app": "web"}))
    fake.apply(service("elsewhere", namespace="kube-system"))
    _, body = get(
        fake,
        "/api/v1/services",
        labelSelector="!service.kubernetes.io/service-proxy-name",
        fieldSelector="spec.clusterIP!=None",
    )
    assert sorted(names(body["items"])) == ["app", "elsewhere", "plain"]
    _, body = get(fake, "/api/v1/services", labelSelector="app=web")
    assert names(body["items"]) == ["app"]
    _, body = get(fake, "/api/v1/services", labelSelector="app")
    assert names(body["items"]) == ["app"]
    _, body = get(fake, "/api/v1/services", labelSelector="app!=web")
    assert "app" not in names(body["items"]) and "plain" in names(body["items"])
    _, body = get(fake, "/api/v1/namespaces/kube-system/services")
    assert names(body["items"]) == ["elsewhere"]
    status, body = get(fake, "/api/v1/services", fieldSelector="spec.selector=x")
    assert status == 400 and "not a known field selector" in body["message"]
    status, _ = get(fake, "/api/v1/services", labelSelector="a,,b")
    assert status == 400


def test_nodes_by_name(fake: FakeAPIServer) -> None:
    fake.apply(node("node-a"))
    fake.apply(node("node-b"))
    _, body = get(fake, "/api/v1/nodes", fieldSelector="metadata.name=node-b")
    assert names(body["items"]) == ["node-b"]
    status, one = get(fake, "/api/v1/nodes/node-a")
    assert status == 200 and one["kind"] == "Node"
    status, missing = get(fake, "/api/v1/nodes/node-z")
    assert status == 404 and missing["reason"] == "NotFound"


def test_objects_get_metadata_and_null_lists(fake: FakeAPIServer) -> None:
    stored = fake.apply(endpoint_slice("empty", "svc", addresses=[], ports=[]))
    assert stored["endpoints"] is None and stored["ports"] is None
    assert stored["metadata"]["uid"] and stored["metadata"]["resourceVersion"] == "1"
    again = fake.apply(endpoint_slice("empty", "svc"))
    assert again["metadata"]["uid"] == stored["metadata"]["uid"]
    assert again["metadata"]["resourceVersion"] == "2" and fake.resource_version == 2
    assert (
        fake.apply(service("nons") | {"metadata": {"name": "nons"}})["metadata"]["namespace"]
        == "default"
    )
    assert (
        "namespace"
        not in fake.apply(node("n") | {"metadata": {"name": "n", "namespace": "x"}})["metadata"]
    )
    with pytest.raises(ValueError):
        fake.apply({"kind": "Pod", "metadata": {"name": "p"}})
    assert not fake.delete("Service", "default", "absent")


# Watch


def test_watch_streams_changes_bookmarks_and_ends_cleanly(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    start = fake.resource_version

    def churn() -> None:
        time.sleep(0.15)
        fake.apply(service("b"))
        fake.apply(node("unrelated"))
        fake.apply(service("a", cluster_ip="10.96.0.99"))
        fake.delete("Service", "default", "b")

    threading.Thread(target=churn).start()
    status, events, clean = watch(
        fake,
        "/api/v1/services",
        resourceVersion=start,
        allowWatchBookmarks="true",
        timeoutSeconds=1,
    )
    assert status == 200 and clean
    changes = [
        (e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] != "BOOKMARK"
    ]
    assert changes == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    assert events[0]["object"]["kind"] == "Service"
    bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
    assert len(bookmarks) >= 3
    # A bookmark after the node change carries the global resourceVersion.
    assert int(bookmarks[-1]["object"]["metadata"]["resourceVersion"]) == fake.resource_version


def test_watch_without_bookmarks_gets_none(fake: FakeAPIServer) -> None:
    status, events, clean = watch(
        fake, "/api/v1/services", resourceVersion=fake.resource_version, timeoutSeconds=1
    )
    assert status == 200 and clean and events == []


def test_watch_from_zero_starts_with_the_current_state(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    fake.apply(service("b"))
    _, events, _ = watch(fake, "/api/v1/services", timeoutSeconds=1)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "a"),
        ("ADDED", "b"),
    ]


def test_watch_from_a_compacted_version_is_an_error_event(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    old = fake.resource_version
    fake.apply(service("b"))
    fake.compact()
    status, events, clean = watch(fake, "/api/v1/services", resourceVersion=old, timeoutSeconds=1)
    assert status == 200 and clean
    assert [e["type"] for e in events] == ["ERROR"]
    error = events[0]["object"]
    assert (error["kind"], error["code"], error["reason"]) == ("Status", 410, "Expired")
    # From the compaction point on, it is fine.
    _, events, _ = watch(
        fake, "/api/v1/services", resourceVersion=fake.resource_version, timeoutSeconds=1
    )
    assert all(e["type"] != "ERROR" for e in events)


def test_watch_selector_transitions(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    start = fake.resource_version

    def relabel() -> None:
        time.sleep(0.1)
        fake.apply(service("a", labels={"service.kubernetes.io/service-proxy-name": "x"}))
        fake.apply(service("a"))

    threading.Thread(target=relabel).start()
    _, events, _ = watch(
        fake,
        "/api/v1/services",
        resourceVersion=start,
        labelSelector="!service.kubernetes.io/service-proxy-name",
        timeoutSeconds=1,
    )
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("DELETED", str(start + 1)),
        ("ADDED", str(start + 2)),
    ]


def test_drop_and_expire_watches(fake: FakeAPIServer) -> None:
    results: list[tuple[int, list[dict[str, Any]], bool]] = []

    def watch_services() -> None:
        results.append(watch(fake, "/api/v1/services", resourceVersion=0, timeoutSeconds=5))

    thread = threading.Thread(target=watch_services)
    thread.start()
    assert fake.wait_for_watches("services", 1)
    assert fake.drop_watches("nodes") == 0
    assert fake.drop_watches("services") == 1
    thread.join(5)
    assert results[0][2] is False  # cut, not a clean end
    assert fake.open_watches() == 0

    thread = threading.Thread(target=watch_services)
    thread.start()
    assert fake.wait_for_watches("services", 1)
    assert fake.expire_watches() == 1
    thread.join(5)
    _, events, clean = results[1]
    assert clean and events[-1]["type"] == "ERROR" and events[-1]["object"]["code"] == 410


# Faults


@pytest.mark.parametrize("code", [403, 429, 500, 503])
def test_fail_next(fake: FakeAPIServer, code: int) -> None:
    fake.fail_next("services", code, count=2, verb="list")
    for _ in range(2):
        status, body = get(fake, "/api/v1/services")
        assert status == code and body["code"] == code
    assert get(fake, "/api/v1/services")[0] == 200
    if code == 403:
        assert 'cannot list resource "services" in API group ""' in body["message"]


def test_fail_next_only_the_verb_asked(fake: FakeAPIServer) -> None:
    fake.fail_next("services", 500, verb="watch")
    assert get(fake, "/api/v1/services")[0] == 200
    status, _, _ = watch(fake, "/api/v1/services", timeoutSeconds=1)
    assert status == 500
    fake.fail_next("nodes", 503, count=5)
    fake.clear_failures()
    assert get(fake, "/api/v1/nodes")[0] == 200


def test_delay(fake: FakeAPIServer) -> None:
    fake.delay = 0.3
    started = time.monotonic()
    assert get(fake, "/version")[0] == 200
    assert time.monotonic() - started >= 0.3


def test_token_is_required_when_set() -> None:
    with FakeAPIServer(token="t0k") as fake:
        assert get(fake, "/api/v1/services")[0] == 401
        assert get(fake, "/api/v1/services", {"Authorization": "Bearer t0k"})[0] == 200
        # The scheme in any case, as kube-apiserver reads it (the official client's
        # in-cluster loader sends "bearer").
        assert get(fake, "/api/v1/services", {"Authorization": "bearer t0k"})[0] == 200
        assert get(fake, "/api/v1/services", {"Authorization": "Basic t0k"})[0] == 401


def _https_get(fake: FakeAPIServer, context: ssl.SSLContext) -> int:
    connection = http.client.HTTPSConnection(fake.host, fake.port, context=context, timeout=5)
    try:
        connection.request("GET", "/version")
        return connection.getresponse().status
    finally:
        connection.close()


def test_https_with_and_without_client_certificates(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path, hosts=("127.0.0.1",))
    trusting = ssl.create_default_context(cafile=str(certs.ca))
    with FakeAPIServer(tls=certs.server_context()) as fake:
        assert fake.url == f"https://127.0.0.1:{fake.port}"
        assert _https_get(fake, trusting) == 200
        # A client that does not trust the fake's authority refuses it.
        with pytest.raises(ssl.SSLCertVerificationError):
            _https_get(fake, ssl.create_default_context())
    with FakeAPIServer(tls=certs.server_context(client_certificates=True)) as fake:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _https_get(fake, trusting)
        with_certificate = ssl.create_default_context(cafile=str(certs.ca))
        with_certificate.load_cert_chain(certs.client_certificate, certs.client_key)
        assert _https_get(fake, with_certificate) == 200
        # The failed handshake did not stop the server.
        assert fake.running


def test_stop_cuts_everything_and_restart_keeps_port_and_state(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))
    port = fake.port
    results: list[tuple[int, list[dict[str, Any]], bool]] = []
    thread = threading.Thread(
        target=lambda: results.append(
            watch(fake, "/api/v1/services", resourceVersion=1, timeoutSeconds=5)
        )
    )
    thread.start()
    assert fake.wait_for_watches("services", 1)
    fake.stop()
    thread.join(5)
    assert results[0][2] is False
    assert not fake.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((fake.host, port), timeout=1).close()
    fake.apply(service("b"))  # changes while down
    fake.start()
    assert fake.port == port
    _, body = get(fake, "/api/v1/services")
    assert names(body["items"]) == ["a", "b"]
    _, events, _ = watch(fake, "/api/v1/services", resourceVersion=1, timeoutSeconds=1)
    assert [e["object"]["metadata"]["name"] for e in events] == ["b"]


def test_a_connection_accepted_while_stopping_is_cut(fake: FakeAPIServer) -> None:
    # The listener accepts until its shutdown returns; a client reconnecting in that
    # window must meet a dead server, not a watch that sees the changes made "while away".
    fake.apply(service("a"))
    server = fake._listener.server
    assert server is not None
    real_shutdown = server.shutdown
    refused: list[BaseException] = []

    def shutdown_after_a_reconnect() -> None:
        fake.apply(service("while-away"))
        try:
            status, events, clean = watch(
                fake, "/api/v1/services", resourceVersion=1, timeoutSeconds=1
            )
        except (ConnectionError, http.client.HTTPException) as err:
            refused.append(err)
        else:
            raise AssertionError(f"answered while stopping: {status} {events} {clean}")
        real_shutdown()

    server.shutdown = shutdown_after_a_reconnect  # type: ignore[method-assign]
    fake.stop()
    assert len(refused) == 1 and not fake.running


def test_on_request_hook_runs_before_the_answer(fake: FakeAPIServer) -> None:
    fake.apply(service("a"))

    def add_one(request: APIRequest) -> None:
        if request.verb == "list":
            fake.apply(service("from-hook"))

    fake.on_request = add_one
    _, body = get(fake, "/api/v1/services")
    assert "from-hook" in names(body["items"])


# Events and the request log


def test_events_are_created_and_recorded(fake: FakeAPIServer) -> None:
    conn = http.client.HTTPConnection(fake.host, fake.port, timeout=5)
    event = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "node-a.123"},
        "reason": "Starting",
        "regarding": {"kind": "Node", "name": "node-a"},
    }
    conn.request("POST", "/apis/events.k8s.io/v1/namespaces/default/events", json.dumps(event))
    response = conn.getresponse()
    assert response.status == 201
    assert json.loads(response.read())["metadata"]["namespace"] == "default"
    conn.request("POST", "/apis/events.k8s.io/v1/namespaces/default/events", json.dumps(event))
    response = conn.getresponse()
    assert response.status == 409
    response.read()
    conn.request(
        "POST", "/apis/events.k8s.io/v1/namespaces/default/events", json.dumps({"kind": "Pod"})
    )
    response = conn.getresponse()
    assert response.status == 400
    response.read()
    conn.close()
    assert [e["reason"] for e in fake.posted_events] == ["Starting"]


def test_request_log_uses_rbac_verbs(fake: FakeAPIServer) -> None:
    fake.apply(node("node-a"))
    get(fake, "/version")
    get(fake, "/api/v1/nodes", fieldSelector="metadata.name=node-a")
    get(fake, "/api/v1/nodes/node-a")
    watch(fake, "/apis/discovery.k8s.io/v1/endpointslices", timeoutSeconds=1)
    get(fake, "/apis/networking.k8s.io/v1/servicecidrs")
    get(fake, "/api/v1/namespaces/kube-system/services")
    assert fake.requests == [
        APIRequest("get", "", "", "", path="/version"),
        APIRequest("list", "nodes", "", "", "", "", "/api/v1/nodes"),
        APIRequest("get", "nodes", "", "", "", "node-a", "/api/v1/nodes/node-a"),
        APIRequest(
            "watch",
            "endpointslices",
            "",
            "",
            "discovery.k8s.io",
            "",
            "/apis/discovery.k8s.io/v1/endpointslices",
        ),
        APIRequest(
            "list",
            "servicecidrs",
            "",
            "",
            "networking.k8s.io",
            "",
            "/apis/networking.k8s.io/v1/servicecidrs",
        ),
        APIRequest(
            "list", "services", "kube-system", "", "", "", "/api/v1/namespaces/kube-system/services"
        ),
    ]
    assert fake.resource_requests() == {
        ("", "nodes", "list"),
        ("", "nodes", "get"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("networking.k8s.io", "servicecidrs", "list"),
        ("", "services", "list"),
    }
    fake.clear_requests()
    assert fake.requests == []


def test_allowed_by() -> None:
    rules = [
        {
            "apiGroups": [""],
            "resources": ["nodes"],
            "verbs": ["get", "list"],
            "resourceNames": ["node-a"],
        },
        {"apiGroups": ["discovery.k8s.io"], "resources": ["*"], "verbs": ["watch"]},
        {"nonResourceURLs": ["/apis/*", "/version"], "verbs": ["get"]},
    ]
    assert allowed_by(rules, APIRequest("get", "nodes", "", "", "", "node-a"))
    assert not allowed_by(rules, APIRequest("get", "nodes", "", "", "", "node-b"))
    assert not allowed_by(rules, APIRequest("watch", "nodes", "", "", ""))
    assert allowed_by(rules, APIRequest("watch", "endpointslices", "", "", "discovery.k8s.io"))
    assert not allowed_by(rules, APIRequest("list", "endpointslices", "", "", "discovery.k8s.io"))
    assert allowed_by(rules, APIRequest("get", "", "", "", path="/apis/networking.k8s.io/v1"))
    assert allowed_by(rules, APIRequest("get", "", "", "", path="/version"))
    assert not allowed_by(rules, APIRequest("get", "", "", "", path="/api/v1"))
    assert not allowed_by(rules, APIRequest("list", "services", "", "status", ""))


def test_helpers_build_valid_objects(fake: FakeAPIServer) -> None:
    fake.apply(service_cidr("kubernetes", "10.96.0.0/16"))
    _, body = get(fake, "/apis/networking.k8s.io/v1/servicecidrs")
    assert body["items"][0]["spec"]["cidrs"] == ["10.96.0.0/16"]
    labelled = node("n", zone="z1", taints=[{"key": "k", "effect": "NoSchedule"}])
    assert labelled["metadata"]["labels"]["topology.kubernetes.io/zone"] == "z1"
    assert labelled["spec"]["taints"] == [{"key": "k", "effect": "NoSchedule"}]
