"""categorize_endpoints: traffic policy, topology hints and the terminating fallback."""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from kubeproxy.objects import (
    CategorizedEndpoints,
    Endpoint,
    NamespacedName,
    Protocol,
    ServicePort,
    ServicePortName,
)
from kubeproxy.topology import TopologyMode, categorize_endpoints, topology_mode

NODE = "node-1"
ZONE = "zone-a"
NAME = ServicePortName(NamespacedName("ns", "svc"), "", Protocol.TCP)


def svc(*, itp_local: bool = False, etp_local: bool = False, node_port: int = 0) -> ServicePort:
    return ServicePort(
        name=NAME,
        cluster_ip=ipaddress.ip_address("10.96.0.1"),
        port=80,
        protocol=Protocol.TCP,
        node_port=node_port,
        internal_policy_local=itp_local,
        external_policy_local=etp_local,
    )


CLUSTER = svc()
ITP_LOCAL = svc(itp_local=True)
ETP_LOCAL = svc(etp_local=True, node_port=30080)
BOTH_LOCAL = svc(itp_local=True, etp_local=True, node_port=30080)


def e(
    last_octet: int,
    *,
    local: bool = False,
    ready: bool = True,
    serving: bool = True,
    terminating: bool = False,
    zones: str = "",
    nodes: str = "",
) -> Endpoint:
    return Endpoint(
        ipaddress.ip_address(f"10.0.0.{last_octet}"),
        80,
        is_local=local,
        ready=ready,
        serving=serving,
        terminating=terminating,
        zone_hints=frozenset(zones.split()),
        node_hints=frozenset(nodes.split()),
    )


def term(
    last_octet: int, *, local: bool = False, serving: bool = True, zones: str = ""
) -> Endpoint:
    return e(last_octet, local=local, ready=False, serving=serving, terminating=True, zones=zones)


@dataclass
class Case:
    id: str
    service: ServicePort
    endpoints: list[Endpoint]
    cluster: list[int] | None  # last octets; None: same as `local`/empty per policy
    local: list[int] = field(default_factory=list)
    reachable: list[int] | None = None  # None: same as cluster
    has_any: bool = True
    node: str = NODE
    zone: str = ZONE


CASES = [
    Case("empty", CLUSTER, [], [], has_any=False),
    # Cluster policy, no hints.
    Case("cluster-all-ready", CLUSTER, [e(1), e(2, local=True), e(3)], [1, 2, 3]),
    Case("cluster-skips-not-ready", CLUSTER, [e(1), e(2, ready=False), term(3)], [1]),
    Case(
        "cluster-terminating-fallback",
        CLUSTER,
        [e(1, ready=False, serving=False), term(2), term(3, serving=False), term(4, local=True)],
        [2, 4],
    ),
    Case(
        "cluster-nothing-usable",
        CLUSTER,
        [e(1, ready=False), term(2, serving=False)],
        [],
        has_any=False,
    ),
    # Zone hints.
    Case(
        "zone-hints-used",
        CLUSTER,
        [e(1, zones="zone-a"), e(2, zones="zone-b"), e(3, zones="zone-a zone-b")],
        [1, 3],
    ),
    Case(
        "zone-hints-need-every-ready-endpoint",
        CLUSTER,
        [e(1, zones="zone-a"), e(2), e(3, zones="zone-b")],
        [1, 2, 3],
    ),
    Case(
        "zone-hints-only-ready-endpoints-count",
        CLUSTER,
        [e(1, zones="zone-a"), e(2, zones="zone-b"), term(3), e(4, ready=False)],
        [1],
    ),
    Case(
        "zone-hints-none-for-my-zone",
        CLUSTER,
        [e(1, zones="zone-b"), e(2, zones="zone-c")],
        [1, 2],
    ),
    Case(
        "zone-hints-node-without-zone",
        CLUSTER,
        [e(1, zones="zone-a"), e(2, zones="zone-b")],
        [1, 2],
        zone="",
    ),
    Case(
        "zone-hints-with-no-ready-endpoint-fall-back-without-topology",
        CLUSTER,
        [term(1, zones="zone-b"), term(2, zones="zone-a")],
        [1, 2],
    ),
    # Node hints (PreferSameNode).
    Case(
        "node-hints-used",
        CLUSTER,
        [e(1, nodes="node-1", zones="zone-a"), e(2, nodes="node-2", zones="zone-a")],
        [1],
    ),
    Case(
        "node-hints-win-over-zone-hints",
        CLUSTER,
        [e(1, nodes="node-2", zones="zone-a"), e(2, nodes="node-1", zones="zone-b")],
        [2],
    ),
    Case(
        "node-hints-missing-on-one-falls-back-to-zone",
        CLUSTER,
        [e(1, nodes="node-1", zones="zone-b"), e(2, zones="zone-a"), e(3, zones="zone-a")],
        [2, 3],
    ),
    Case(
        "node-hints-not-for-me-fall-back-to-zone",
        CLUSTER,
        [e(1, nodes="node-2", zones="zone-a"), e(2, nodes="node-3", zones="zone-b")],
        [1],
    ),
    Case(
        "node-hints-without-zone-hints",
        CLUSTER,
        [e(1, nodes="node-1"), e(2, nodes="node-2")],
        [1],
    ),
    Case(
        "node-hints-not-for-me-no-zone-hints",
        CLUSTER,
        [e(1, nodes="node-2"), e(2, nodes="node-3")],
        [1, 2],
    ),
    # Internal traffic policy Local (nothing external): local endpoints only.
    Case(
        "itp-local-ready", ITP_LOCAL, [e(1), e(2, local=True), e(3, local=True)], [], [2, 3], [2, 3]
    ),
    Case(
        "itp-local-none-local-but-some-elsewhere",
        ITP_LOCAL,
        [e(1), term(2)],
        [],
        [],
        [],
        has_any=True,
    ),
    Case(
        "itp-local-terminating-fallback",
        ITP_LOCAL,
        [e(1), term(2, local=True), term(3, local=True, serving=False)],
        [],
        [2],
        [2],
    ),
    Case(
        "itp-local-ready-beats-terminating",
        ITP_LOCAL,
        [e(1, local=True), term(2, local=True)],
        [],
        [1],
        [1],
    ),
    Case(
        "itp-local-nothing", ITP_LOCAL, [e(1, ready=False, local=True)], [], [], [], has_any=False
    ),
    Case(
        "itp-local-ignores-hints",
        ITP_LOCAL,
        [e(1, local=True, zones="zone-b"), e(2, zones="zone-a")],
        [],
        [1],
        [1],
    ),
    # External traffic policy Local: cluster endpoints for short-circuiting, plus local.
    Case(
        "etp-local-superset",
        ETP_LOCAL,
        [e(1), e(2, local=True), term(3, local=True)],
        [1, 2],
        [2],
        [1, 2],
    ),
    Case(
        "etp-local-local-terminating-fallback-merges",
        ETP_LOCAL,
        [e(1), term(2, local=True), e(3)],
        [1, 3],
        [2],
        [1, 2, 3],
    ),
    Case(
        "etp-local-topology-merges",
        ETP_LOCAL,
        [e(1, zones="zone-b"), e(2, local=True, zones="zone-b"), e(3, zones="zone-a")],
        [3],
        [2],
        [2, 3],
    ),
    Case(
        "etp-local-no-local",
        ETP_LOCAL,
        [e(1), e(2)],
        [1, 2],
        [],
        [1, 2],
    ),
    Case(
        "etp-local-everything-terminating",
        ETP_LOCAL,
        [term(1), term(2, local=True), term(3, serving=False)],
        [1, 2],
        [2],
        [1, 2],
    ),
    Case(
        "etp-local-but-not-externally-accessible-is-cluster",
        svc(etp_local=True),
        [e(1), e(2, local=True)],
        [1, 2],
    ),
    Case(
        "both-local-externally-accessible",
        BOTH_LOCAL,
        [e(1), e(2, local=True)],
        [1, 2],
        [2],
        [1, 2],
    ),
]


def octets(endpoints: Sequence[Endpoint]) -> list[int]:
    return [int(str(x.ip).rsplit(".", 1)[1]) for x in endpoints]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_categorize(case: Case) -> None:
    endpoints = tuple(sorted(case.endpoints, key=lambda x: x.key))
    result = categorize_endpoints(endpoints, case.service, case.node, case.zone)
    cluster = case.cluster or []
    reachable = cluster if case.reachable is None else case.reachable
    assert octets(result.cluster) == sorted(cluster, key=lambda o: f"10.0.0.{o}:80")
    assert octets(result.local) == sorted(case.local, key=lambda o: f"10.0.0.{o}:80")
    assert octets(result.all_reachable) == sorted(reachable, key=lambda o: f"10.0.0.{o}:80")
    assert result.has_any is case.has_any
    if not case.service.uses_local_endpoints:
        assert result.local == ()
    if not case.service.uses_cluster_endpoints:
        assert result.cluster == ()


def test_empty_is_the_empty_result() -> None:
    assert categorize_endpoints((), CLUSTER, NODE, ZONE) == CategorizedEndpoints()


def test_all_reachable_is_deduplicated_and_sorted_by_key() -> None:
    endpoints = tuple(
        sorted(
            (e(10, zones="zone-a"), e(2, local=True, zones="zone-a"), term(3, local=True)),
            key=lambda x: x.key,
        )
    )
    result = categorize_endpoints(endpoints, ETP_LOCAL, NODE, ZONE)
    assert [x.key for x in result.all_reachable] == ["10.0.0.10:80", "10.0.0.2:80"]
    assert len({x.key for x in result.all_reachable}) == len(result.all_reachable)


@pytest.mark.parametrize(
    ("endpoints", "mode"),
    [
        ([], TopologyMode.NONE),
        ([term(1, zones="zone-a")], TopologyMode.NONE),
        ([e(1, zones="zone-a")], TopologyMode.PREFER_SAME_ZONE),
        ([e(1, nodes="node-1")], TopologyMode.PREFER_SAME_NODE),
        ([e(1, nodes="node-1", zones="zone-a")], TopologyMode.PREFER_SAME_NODE),
        ([e(1, nodes="node-2", zones="zone-a")], TopologyMode.PREFER_SAME_ZONE),
        ([e(1, zones="zone-a"), e(2)], TopologyMode.NONE),
        ([e(1), e(2, zones="zone-a")], TopologyMode.NONE),
        ([e(1, nodes="node-1"), e(2, zones="zone-a")], TopologyMode.NONE),
    ],
)
def test_topology_mode(endpoints: list[Endpoint], mode: TopologyMode) -> None:
    assert topology_mode(endpoints, NODE, ZONE) is mode


def test_categorize_is_fast_enough() -> None:
    # 30k Services x 10 endpoints must categorize well under a second (here 3k, with a
    # generous bound for slow CI machines).
    plain = tuple(sorted((e(i, local=i == 3) for i in range(1, 11)), key=lambda x: x.key))
    hinted = tuple(
        sorted(
            (e(i, zones="zone-a" if i % 2 else "zone-b") for i in range(1, 11)),
            key=lambda x: x.key,
        )
    )
    work = [(plain, CLUSTER), (plain, ETP_LOCAL), (hinted, CLUSTER)] * 1000
    # The thread's CPU time (about 0.04 s here), not the wall clock, which grows with
    # whatever else the machine runs and would fail the test on a busy one.
    start = time.thread_time()
    for endpoints, service in work:
        categorize_endpoints(endpoints, service, NODE, ZONE)
    assert time.thread_time() - start < 0.5
