"""What the benchmarks compare: our proxy over each backend, and upstream's nftables structure.

A :class:`Subject` names a record's ``subject`` field, the backend the child process
runs (:func:`bench.harness.proxy_process`'s ``backend``: an entry-point name,
``module:function``, or :data:`bench.harness.UPSTREAM_BACKEND`), how to check that its
rules are installed, and how plots label it. Adding a backend is one more entry in
:data:`SUBJECTS` (and its sizes in the benchmark module).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from dataclasses import dataclass

from bench.harness import UPSTREAM_BACKEND
from bench.netns import in_netns
from kubeproxy.backend import Backend
from kubeproxy.backends.nftables import NftablesBackend, create_backend
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.layout import (
    AFFINITY_PER_PORT,
    AFFINITY_PINNED,
    AFFINITY_SHARED_IPV4,
    Dispatch,
)
from kubeproxy.backends.nftables.localhost import LocalhostNodePortsBackend
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily

__all__ = [
    "IPTABLES_LEGACY",
    "IPTABLES_NFT",
    "NFTABLES",
    "NFTABLES_AFFINITY_MAPS",
    "NFTABLES_AFFINITY_PINNED",
    "NFTABLES_AFFINITY_PINNED6",
    "NFTABLES_CHAINS",
    "NFTABLES_RULES",
    "SUBJECTS",
    "UPSTREAM",
    "Subject",
    "installed_services",
]


@dataclass(frozen=True, slots=True)
class Subject:
    """One side of a comparison.

    ``rules`` says where its Service dispatch lives: ``nft`` (the ``service-ips`` map of
    ``table ip kube-proxy``: the per-Service-chain structure and upstream's),
    ``nft-maps`` (the frontend class sets of the map structure's newest generation, read
    with :func:`kubeproxy.backends.nftables.inspect.served_frontends`), or
    ``iptables-nft`` / ``iptables-legacy`` (the nat ``KUBE-SERVICES`` chain, read with
    that variant's tool).
    """

    name: str
    backend: str
    label: str
    rules: str
    module: str | None = None  # the Python module it needs (None: always there)

    def available(self) -> bool:
        """Whether this checkout has what the subject runs."""
        return self.module is None or importlib.util.find_spec(self.module) is not None


NFTABLES = Subject("kubeproxy-nftables", "nftables", "ours: nftables (maps)", "nft-maps")
"""The nftables backend as shipped (the ``nftables`` entry point): the map structure."""
NFTABLES_CHAINS = Subject(
    "kubeproxy-nftables-chains",
    "bench.chain_structure:create_chain_backend",
    "ours: nftables, per-Service chains (before)",
    "nft",
)
"""The previous nftables structure (a chain per Service port, :mod:`bench.chain_structure`),
measured next to it."""
NFTABLES_RULES = Subject(
    "kubeproxy-nftables-rules",
    "bench.subjects:rules_dispatch_backend",
    "ours: nftables (maps), one rule per class (before)",
    "nft-maps",
)
"""The map structure with the class dispatch before issue 19 (one rule per class)."""
NFTABLES_PRECREATED = Subject(
    "kubeproxy-nftables-precreated",
    "bench.subjects:precreated_backend",
    "ours: nftables (maps), classes of counts 1-1024 precreated",
    "nft-maps",
)
"""The map structure with every count's class precreated (issue 32 item 4)."""
NFTABLES_AFFINITY_MAPS = Subject(
    "kubeproxy-nftables-affinity-maps",
    "bench.subjects:per_port_affinity_backend",
    "ours: nftables (maps), an affinity map per Service port (before)",
    "nft-maps",
)
"""The map structure with ClientIP affinity in maps of each port's own (before issue 32),
over the same executor as the shipped one (the owned table where the kernel has it)."""
NFTABLES_AFFINITY_PINNED = Subject(
    "kubeproxy-nftables-affinity-pinned",
    "bench.subjects:pinned_affinity_backend",
    "ours: nftables (maps), shared affinity maps, a lookup and a record chain per port (before)",
    "nft-maps",
)
"""The map structure with every ClientIP port's entries keyed by its pins in the shared
maps, with a lookup and a record chain of its own (issue 32, before the maps keyed by the
frontend)."""
NFTABLES_AFFINITY_PINNED6 = Subject(
    "kubeproxy-nftables-affinity-pinned6",
    "bench.subjects:pinned6_affinity_backend",
    "ours: nftables (maps), shared affinity maps, IPv6 ports with their own chains (before)",
    "nft-maps",
)
"""The map structure with IPv4 ports' entries keyed by their cluster-IP frontend and IPv6
ports' by their pins, each IPv6 port with a lookup and a record chain of its own (before
the IPv6 keys hashed from the frontend)."""
IPTABLES_NFT = Subject(
    "kubeproxy-iptables-nft",
    # The node's variant, detected as upstream's iptables-wrapper does: nft in a fresh
    # namespace (the default of this node's iptables, v1.8.9 nf_tables).
    "kubeproxy.backends.iptables:create_backend",
    "ours: iptables (iptables-nft)",
    "iptables-nft",
    module="kubeproxy.backends.iptables",
)
IPTABLES_LEGACY = Subject(
    "kubeproxy-iptables-legacy",
    "kubeproxy.backends.iptables:create_legacy_backend",
    "ours: iptables (iptables-legacy)",
    "iptables-legacy",
    module="kubeproxy.backends.iptables",
)
UPSTREAM = Subject(
    "upstream-nft", UPSTREAM_BACKEND, "upstream's nftables structure (nft -f)", "nft"
)

SUBJECTS = (
    NFTABLES,
    NFTABLES_RULES,
    NFTABLES_AFFINITY_MAPS,
    NFTABLES_AFFINITY_PINNED,
    NFTABLES_AFFINITY_PINNED6,
    NFTABLES_CHAINS,
    IPTABLES_NFT,
    IPTABLES_LEGACY,
    UPSTREAM,
)


def _nft_map_size(netns: str, name: str) -> int:
    result = subprocess.run(
        in_netns(netns, ["nft", "-j", "list", "map", "ip", "kube-proxy", name]),
        capture_output=True,
        text=True,
        check=True,
    )
    for entry in json.loads(result.stdout)["nftables"]:
        if "map" in entry:
            return len(entry["map"].get("elem", []))
    raise AssertionError(f"no map {name} in the listing")


def _iptables_service_jumps(netns: str, variant: str) -> int:
    result = subprocess.run(
        in_netns(netns, [f"iptables-{variant}", "-w", "-t", "nat", "-S", "KUBE-SERVICES"]),
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(" -j KUBE-SVC-" in line for line in result.stdout.splitlines())


def _map_structure_frontends(netns: str) -> int:
    """Service-IP frontends (``(ip, proto, port)``; NodePorts left out) the map structure
    dispatches in ``netns``."""
    from kubeproxy.backends.nftables.exec import LibNftables
    from kubeproxy.backends.nftables.inspect import served_frontends
    from kubeproxy.backends.nftables.objects import Family

    with LibNftables(netns=netns) as executor:
        return sum(len(key) == 3 for key in served_frontends(executor, Family.IP))


def installed_services(subject: Subject, netns: str) -> int:
    """How many Service ports the kernel in ``netns`` dispatches: proof of a commit."""
    if subject.rules == "nft":
        return _nft_map_size(netns, "service-ips")
    if subject.rules == "nft-maps":
        return _map_structure_frontends(netns)
    return _iptables_service_jumps(netns, subject.rules.removeprefix("iptables-"))


def rules_dispatch_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend:
    """The map structure with the class dispatch before issue 19: one rule per class,
    walked in order by every new connection (the ``nftables-rules`` subject)."""
    return NftablesBackend(
        family, config, executor=LibNftables(netns=netns), dispatch=Dispatch.RULES
    )


PRECREATE_BOUND = 1024
"""Endpoint counts the ``nftables-precreated`` subject's generations hold from the start."""


def precreated_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> Backend:
    """The nftables backend as shipped, its generations precreating the classes of every
    endpoint count up to :data:`PRECREATE_BOUND` (issue 32 item 4)."""
    return create_backend(family, config, netns=netns, precreate_counts=PRECREATE_BOUND)


def per_port_affinity_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend | LocalhostNodePortsBackend:
    """The shipped backend with ClientIP affinity in maps of each Service port's own (the
    structure before issue 32; the ``nftables-affinity-maps`` subject)."""
    return create_backend(family, config, netns=netns, affinity=AFFINITY_PER_PORT)


def pinned_affinity_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend | LocalhostNodePortsBackend:
    """The shipped backend with every ClientIP port's entries keyed by its pins, each port
    with chains of its own (the structure before the maps keyed by the frontend; the
    ``nftables-affinity-pinned`` subject)."""
    return create_backend(family, config, netns=netns, affinity=AFFINITY_PINNED)


def pinned6_affinity_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> NftablesBackend | LocalhostNodePortsBackend:
    """The shipped backend with IPv6 ClientIP ports keyed by their pins, each with chains
    of its own (the structure before the IPv6 keys hashed from the frontend; the
    ``nftables-affinity-pinned6`` subject)."""
    return create_backend(family, config, netns=netns, affinity=AFFINITY_SHARED_IPV4)
