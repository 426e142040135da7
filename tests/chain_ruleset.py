"""A table of the per-Service-chain structure, recorded, for the map structure's upgrade tests.

An upgrade in place starts from a table the previous structure wrote (the default until
issue 11, now ``bench/chain_structure``, a benchmark subject). The upgrade tests
(``tests/test_nft_backend.py`` on the fake, ``tests/test_nft_kernel.py`` in a namespace)
load :data:`RECORDING` instead of running that structure, so they test the same takeover
whatever becomes of its code.

The recording is the chain structure's first full sync of :func:`cluster` on a
:class:`~kubeproxy.backends.nftables.fake.FakeNft`, dumped: ``nft -f`` text that both the
fake and ``nft`` load. Recorded, and re-recorded, with

    .venv/bin/python -m tests.chain_ruleset

(:func:`main`); ``tests/test_bench_chain_backend.py`` checks that it is still what the
structure writes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import sys
from pathlib import Path

from kubeproxy.backend import ProxySnapshot, SyncChanges
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import CategorizedEndpoints, IPFamily, Protocol, ServicePort
from tests.kernelkit import echo_snapshot
from tests.snapshots import ep, spn

RECORDING = Path(__file__).resolve().parent / "data" / "chain-structure-ruleset.nft"
PREFIX = "kpxr"
"""The kernel tests' prefix: the node is ``kpxr-node``, the echo Service ``kpxr/echo``."""
CONFIG = ProxierConfig(node_name=f"{PREFIX}-node")
BULK = 20
"""Services besides the echo Service and the two below (three endpoints each)."""

_HEADER = """\
# The per-Service-chain structure's table (bench/chain_structure) after its first full sync
# of tests/chain_ruleset.py's cluster(): the echo Service of the kernel tests, 20 others,
# one with ClientIP affinity and a NodePort, one with a load-balancer IP and source ranges.
# Recorded by `.venv/bin/python -m tests.chain_ruleset`
# (FakeNft's dump); the map structure's upgrade tests start from it. Do not edit by hand.
"""


def cluster() -> ProxySnapshot:
    """The recorded cluster (IPv4): :func:`~tests.kernelkit.echo_snapshot` with
    :data:`BULK` others, plus ``upgrade/affinity`` (ClientIP affinity, NodePort 30080, two
    endpoints) and ``upgrade/lb`` (load-balancer IP 5.6.7.8 with source ranges)."""
    base = echo_snapshot(PREFIX, BULK)
    ip = ipaddress.ip_address
    affinity = ServicePort(
        spn("affinity", ns="upgrade"),
        ip("172.30.0.11"),
        80,
        Protocol.TCP,
        node_port=30080,
        session_affinity_seconds=60,
    )
    lb = ServicePort(
        spn("lb", ns="upgrade"),
        ip("172.30.0.20"),
        443,
        Protocol.TCP,
        load_balancer_vips=(ip("5.6.7.8"),),
        load_balancer_source_ranges=(ipaddress.ip_network("203.0.113.0/24"),),
    )
    extra = {
        affinity: (ep("10.180.0.1"), ep("10.180.0.2")),
        lb: (ep("10.180.0.9", 8443),),
    }
    services = dict(base.services)
    endpoints = dict(base.endpoints)
    categorized = dict(base.categorized)
    for port, eps in extra.items():
        services[port.name] = port
        endpoints[port.name] = eps
        categorized[port.name] = CategorizedEndpoints(eps, (), eps, True)
    return dataclasses.replace(
        base, services=services, endpoints=endpoints, categorized=categorized
    )


def recorded() -> str:
    """The recording's text (``nft -f`` commands after a comment header)."""
    return RECORDING.read_text()


def record() -> str:
    """What the chain structure writes for :func:`cluster` now, as :data:`RECORDING` holds
    it (imports the structure from ``bench``, which the upgrade tests never do)."""
    from bench.chain_structure import ChainNftablesBackend
    from kubeproxy.backends.nftables.fake import FakeNft

    fake = FakeNft()
    backend = ChainNftablesBackend(IPFamily.IPV4, CONFIG, executor=fake, support_check=False)
    backend.sync(cluster(), SyncChanges(full=True))
    return _HEADER + fake.dump()


def main() -> None:
    """Write :data:`RECORDING` afresh."""
    RECORDING.parent.mkdir(exist_ok=True)
    RECORDING.write_text(record())
    print(f"wrote {RECORDING}", file=sys.stderr)


if __name__ == "__main__":
    main()
