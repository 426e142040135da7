"""The whole-process comparison: ``kube-proxy-nftables --manifests DIR --once`` against
``nft -f`` of upstream's structure, each from start to exit in a fresh namespace.

:func:`write_manifests` writes a synthetic cluster as a directory the binary's manifests
source reads (:mod:`kubeproxy.sources.manifests`): the Services and the EndpointSlices as
``kind: List`` JSON files, exactly the dicts the in-process benchmarks feed, plus this
node's Node object (its InternalIP is the bench node IP, so ``nodePortAddresses: primary``
resolves as in the proxy child). :func:`binary_argv` is the command line, with the proxy
settings of :func:`bench.proxyproc.bench_config` given as flags: the ClusterCIDR
local-traffic detector for the pod CIDR, the service CIDR, ``nodePortAddresses: primary``.

The binary has no switch for the per-Service-chain structure; :func:`chain_binary_argv`
runs the same start-up (:func:`kubeproxy.cmd.binary.run` with ``kube-proxy-nftables``'s
:data:`~kubeproxy.cmd.nftables.BINARY`) with only the nftables mode's backend factory
replaced by :func:`bench.chain_structure.create_chain_backend`
(``python -m bench.wholeproc --chains ARGS``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import python_module
from bench.synthetic import (
    NODE_IP,
    NODE_NAME,
    POD_CIDR,
    SERVICE_CIDR,
    SyntheticService,
    all_slice_dicts,
)

__all__ = [
    "BINARY_NAME",
    "binary_argv",
    "binary_path",
    "chain_binary_argv",
    "main",
    "node_manifest",
    "per_port_affinity_argv",
    "pinned_affinity_argv",
    "proxy_flags",
    "settings_flags",
    "write_manifests",
]

BINARY_NAME = "kube-proxy-nftables"


def _write_list(path: Path, items: Iterable[dict[str, Any]]) -> int:
    """Write ``items`` as one ``kind: List`` JSON document; returns how many."""
    listed = list(items)
    document = {"apiVersion": "v1", "kind": "List", "items": listed}
    path.write_text(json.dumps(document, separators=(",", ":")))
    return len(listed)


def node_manifest() -> dict[str, Any]:
    """The Node the binary runs as (``--hostname-override``), with the bench node IP."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE_NAME},
        "status": {"addresses": [{"type": "InternalIP", "address": str(NODE_IP)}]},
    }


def write_manifests(directory: Path, services: Sequence[SyntheticService]) -> Path:
    """Write ``services`` (and their EndpointSlices, and the Node) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_list(directory / "services.json", (s.service_dict() for s in services))
    _write_list(directory / "endpointslices.json", all_slice_dicts(services))
    (directory / "node.json").write_text(json.dumps(node_manifest()))
    return directory


def proxy_flags(manifests: Path) -> list[str]:
    """The flags both binaries get: one sync of ``manifests`` with the bench's settings."""
    return ["--manifests", str(manifests), "--once", *settings_flags()]


def settings_flags(
    *,
    cluster_cidr: str = str(POD_CIDR),
    service_range: str = str(SERVICE_CIDR),
    node_port_addresses: str = "primary",
) -> list[str]:
    """The bench's proxy settings (:func:`bench.proxyproc.bench_config`) as flags (the
    soak, dual-stack, gives both families' ranges)."""
    return [
        "--hostname-override",
        NODE_NAME,
        "--detect-local-mode",
        "ClusterCIDR",
        "--cluster-cidr",
        cluster_cidr,
        "--service-cluster-ip-range",
        service_range,
        "--nodeport-addresses",
        node_port_addresses,
    ]


def binary_path(name: str = BINARY_NAME) -> Path:
    """The installed binary ``name`` next to this interpreter (the venv's bin)."""
    return Path(sys.executable).parent / name


def binary_argv(manifests: Path) -> list[str]:
    """``kube-proxy-nftables --manifests DIR --once ...``: the shipped binary."""
    return [str(binary_path()), *proxy_flags(manifests)]


def chain_binary_argv(manifests: Path) -> list[str]:
    """The same binary's start-up with the per-Service-chain backend (see the module)."""
    return python_module("bench.wholeproc", "--chains", *proxy_flags(manifests))


def per_port_affinity_argv(manifests: Path) -> list[str]:
    """The binary's start-up with the affinity maps per Service port (before issue 32)."""
    return python_module("bench.wholeproc", "--per-port-affinity", *proxy_flags(manifests))


def pinned_affinity_argv(manifests: Path) -> list[str]:
    """The binary's start-up with every affinity port's chains of its own (before the maps
    keyed by the frontend)."""
    return python_module("bench.wholeproc", "--pinned-affinity", *proxy_flags(manifests))


def pinned6_affinity_argv(manifests: Path) -> list[str]:
    """The binary's start-up with IPv6 affinity ports keyed by their pins (before the IPv6
    keys hashed from the frontend)."""
    return python_module("bench.wholeproc", "--pinned6-affinity", *proxy_flags(manifests))


def main(argv: Sequence[str] | None = None) -> int:
    """``--chains ARGS``: run ``kube-proxy-nftables`` with the per-Service-chain backend;
    ``--per-port-affinity ARGS``: with the affinity maps per Service port;
    ``--pinned-affinity ARGS``: with every affinity port's chains of its own;
    ``--pinned6-affinity ARGS``: with every IPv6 affinity port's chains of its own."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in (
        "--chains",
        "--per-port-affinity",
        "--pinned-affinity",
        "--pinned6-affinity",
    ):
        print(
            "usage: python -m bench.wholeproc --chains|--per-port-affinity|--pinned-affinity"
            "|--pinned6-affinity "
            "KUBE-PROXY-FLAGS...",
            file=sys.stderr,
        )
        return 2
    from kubeproxy.backend import BackendFactory
    from kubeproxy.cmd.binary import run
    from kubeproxy.cmd.modes import MODES
    from kubeproxy.cmd.nftables import BINARY

    def chain_factory() -> BackendFactory:
        if args[0] == "--per-port-affinity":
            from bench.subjects import per_port_affinity_backend

            return per_port_affinity_backend
        if args[0] == "--pinned-affinity":
            from bench.subjects import pinned_affinity_backend

            return pinned_affinity_backend
        if args[0] == "--pinned6-affinity":
            from bench.subjects import pinned6_affinity_backend

            return pinned6_affinity_backend
        from bench.chain_structure import create_chain_backend

        return create_chain_backend

    modes = {**MODES, "nftables": dataclasses.replace(MODES["nftables"], factory=chain_factory)}
    return run(BINARY, args[1:], modes=modes)


if __name__ == "__main__":
    sys.exit(main())
