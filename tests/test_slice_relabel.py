"""An EndpointSlice whose ``kubernetes.io/service-name`` label changes (issue 31, item 3).

The slice leaves the Service it named and serves the one it names now, through the
core (the change tracker and the Proxier) and so in every backend that consumes the
core's view: the state a relabel leaves equals what a fresh proxy fed the final objects
writes, for the nftables, iptables and ipvs backends over their fakes, for the
health-check counts of local endpoints and for the stale UDP flows conntrack cleans.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kubeproxy.backend import Backend
from kubeproxy.backends.iptables import IptablesBackend
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.inspect import served_frontends, slots_of
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.backends.nftables.table import TABLE
from kubeproxy.config import ProxierConfig
from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
from kubeproxy.objects import IPFamily, NamespacedName, Protocol, ServicePortName
from kubeproxy.proxier import Proxier
from tests.test_ipvs_proxier import Kit
from tests.test_proxier import endpoint_slice, ep, initialized, service

V4 = IPFamily.IPV4
NODE = "node-a"
A = NamespacedName("demo", "lm-a")
B = NamespacedName("demo", "lm-b")
A_HTTP = ServicePortName(A, "http", Protocol.TCP)
B_HTTP = ServicePortName(B, "http", Protocol.TCP)


def relabelled(slice_: dict[str, Any], service_name: str | None) -> dict[str, Any]:
    """``slice_`` with its Service label set to ``service_name`` (None: removed)."""
    moved = copy.deepcopy(slice_)
    labels = moved["metadata"]["labels"]
    if service_name is None:
        del labels["kubernetes.io/service-name"]
    else:
        labels["kubernetes.io/service-name"] = service_name
    return moved


def cluster() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two Services and one slice of lm-a: a local endpoint and a remote one, TCP and UDP."""
    ports = [("http", 80, "TCP"), ("dns", 53, "UDP")]
    services = [
        service("lm-a", "172.30.0.10", ports=ports),
        service("lm-b", "172.30.0.11", ports=ports),
    ]
    slice_ = endpoint_slice(
        "lm-a-1",
        "lm-a",
        [ep("10.244.0.11"), ep("10.244.1.12", "node-b")],
        ports=[("http", 8080, "TCP"), ("dns", 5353, "UDP")],
    )
    return services, slice_


# --- the core -------------------------------------------------------------------------


def applied(slice_: dict[str, Any]) -> tuple[EndpointsChangeTracker, EndpointsMap]:
    """A tracker and a map that hold ``slice_``, applied."""
    tracker = EndpointsChangeTracker(V4, NODE)
    endpoints = EndpointsMap()
    tracker.update(slice_, False)
    endpoints.apply(tracker)
    return tracker, endpoints


def test_the_tracker_moves_a_relabelled_slice() -> None:
    _, before = cluster()
    after = relabelled(before, "lm-b")
    tracker, endpoints = applied(before)
    assert tracker.update(after, False, previous=before) is True
    result = endpoints.apply(tracker)
    assert result.updated_services == {A, B}
    assert A_HTTP not in endpoints
    assert [e.key for e in endpoints[B_HTTP]] == ["10.244.0.11:8080", "10.244.1.12:8080"]
    assert endpoints.local_ready_endpoints() == {B: 1}
    dns_a = ServicePortName(A, "dns", Protocol.UDP)
    assert [(name, e.key) for name, e in result.stale_endpoints] == [
        (dns_a, "10.244.0.11:5353"),
        (dns_a, "10.244.1.12:5353"),
    ]


def test_a_slice_that_loses_its_label_leaves_its_service() -> None:
    _, before = cluster()
    tracker, endpoints = applied(before)
    assert tracker.update(relabelled(before, None), False, previous=before) is True
    assert endpoints.apply(tracker).updated_services == {A}
    assert dict(endpoints) == {}
    assert tracker.invalid_objects == 1  # the unlabelled slice is still reported


def test_a_relabel_and_back_before_a_sync_changes_nothing() -> None:
    _, before = cluster()
    after = relabelled(before, "lm-b")
    tracker, endpoints = applied(before)
    tracker.update(after, False, previous=before)
    tracker.update(before, False, previous=after)
    assert endpoints.apply(tracker).updated_services == frozenset()
    assert [e.key for e in endpoints[A_HTTP]] == ["10.244.0.11:8080", "10.244.1.12:8080"]


# --- every backend, against a fresh proxy of the final objects -------------------------


class Subject:
    """A backend over its fake, and the text of everything it wrote."""

    def __init__(self, backend: Backend, state: Callable[[], object]) -> None:
        self.backend = backend
        self.state = state


def nftables() -> Subject:
    fake = FakeNft()

    def served() -> object:
        # What a connection meets: each dispatched frontend's endpoints, and the verdicts
        # for frontends without any. Class chains stay in a generation until its end, so
        # the text of the table is no measure (a fresh sync has no unused class).
        frontends = served_frontends(fake, Family.IP)
        slots = {key: sorted(slots_of(fake, Family.IP, key)) for key in frontends}
        verdicts = {
            name: sorted((e.key, e.value) for e in fake.list_elements(Family.IP, TABLE, name))
            for name in fake.list_sets(Family.IP, TABLE)
            if name.startswith("no-endpoint-")
        }
        return slots, verdicts

    return Subject(NftablesBackend(V4, ProxierConfig(node_name=NODE), executor=fake), served)


def iptables() -> Subject:
    fake = FakeIptables()
    return Subject(
        IptablesBackend(V4, ProxierConfig(node_name=NODE), executor=fake),
        lambda: fake.dump(V4),
    )


def ipvs() -> Subject:
    kit = Kit()
    return Subject(kit.backend(ProxierConfig(node_name=NODE)), kit.state)


def fed(subject: Subject, services: Sequence[dict[str, Any]], slice_: dict[str, Any]) -> Proxier:
    proxier = Proxier(V4, ProxierConfig(node_name=NODE), subject.backend)
    for obj in services:
        proxier.on_service_add(obj)
    proxier.on_endpoint_slice_add(slice_)
    initialized(proxier)
    return proxier


@pytest.mark.parametrize("make", [nftables, iptables, ipvs], ids=["nftables", "iptables", "ipvs"])
@pytest.mark.parametrize("label", ["lm-b", None], ids=["relabelled", "unlabelled"])
def test_every_backend_ends_where_a_fresh_proxy_starts(
    make: Callable[[], Subject], label: str | None
) -> None:
    services, before = cluster()
    after = relabelled(before, label)
    subject = make()
    proxier = fed(subject, services, before)
    assert proxier.local_ready_count(A) == 1
    proxier.on_endpoint_slice_update(before, after)
    assert proxier.sync_now()
    fresh = make()
    reference = fed(fresh, services, after)
    assert subject.state() == fresh.state()
    assert dict(proxier.endpoints) == dict(reference.endpoints)
    assert proxier.local_ready_endpoints() == reference.local_ready_endpoints()
    assert A_HTTP not in proxier.endpoints
