"""Micro-benchmarks: the core's steps and the renderers in memory, with real statistics.

``bench/test_bench.py`` times whole syncs against the kernel, once each (a cold sync of
30k Services cannot be repeated a few dozen times). These are the pieces in between,
small enough for pytest-benchmark to run many rounds and report min/median/IQR: parsing
Services and EndpointSlices, the change trackers, endpoint categorisation, rendering a
port's iptables rules, repeated incremental syncs of the proxier over each backend's
in-memory fake (only public entry points: ``Proxier.sync_now`` over a backend's
``sync()``), and packing nftables elements for netlink (the shipped encoder next to the
one it replaced). No root, no kernel, no network namespace.

    make bench-micro            # compare against bench/results/micro-baseline.json;
                                # fails when a minimum is more than 20 % slower
    make bench-micro-baseline   # measure again and replace the baseline

The baseline is committed so a regression shows in one command; refresh it (and say so in
the commit) after a change that is meant to be slower or faster, on the same machine. The
check is on each benchmark's minimum, not its median: on this shared 2-core machine other
processes only ever add time, and two runs of the same code gave medians 34 % apart and
minimums within 2 %.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

from bench.previous_encoder import exec_element_encoder
from bench.synthetic import NODE_IP, NODE_NAME, SyntheticService, all_slice_dicts, build_services
from kubeproxy.backend import Backend
from kubeproxy.backends.iptables import IptablesBackend
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.rules import RenderContext, render_port
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.elements import _Codec
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.config import LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.endpointchanges import EndpointsChangeTracker, EndpointsMap
from kubeproxy.objects import IPFamily, NodeInfo
from kubeproxy.parse import parse_endpoint_slice, parse_service
from kubeproxy.proxier import Proxier
from kubeproxy.servicechanges import ServiceChangeTracker, ServicePortMap
from kubeproxy.topology import categorize_endpoints

V4 = IPFamily.IPV4
SERVICES = 1000
ENDPOINTS = 10
CLUSTER = build_services(SERVICES, ENDPOINTS)
SERVICE_DICTS = [service.service_dict() for service in CLUSTER]
SLICE_DICTS = list(all_slice_dicts(CLUSTER))
DETECTOR = LocalDetector(LocalDetectMode.CLUSTER_CIDR, (ipaddress.ip_network("10.128.0.0/9"),))
CONFIG = ProxierConfig(node_name=NODE_NAME, local_detector=DETECTOR)


def tracked() -> tuple[ServicePortMap, EndpointsMap]:
    """The 1k Services and their endpoints, through the trackers."""
    services, endpoints = ServiceChangeTracker(V4), EndpointsChangeTracker(V4, NODE_NAME)
    for obj in SERVICE_DICTS:
        services.update(None, obj)
    for obj in SLICE_DICTS:
        endpoints.update(obj, remove=False)
    service_map, endpoints_map = ServicePortMap(), EndpointsMap()
    service_map.apply(services)
    endpoints_map.apply(endpoints)
    return service_map, endpoints_map


# --- the core -----------------------------------------------------------------------------


def test_parse_services(benchmark: Any) -> None:
    ports = benchmark(lambda: [parse_service(obj, V4) for obj in SERVICE_DICTS])
    assert sum(len(p) for p in ports) == SERVICES


def test_parse_endpoint_slices(benchmark: Any) -> None:
    parsed = benchmark(lambda: [parse_endpoint_slice(obj, V4, NODE_NAME) for obj in SLICE_DICTS])
    assert all(p is not None for p in parsed) and len(parsed) == len(SLICE_DICTS)


def test_service_tracker_add_and_apply(benchmark: Any) -> None:
    def run() -> ServicePortMap:
        tracker, ports = ServiceChangeTracker(V4), ServicePortMap()
        for obj in SERVICE_DICTS:
            tracker.update(None, obj)
        ports.apply(tracker)
        return ports

    assert len(benchmark(run)) == SERVICES


def test_endpoint_tracker_add_and_apply(benchmark: Any) -> None:
    def run() -> EndpointsMap:
        tracker, endpoints = EndpointsChangeTracker(V4, NODE_NAME), EndpointsMap()
        for obj in SLICE_DICTS:
            tracker.update(obj, remove=False)
        endpoints.apply(tracker)
        return endpoints

    assert sum(len(eps) for eps in benchmark(run).values()) == SERVICES * ENDPOINTS


def test_categorize_endpoints(benchmark: Any) -> None:
    ports, endpoints = tracked()
    pairs = [(endpoints[name], port) for name, port in ports.items()]

    def run() -> int:
        return sum(
            len(categorize_endpoints(eps, port, NODE_NAME, "").cluster) for eps, port in pairs
        )

    assert benchmark(run) == SERVICES * ENDPOINTS


# --- the iptables renderer ----------------------------------------------------------------


def test_iptables_render_ports(benchmark: Any) -> None:
    ports, endpoints = tracked()
    context = RenderContext.build(V4, DETECTOR, masquerade_all=False)
    work = [
        (port, categorize_endpoints(endpoints[name], port, NODE_NAME, ""))
        for name, port in ports.items()
    ]
    rendered = benchmark(lambda: [render_port(context, port, eps) for port, eps in work])
    assert sum(len(r.chains) for r in rendered) == SERVICES * (ENDPOINTS + 1)


# --- repeated incremental syncs over the backends' fakes -----------------------------------


class _Cluster:
    """A proxier holding the 1k Services, synced once; :meth:`change` flips one endpoint
    of one Service (round after round, always a real change) and syncs."""

    def __init__(self, backend: Backend) -> None:
        node = NodeInfo(NODE_NAME, addresses=(ipaddress.ip_address(NODE_IP),))
        self.proxier = Proxier(V4, CONFIG, backend, node=node)
        for obj in SERVICE_DICTS:
            self.proxier.on_service_add(obj)
        for obj in SLICE_DICTS:
            self.proxier.on_endpoint_slice_add(obj)
        self.proxier.on_services_synced()
        self.proxier.on_endpoint_slices_synced()
        assert self.proxier.sync_now()
        self.round = 0

    def change(self) -> None:
        service: SyntheticService = CLUSTER[self.round % SERVICES]
        self.round += 1
        old = service.slice_dicts()[0]
        endpoints = list(service.endpoints)
        endpoints[0] = ipaddress.IPv4Address(int(endpoints[0]) + 16 * SERVICES)  # unused range
        new = service.slice_dicts(endpoints, generation=2)[0]
        self.proxier.on_endpoint_slice_update(old, new)
        assert self.proxier.sync_now()
        self.proxier.on_endpoint_slice_update(new, old)  # back, for the next rounds
        assert self.proxier.sync_now()


def _incremental(benchmark: Any, backend: Backend, sent: Callable[[], int]) -> None:
    """``sent()``: how many transactions (restores) the backend's fake has received."""
    cluster = _Cluster(backend)
    before = sent()
    benchmark.pedantic(cluster.change, rounds=40, warmup_rounds=3)
    # Every round's two syncs were partial ones that reached the fake.
    assert cluster.round >= 1 and sent() - before >= 2 * cluster.round


def test_incremental_syncs_nftables_fake(benchmark: Any) -> None:
    """Two partial syncs (an endpoint replaced, then put back) through ``sync()``."""
    fake = FakeNft()
    backend = NftablesBackend(V4, CONFIG, executor=fake)
    _incremental(benchmark, backend, lambda: len(fake.transactions))


def test_incremental_syncs_iptables_fake(benchmark: Any) -> None:
    """The same over the iptables renderer and its in-memory iptables-restore."""
    fake = FakeIptables()
    backend = IptablesBackend(V4, CONFIG, executor=fake)
    _incremental(benchmark, backend, lambda: len(fake.restores))


# --- nftables elements on the wire ----------------------------------------------------------

_SLOTS = (("ipv4_addr", "inet_proto", "inet_service", "integer"), ("ipv4_addr", "inet_service"))
_ELEMENTS = [
    (
        (f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", "tcp", str(80 + i % 50), str(i % 7)),
        (f"172.16.{i >> 8 & 255}.{i & 255}", str(8080 + i % 3)),
    )
    for i in range(10_000)
]


def _encode(benchmark: Any, element: Callable[[tuple[str, ...], tuple[str, ...]], bytes]) -> None:
    packed = benchmark(lambda: [element(key, value) for key, value in _ELEMENTS])
    shipped = _Codec(*_SLOTS).element
    assert packed == [shipped(key, value) for key, value in _ELEMENTS]


def test_encode_elements(benchmark: Any) -> None:
    """10k elements of the slots map (4 key parts, 2 value parts) packed for netlink by
    the shipped encoder (closures mypy checks)."""
    _encode(benchmark, _Codec(*_SLOTS).element)


def test_encode_elements_exec(benchmark: Any) -> None:
    """The same by the encoder it replaced (``exec``-generated source,
    :mod:`bench.previous_encoder`), measured in the same run."""
    _encode(benchmark, exec_element_encoder(*_SLOTS))
