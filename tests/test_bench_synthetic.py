"""The benchmarks' lean synthetic input, the churn driver and the whole-process set-up,
over the in-memory nftables fake (no kernel)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

# bench/ is not part of the installed package: it imports from the repository root.
from bench import synthetic, wholeproc
from bench.chain_structure import create_chain_backend
from bench.proxyproc import BenchProxy, bench_config
from bench.synthetic import NODE_IP, NODE_NAME, build_services, endpoint_ips, synthetic_service
from kubeproxy.backends.nftables import NftablesBackend
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.inspect import served_frontends
from kubeproxy.backends.nftables.objects import Family
from kubeproxy.objects import IPFamily, NodeInfo
from kubeproxy.proxier import Proxier
from kubeproxy.sources.manifests import ManifestSource


def _proxier(min_sync_period: float = 0.0) -> Proxier:
    config = bench_config(min_sync_period)
    backend = NftablesBackend(IPFamily.IPV4, config, executor=FakeNft())
    node = NodeInfo(name=NODE_NAME, addresses=(NODE_IP,))
    return Proxier(IPFamily.IPV4, config, backend, node=node, host_addresses=lambda: [NODE_IP])


def test_endpoints_are_computed_not_stored() -> None:
    service = synthetic_service(7, 10, affinity_seconds=60)
    assert service.endpoints == endpoint_ips(7, 10)
    assert (service.namespace, service.name) == ("ns7", "svc-7")
    changed = service.with_endpoints(service.endpoints[:-1])
    assert changed.endpoints == endpoint_ips(7, 9) and changed.endpoint_count == 9
    assert changed.slice_dicts()[0]["endpoints"][-1]["addresses"] == [str(endpoint_ips(7, 9)[-1])]
    with pytest.raises(ValueError):
        synthetic_service(synthetic.MAX_SERVICES, 1)
    with pytest.raises(ValueError):
        synthetic_service(0, 4096)


def test_shared_parts_are_never_mutated_by_the_proxy() -> None:
    # The dicts share constant sub-objects (conditions, ports, ...) between every Service
    # and slice; that is only sound while the proxy never writes into what it is fed.
    services = [*build_services(20, 10), synthetic_service(40, 10, affinity_seconds=60)]
    service_dicts = [s.service_dict() for s in services]
    slice_dicts = [d for s in services for d in s.slice_dicts()]
    assert (
        slice_dicts[0]["endpoints"][0]["conditions"] is slice_dicts[1]["endpoints"][3]["conditions"]
    )
    assert service_dicts[0]["spec"]["ports"] is service_dicts[5]["spec"]["ports"]
    before = copy.deepcopy((service_dicts, slice_dicts))
    proxier = _proxier()
    for service in service_dicts:
        proxier.on_service_add(service)
    for slice_ in slice_dicts:
        proxier.on_endpoint_slice_add(slice_)
    proxier.on_services_synced()
    proxier.on_endpoint_slices_synced()
    assert proxier.sync_now()
    assert len(proxier.services) == 21
    moved = services[3].slice_dicts(services[3].endpoints[:-1], generation=2)
    proxier.on_endpoint_slice_update(slice_dicts[3], moved[0])
    proxier.on_service_delete(service_dicts[4])
    proxier.on_endpoint_slice_delete(slice_dicts[4])
    assert proxier.sync_now()
    assert (service_dicts, slice_dicts) == before
    fresh = synthetic_service(3, 10).slice_dicts()[0]
    assert fresh["endpoints"][0]["conditions"] == {
        "ready": True,
        "serving": True,
        "terminating": False,
    }


def test_churn_batches_changes_through_the_sync_loop() -> None:
    config = bench_config(min_sync_period=0.25)
    backend = NftablesBackend(IPFamily.IPV4, config, executor=FakeNft())
    proxy = BenchProxy(build_services(50, 10), backend, config=config)
    assert proxy.cold()["ok"]
    result = proxy.churn(seconds=1.0, rate=20.0, seed=3)
    assert result["ok"] and result["changes"] == 20
    # Rate-limited to one sync per 0.25 s: the 20 changes arrive in a few batches.
    assert 1 <= result["syncs"] <= 6
    assert result["full_syncs"] == 0 and result["failed_syncs"] == 0
    assert result["services_per_sync_median"] >= 1
    assert 0 < result["sync_p50_ms"] <= result["sync_p99_ms"] <= result["sync_max_ms"]
    assert result["wall_s"] >= 1.0 and result["cpu_s"] >= 0


FILES = ("services.json", "endpointslices.json")


def test_manifests_directory_holds_the_same_cluster(tmp_path: Path) -> None:
    services = build_services(20, 3)
    wholeproc.write_manifests(tmp_path, services)
    proxier = _proxier()
    source = ManifestSource(tmp_path, proxier, node_name=NODE_NAME)
    source.load()
    listed = {name: json.loads((tmp_path / name).read_text())["items"] for name in FILES}
    assert listed["services.json"][5] == services[5].service_dict()
    assert listed["endpointslices.json"][5] == services[5].slice_dicts()[0]
    objects = source.objects()
    assert {("Service", "ns5", "svc-5"), ("EndpointSlice", "ns5", "svc-5-00000")} <= set(objects)
    assert proxier.sync_now()
    assert len(proxier.services) == 20
    assert NODE_IP in proxier.node.addresses
    argv = wholeproc.binary_argv(tmp_path)
    assert Path(argv[0]).name == "kube-proxy-nftables" and "--once" in argv
    assert argv[argv.index("--manifests") + 1] == str(tmp_path)


def test_chain_binary_swaps_only_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import kubeproxy.cmd.binary
    from kubeproxy.cmd.modes import MODES
    from kubeproxy.cmd.nftables import BINARY

    seen: dict[str, Any] = {}

    def fake_run(binary: Any, argv: Any, *, modes: Any) -> int:
        seen.update(binary=binary, argv=argv, modes=modes)
        return 0

    monkeypatch.setattr(kubeproxy.cmd.binary, "run", fake_run)
    assert wholeproc.main(["--chains", "--once", "--manifests", "/x"]) == 0
    assert seen["binary"] is BINARY and seen["argv"] == ["--once", "--manifests", "/x"]
    swapped = seen["modes"]["nftables"]
    assert swapped.factory() is create_chain_backend
    assert swapped.cleanup is MODES["nftables"].cleanup
    assert swapped.hooks is MODES["nftables"].hooks
    assert {k: v for k, v in seen["modes"].items() if k != "nftables"} == {
        k: v for k, v in MODES.items() if k != "nftables"
    }
    assert wholeproc.main(["--maps"]) == 2


def test_exposed_services_are_reached_beyond_their_cluster_ip() -> None:
    """Every Service of the exposed mix has a NodePort, a load-balancer IP or an external
    IP, one in ten is IPv6, NodePorts are distinct and run out at 2700, and both
    families' Proxiers over the fake program every one of them, sticky."""
    services = synthetic.exposed_services(3000, 2, affinity_seconds=10800)
    dicts = [s.service_dict() for s in services]
    assert all(
        d["spec"].get("externalIPs") or d.get("status") or s.node_port
        for s, d in zip(services, dicts, strict=True)
    )
    assert sum(s.family == "IPv6" for s in services) == 300
    node_ports = [s.node_port for s in services if s.node_port]
    assert len(node_ports) == len(set(node_ports)) == 1500
    assert all(s.affinity_seconds == 10800 for s in services)

    config = bench_config()
    fakes = {f: FakeNft() for f in IPFamily}
    backends = {f: NftablesBackend(f, config, executor=fakes[f]) for f in IPFamily}
    first = services[:400]
    proxy = BenchProxy(first, backends[IPFamily.IPV4], backend6=backends[IPFamily.IPV6])
    assert proxy.cold()["ok"]
    tables = {IPFamily.IPV4: Family.IP, IPFamily.IPV6: Family.IP6}
    served = {f: served_frontends(fakes[f], tables[f]) for f in IPFamily}
    assert sum(len(k) == 3 for k in served[IPFamily.IPV4]) == sum(s.frontends4() for s in first)
    assert sum(len(k) == 3 for k in served[IPFamily.IPV6]) == 40 + sum(
        s.service_type == "LoadBalancer" for s in first if s.family == "IPv6"
    )
