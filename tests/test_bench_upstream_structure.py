"""The benchmark's generator of upstream's nftables structure, and the synthetic cluster."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from ipaddress import IPv4Address
from pathlib import Path

import pytest

# bench/ is not part of the installed package: it imports from the repository root.
from bench.synthetic import build_services, endpoint_ips, service_ip
from bench.upstream_structure import (
    endpoint_chain_base,
    hash_and_truncate,
    service_chain_base,
    upstream_ruleset,
    write_upstream_ruleset,
)


def test_chain_names_match_upstreams_examples() -> None:
    # Examples from the reference notes (section 1.5), checked against upstream's tests.
    assert hash_and_truncate("ns1/svc1/tcp/p80") == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert (
        hash_and_truncate("ns1/svc1/tcp/p80__10.180.0.1/80")
        == "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    )
    long = hash_and_truncate("n/" + "s" * 300)
    assert len(long) == 240 and long.endswith("...")


def test_synthetic_addresses_do_not_overlap() -> None:
    services = build_services(3, 10)
    assert [s.cluster_ip for s in services] == [service_ip(i) for i in range(3)]
    every = [ip for s in services for ip in s.endpoints]
    assert len(set(every)) == 30
    assert set(endpoint_ips(5, 1000)).isdisjoint(every)
    assert services[1].service_dict()["spec"]["clusterIP"] == str(services[1].cluster_ip)
    slices = services[1].slice_dicts()
    assert len(slices) == 1 and len(slices[0]["endpoints"]) == 10
    assert len(build_services(1, 1)[0].slice_dicts(endpoint_ips(0, 250))) == 3


def test_service_dispatch_and_endpoint_chains() -> None:
    (service,) = build_services(1, 3)
    text = "\n".join(upstream_ruleset([service]))
    base = service_chain_base(service)
    # Endpoints in upstream's order: sorted by their "IP:port" string.
    ordered = sorted(service.endpoints, key=lambda ip: f"{ip}:{service.target_port}")
    vmap = " , ".join(
        f"{k} : goto endpoint-{endpoint_chain_base(service, ip)}" for k, ip in enumerate(ordered)
    )
    assert f"add rule ip kube-proxy service-{base} numgen random mod 3 vmap {{ {vmap} }}" in text
    first = endpoint_chain_base(service, ordered[0])
    assert (
        f"add rule ip kube-proxy endpoint-{first} meta l4proto tcp dnat to {ordered[0]}:8080"
    ) in text
    assert (
        f"add element ip kube-proxy service-ips {{ {service.cluster_ip} . tcp . 80 : "
        f"goto service-{base} }}"
    ) in text
    assert "affinity-" not in text


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpxb-ut-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


def _nft(netns: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nft", *args], capture_output=True, text=True, check=False
    )


@pytest.mark.kernel
@pytest.mark.parametrize("affinity_seconds", [0, 10800])
def test_two_services_load_with_nft(netns: str, tmp_path: Path, affinity_seconds: int) -> None:
    services = build_services(2, 3, affinity_seconds=affinity_seconds)
    ruleset = tmp_path / "upstream.nft"
    write_upstream_ruleset(ruleset, services)
    loaded = _nft(netns, "-f", str(ruleset))
    assert loaded.returncode == 0, loaded.stderr
    listing = _nft(netns, "list", "table", "ip", "kube-proxy")
    assert listing.returncode == 0, listing.stderr
    # Per-service chains are the ones with a '/' in their name.
    chains = [
        line.split()[1]
        for line in listing.stdout.splitlines()
        if "\tchain " in line and "/" in line
    ]
    assert sum(c.startswith("service-") for c in chains) == 2
    assert sum(c.startswith("endpoint-") for c in chains) == 6
    sets = [line.split()[1] for line in listing.stdout.splitlines() if "\tset affinity-" in line]
    assert len(sets) == (6 if affinity_seconds else 0)
    assert "10.96.0.1 . tcp . 80 : goto service-" in listing.stdout
    assert str(IPv4Address("10.96.0.2")) in listing.stdout
