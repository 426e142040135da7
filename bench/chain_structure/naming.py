"""The per-Service-chain structure's chain prefixes, and how it tells its own objects.

Its chains are named by :func:`kubeproxy.backends.nftables.table.chain_name` as
``<prefix>-<H>-<ns>/<svc>/<proto>/<port>``: every per-Service chain name contains ``/``
and no fixed chain does (:func:`is_service_chain`); its IPv6 affinity maps by
:func:`~kubeproxy.backends.nftables.table.affinity_map_name` (:func:`is_affinity_map`).
"""

from __future__ import annotations

from kubeproxy.backends.nftables.table import AFFINITY_MAP_PREFIX

__all__ = ["ChainPrefix", "is_affinity_map", "is_service_chain"]


class ChainPrefix:
    """The chain prefixes, one per role (see :mod:`bench.chain_structure.render`)."""

    SERVICE = "service"
    LOCAL = "local"
    EXTERNAL = "external"
    FIREWALL = "firewall"
    GROUP = "group"


def is_affinity_map(name: str) -> bool:
    """Whether ``name`` is a per-port affinity map (not the shared ``affinity`` map)."""
    return name.startswith(AFFINITY_MAP_PREFIX)


def is_service_chain(name: str) -> bool:
    """Whether ``name`` is a per-service chain (they all contain ``/``; fixed chains never)."""
    return "/" in name
