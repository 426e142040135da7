"""One change costs the same work at 1k and at 30k Services (issue 20).

The whole daemon as a node runs it (:func:`kubeproxy.daemon.build_daemon`: the source,
the trackers, the snapshot, the nftables backend, and every observer and hook: metrics,
health checks, conntrack, self-healing, the collector's tuner), in memory: the kernel is
an executor that takes every transaction and keeps nothing (what the kernel does with a
transaction is the kernel's work, not the proxy's). A cluster of N ClusterIP Services
plus one LoadBalancer Service with ``externalTrafficPolicy: Local`` (a health-check
listener on 127.0.0.1) and UDP ports (a conntrack reconciliation over a few flows) takes
one endpoint change of that Service, through each source (a file of the manifests
directory rewritten and polled; an EndpointSlice watch event from the API server), and
one sync. :func:`kubeproxy.testing.workcount.count_work` counts the bytecode, calls and
peak memory of that; at 30k Services it must stay within a few percent of 1k's.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kubeproxy.backends.nftables.backend import NftablesBackend
from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.config import ProxierConfig
from kubeproxy.configfile.model import defaults
from kubeproxy.conntrack import FakeConntrack, Flow
from kubeproxy.daemon import Daemon, DaemonOptions, DaemonSeams, LoggingEventSink, build_daemon
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.objects import IPFamily
from kubeproxy.sources.kubernetes import KubernetesSource
from kubeproxy.sources.manifests import ManifestSource
from kubeproxy.testing.fakeapi import FakeAPIServer, endpoint_slice, node, service
from kubeproxy.testing.workcount import Work, count_work
from tests.gcops import UNTOUCHED

NODE = "cost-node"
ip = ipaddress.ip_address
SMALL, LARGE = 1_000, 30_000
# What may differ between the sizes: dicts and sets of another size class probe a
# different number of slots, the collector runs at other moments. A loop over every
# Service would be 30 times the work.
RATIO, SLACK = 1.05, 200
# tracemalloc's peak counts every thread: through the API, the watch threads (a bookmark
# the fake server sends, a read buffer of the reflector's) may allocate inside the
# measured window. 17 against 33 KB was seen once on a loaded machine, the same opcodes
# and calls; a change whose memory grew with the cluster would be hundreds of KB at 30k.
API_BACKGROUND_BYTES = 64 * 1024


class NullNft(FakeNft):
    """An nftables executor that takes every transaction and keeps nothing (the fake's
    listings of an empty kernel otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def run(self, tx: Transaction) -> None:
        if tx.error is not None:
            raise tx.error
        self.taken += 1

    def write_elements(self, batch: ElementBatch) -> None:
        self.taken += 1


def null_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend:
    return NftablesBackend(family, config, executor=NullNft())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cluster_services(count: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``count`` ClusterIP Services with 10 endpoints each on other nodes."""
    for index in range(count):
        name = f"svc-{index}"
        ip = f"10.96.{index // 250}.{index % 250 + 1}"
        addresses = [
            f"10.{200 + index // 6250}.{index // 25 % 250}.{10 * (index % 25) + k}"
            for k in range(10)
        ]
        yield (
            service(name, "ns", cluster_ip=ip),
            endpoint_slice(f"{name}-1", name, "ns", addresses=addresses, node_name="other"),
        )


HCNP = free_port()


def changing(ready: bool) -> list[dict[str, Any]]:
    """The LoadBalancer Service that changes, and its slice (one endpoint here)."""
    lb = service(
        "lb",
        "edge",
        cluster_ip="10.95.0.10",
        ports=[("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=HCNP,
    )
    for number, port in enumerate(lb["spec"]["ports"]):
        port["nodePort"] = 30053 + number
    lb_slice = endpoint_slice(
        "lb-1",
        "lb",
        "edge",
        addresses=["10.250.0.1", "10.250.0.2"],
        ports=[("dns", 5353, "UDP"), ("dns-tcp", 5353, "TCP")],
        node_name=NODE,
    )
    lb_slice["endpoints"][1]["conditions"] = {"ready": ready, "serving": ready}
    return [lb, lb_slice]


def write_list(path: Path, items: Sequence[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}))


def cluster_objects(count: int) -> list[dict[str, Any]]:
    """The N Services and their slices, this node's Node, and the changing Service."""
    objects: list[dict[str, Any]] = [node(NODE, addresses=["192.0.2.10"], pod_cidrs=[])]
    for pair in cluster_services(count):
        objects.extend(pair)
    return [*objects, *changing(True)]


GC_UNTOUCHED = UNTOUCHED


def built(*, manifests: Path | None = None, api: FakeAPIServer | None = None) -> Daemon:
    """The daemon over the cluster of a manifests directory or of the fake API server;
    health checks on 127.0.0.1 (``nodePortAddresses``), no kernel."""
    configuration = dataclasses.replace(
        defaults(),
        hostname_override=NODE,
        node_port_addresses=("127.0.0.1/32",),
        cluster_cidr="10.200.0.0/13",
    )
    options = DaemonOptions.from_configuration(
        configuration,
        mode="nftables",
        manifests=manifests,
        master=api.url if api is not None else "",
    )
    # Three UDP flows to the changing Service, answered by the endpoint that flips.
    conntrack = FakeConntrack(
        Flow(ip(f"10.1.0.{k}"), 40000 + k, ip("10.95.0.10"), 53, ip("10.250.0.2"), 5353)
        for k in range(1, 4)
    )
    return build_daemon(
        options,
        null_backend,
        seams=DaemonSeams(
            api=api.api_client() if api is not None else None,
            host_addresses=FakeHostAddresses([ip("127.0.0.1"), ip("192.0.2.10")]),
            conntrack=conntrack,
            ipv6_supported=False,
            gc_ops=GC_UNTOUCHED,
            events=LoggingEventSink(NODE),
            privileged=False,
        ),
    )


def measured(daemon: Daemon, deliver: Callable[[dict[str, Any]], None]) -> Work:
    """The first sync, then the work of one endpoint change: delivered, then synced."""
    assert daemon.sync_once(timeout=300)
    turn = [True]

    def change() -> None:
        turn[0] = not turn[0]
        deliver(changing(turn[0])[1])
        assert daemon.handler.sync_now()

    change()  # warm: first-time paths (imports, caches) are not the change's cost
    change()
    _, work = count_work(change)
    return work


def manifests_change_cost(tmp_path: Path, count: int) -> Work:
    """Through the manifests source: the changing Service's file rewritten, polled."""
    directory = tmp_path / f"manifests-{count}"
    directory.mkdir()
    objects = cluster_objects(count)
    write_list(directory / "cluster.json", objects[:-2])
    write_list(directory / "lb.json", objects[-2:])
    daemon = built(manifests=directory)
    source = daemon.source
    assert isinstance(source, ManifestSource)

    def deliver(slice_: dict[str, Any]) -> None:
        write_list(directory / "lb.json", [objects[-2], slice_])
        assert source.poll()

    try:
        return measured(daemon, deliver)
    finally:
        daemon.stop()


def api_change_cost(tmp_path: Path, count: int) -> Work:
    """Through the Kubernetes source: one watch event, as the reflector reads it."""
    with FakeAPIServer() as fake:
        for obj in cluster_objects(count):
            fake.apply(obj, copy=False)
        daemon = built(api=fake)
        source = daemon.source
        assert isinstance(source, KubernetesSource)
        versions = iter(range(10**9, 2 * 10**9))

        def deliver(slice_: dict[str, Any]) -> None:
            slice_["metadata"]["resourceVersion"] = str(next(versions))
            event = {"type": "MODIFIED", "object": slice_}
            source._endpoint_slices._event(json.dumps(event).encode())

        try:
            return measured(daemon, deliver)
        finally:
            daemon.stop()


@pytest.mark.parametrize("path", ["manifests", "api"])
def test_one_change_costs_the_same_at_1k_and_30k(tmp_path: Path, path: str) -> None:
    measure = manifests_change_cost if path == "manifests" else api_change_cost
    small = measure(tmp_path, SMALL)
    large = measure(tmp_path, LARGE)
    allowed = small
    if path == "api":
        allowed = dataclasses.replace(small, peak_bytes=small.peak_bytes + API_BACKGROUND_BYTES)
    assert large.within(allowed, RATIO, SLACK), f"1k: {small}; 30k: {large}"
