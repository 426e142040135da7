"""Removing iptables-nft chains of kube-proxy's as one nf_tables transaction.

iptables-nft keeps iptables' tables as nf_tables tables (``ip nat``, ``ip6 filter``...)
and their chains as ordinary nf_tables chains, rules as rules. ``iptables-nft-restore``
reads the whole table into its cache before it changes anything, and its cost grows with
the square of the chains a restore touches (this package's README): removing upstream's
iptables-mode chains of a 10k-Service node with it (110k chains, 320k rules) had not
finished after ten minutes here, while our nftables rules already served and upstream's
chains sat beside them. :func:`remove_ours` sends the same removal as netlink batches
(the jumps into our chains from the built-in chains, by handle, then our chains flushed
and deleted, those that jump or go to others before their targets); nothing is read
through iptables: the chains come from a netlink dump of the family's chains, the jumps
from a dump of each built-in chain's rules (the kernel filters those by table and
chain).

Batches of at most :data:`CHAINS_PER_BATCH` chains, a pause between two: every rule and
chain deleted is an nf_tables event to each listener, ours among them (the self-healing
watcher), and one batch of 330k chains and a million rules (30k Services) overflowed its
32 MB socket buffer: it lost events, asked for a full sync and answered ``/healthz`` 503
until that was done, for nothing.

Only iptables-nft: iptables-legacy's tables are x_tables blobs, which only its tools
write (and whose cost follows the table's size, not its square).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Final

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.iptables.restore import BUILTIN_CHAINS
from kubeproxy.host.netns import run_in_netns
from kubeproxy.objects import IPFamily

__all__ = ["OneBatchRefused", "jump_targets", "remove_ours"]


class OneBatchRefused(OSError):
    """The kernel refused the one-batch removal of a table's chains; nothing of it
    happened (a chain of ours is still referenced, say by ipvs mode's chains, which
    another cleanup removes)."""


_NFT_MSG_GETCHAIN: Final = 4
_NFT_MSG_GETRULE: Final = 7
_NFTA_TABLE: Final = 1  # NFTA_CHAIN_TABLE, NFTA_RULE_TABLE
_NFTA_CHAIN_NAME: Final = 3
_NFTA_RULE_CHAIN: Final = 2
_NFTA_RULE_HANDLE: Final = 3
_NFTA_RULE_EXPRESSIONS: Final = 4
_NFTA_LIST_ELEM: Final = 1
_NFTA_EXPR_NAME: Final = 1
_NFTA_EXPR_DATA: Final = 2
_NFTA_IMMEDIATE_DATA: Final = 2
_NFTA_DATA_VERDICT: Final = 2
_NFTA_VERDICT_CODE: Final = 1
_NFTA_VERDICT_CHAIN: Final = 2
_NFT_JUMP: Final = 0xFFFFFFFD  # -3
_NFT_GOTO: Final = 0xFFFFFFFC  # -4
_FAMILIES: Final = {IPFamily.IPV4: socket.AF_INET, IPFamily.IPV6: socket.AF_INET6}

CHAINS_PER_BATCH: Final = 20_000
"""Chains deleted in one transaction (with their rules: three each at 10 endpoints)."""
BATCH_PAUSE: Final = 0.5
"""Seconds between two batches, for event listeners to keep up."""

# The order chains go in: a chain that jumps or goes to others before its targets.
_RANKS: Final = (
    ("KUBE-FW-", 1),
    ("KUBE-EXT-", 2),
    ("KUBE-SVC-", 3),
    ("KUBE-SVL-", 3),
    ("KUBE-XLB-", 3),
    ("KUBE-SEP-", 4),
    ("KUBE-MARK-MASQ", 5),
)


def _rank(chain: str) -> tuple[int, str]:
    return next((rank for prefix, rank in _RANKS if chain.startswith(prefix)), 0), chain


def _text(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode(errors="replace")


def jump_targets(payload: bytes) -> Iterator[str]:
    """The chains a rule (a ``NEWRULE`` message's payload, after its nfgen header) jumps
    or goes to: its ``immediate`` verdicts."""
    for kind, expressions in nlmsg.attribute_values(payload):
        if kind != _NFTA_RULE_EXPRESSIONS:
            continue
        for elem_kind, element in nlmsg.attribute_values(expressions):
            if elem_kind != _NFTA_LIST_ELEM:
                continue
            parts = dict(nlmsg.attribute_values(element))
            if _text(parts.get(_NFTA_EXPR_NAME, b"")) != "immediate":
                continue
            data = dict(nlmsg.attribute_values(parts.get(_NFTA_EXPR_DATA, b"")))
            verdict_data = dict(nlmsg.attribute_values(data.get(_NFTA_IMMEDIATE_DATA, b"")))
            verdict = dict(nlmsg.attribute_values(verdict_data.get(_NFTA_DATA_VERDICT, b"")))
            code = verdict.get(_NFTA_VERDICT_CODE, b"")
            if len(code) == 4 and struct.unpack(">I", code)[0] in (_NFT_JUMP, _NFT_GOTO):
                yield _text(verdict.get(_NFTA_VERDICT_CHAIN, b""))


def _open(netns: str | None) -> socket.socket:
    def opened() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, nlmsg.NETLINK_NETFILTER)
        sock.bind((0, 0))
        return sock

    return opened() if netns is None else run_in_netns(netns, opened)


def _dump(sock: socket.socket, kind: int, family: int, attrs: bytes, what: str) -> list[bytes]:
    request = nlmsg.message(
        nlmsg.nfnl_type(nlmsg.NFNL_SUBSYS_NFTABLES, kind),
        nlmsg.NLM_F_REQUEST | nlmsg.NLM_F_DUMP,
        1,
        nlmsg.NFGEN.pack(family, 0, 0) + attrs,
    )
    return [payload[nlmsg.NFGEN.size :] for _kind, payload in nlmsg.dump(sock, request, 1, what)]


def _chains(sock: socket.socket, family: int, table: str) -> list[str]:
    found = []
    for payload in _dump(sock, _NFT_MSG_GETCHAIN, family, b"", "list chains"):
        attrs = dict(nlmsg.attribute_values(payload))
        if _text(attrs.get(_NFTA_TABLE, b"")) == table and _NFTA_CHAIN_NAME in attrs:
            found.append(_text(attrs[_NFTA_CHAIN_NAME]))
    return found


def _jumps(
    sock: socket.socket, family: int, table: str, chain: str, ours: set[str]
) -> list[tuple[str, int]]:
    """(chain, handle) of the rules of ``chain`` jumping to one of ``ours``."""
    attrs = nlmsg.attr(_NFTA_TABLE, nlmsg.string(table)) + nlmsg.attr(
        _NFTA_RULE_CHAIN, nlmsg.string(chain)
    )
    found = []
    for payload in _dump(sock, _NFT_MSG_GETRULE, family, attrs, f"list rules of {chain}"):
        parts = dict(nlmsg.attribute_values(payload))
        if _text(parts.get(_NFTA_RULE_CHAIN, b"")) != chain:
            continue  # a kernel that does not filter by chain
        handle = parts.get(_NFTA_RULE_HANDLE, b"")
        if len(handle) == 8 and any(t in ours for t in jump_targets(payload)):
            found.append((chain, struct.unpack(">Q", handle)[0]))
    return found


def remove_ours(
    family: IPFamily,
    tables: Iterable[str],
    owns: Callable[[str, str], bool],
    netns: str | None = None,
    *,
    per_batch: int = CHAINS_PER_BATCH,
    pause: float = BATCH_PAUSE,
) -> int:
    """Remove, in each of iptables-nft's ``tables`` of ``family`` that exists, the chains
    ``owns(table, name)`` says are ours and every rule of a built-in chain that jumps to
    one: one nf_tables transaction per ``per_batch`` chains, ``pause`` seconds apart.
    Returns how many chains went.

    Raises :class:`OneBatchRefused` when the kernel refuses (a chain still referenced by
    a rule of someone else's chain: nothing of that table is deleted) and
    :class:`OSError` when the tables cannot be read.
    """
    # The nftables backend's batch encoder and socket: the same messages and answers
    # (its package ships with the core).
    from kubeproxy.backends.nftables.batchencoder import deletion_messages
    from kubeproxy.backends.nftables.batchsocket import BatchSocket
    from kubeproxy.backends.nftables.objects import Family, NftError
    from kubeproxy.backends.nftables.stale import chain_object, queue_deletion
    from kubeproxy.backends.nftables.transaction import Transaction

    number = _FAMILIES[family]
    nft_family = Family.IP if family is IPFamily.IPV4 else Family.IP6
    removed = 0
    sock = _open(netns)
    channel: BatchSocket | None = None
    try:
        for table in tables:
            chains = _chains(sock, number, table)
            ours = {c for c in chains if owns(table, c)}
            if not ours:
                continue
            jumps = [
                jump
                for chain in BUILTIN_CHAINS.get(table, ())
                if chain in chains
                for jump in _jumps(sock, number, table, chain, ours)
            ]
            if channel is None:
                channel = BatchSocket(netns)
            ordered = sorted(ours, key=_rank)
            for start in range(0, len(ordered), per_batch):
                if start:
                    time.sleep(pause)
                chunk = ordered[start : start + per_batch]
                tx = Transaction(nft_family, table)
                queue_deletion(tx, [chain_object(c) for c in chunk])
                try:
                    messages = deletion_messages(tx, rules=() if start else jumps)
                    frames = [m.frame() for m in messages]
                    channel.send(number, frames, f"deleting chains of {nft_family} {table}")
                except NftError as err:
                    raise OneBatchRefused(f"{family} {table}: {err}") from err
                removed += len(chunk)
    finally:
        sock.close()
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.close()
    return removed
