"""The per-Service-chain nftables structure: the previous default, kept as a bench subject.

Until issue 11 the nftables backend wrote a chain per Service port (and per role:
``service-``, ``local-``, ``external-``, ``firewall-``, ``group-``), dispatched by
upstream's ``service-ips`` and ``service-nodeports`` verdict maps. The map structure
(:mod:`kubeproxy.backends.nftables`) replaced it; this one stays here, next to
:mod:`bench.upstream_structure`, so ``make bench`` measures the shipped structure next to
the one it replaced in the same run (the ``kubeproxy-nftables-chains`` subject,
"nftables (chains, before)", :data:`bench.subjects.NFTABLES_CHAINS`).

* :mod:`.fixed`: the fixed chains, sets and maps of its table;
* :mod:`.render`: the chains and elements of one Service port;
* :mod:`.naming`: its chain prefixes, and how it tells its own chains and maps;
* :mod:`.backend`: :class:`ChainNftablesBackend`, full and incremental syncs.

What both structures write with (the table's name, upstream's names and base chains, the
render context, keys, content-hashed chain names) is
:mod:`kubeproxy.backends.nftables.table`. The map structure's upgrade tests do not run
this code: they load ``tests/data/chain-structure-ruleset.nft``, recorded from it once
(``tests/chain_ruleset.py`` says how, and re-records it).
"""

from __future__ import annotations

from bench.chain_structure.backend import ChainNftablesBackend
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily

__all__ = ["ChainNftablesBackend", "create_chain_backend"]


def create_chain_backend(
    family: IPFamily, config: ProxierConfig, *, netns: str | None = None
) -> ChainNftablesBackend:
    """The per-Service-chain structure writing through libnftables (in ``netns`` if given),
    for comparisons (a :class:`~kubeproxy.backend.BackendFactory`)."""
    from kubeproxy.backends.nftables.exec import LibNftables

    return ChainNftablesBackend(family, config, executor=LibNftables(netns=netns))
