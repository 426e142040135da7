"""The decision path of a new connection, computed from the kernel's table: ``kubeproxy
trace``.

The path follows the table in the kernel's order: the source-range firewall (before
DNAT), the ``services`` dispatch (a Service frontend, else a NodePort on a NodePort
address), the class chain a frontend reaches (:class:`~.explain.TableView`), the class
chain's rules evaluated for this source (masquerade, short-circuit, pick), the endpoints
its pick chooses from; and for what is not dispatched, the filter chains' no-endpoint
sets, ``cluster-ips`` and the service CIDR drop. Every fact is read from the kernel;
the class chain's matches are evaluated from the kernel's expressions (the source
address against a prefix, ``fib saddr type local`` against the node's addresses, the
input interface when given), so a detector this code does not know is said, not guessed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.explain import FrontendView, TableView
from kubeproxy.backends.nftables.frontends import Kind, NoEndpoint
from kubeproxy.backends.nftables.reader import RuleRefs
from kubeproxy.backends.nftables.table import Names
from kubeproxy.objects import IPAddress

__all__ = ["Trace", "trace"]

Raw = tuple[tuple[int, bytes], ...]

# Expression attributes (linux/netfilter/nf_tables.h).
_PAYLOAD_BASE, _PAYLOAD_OFFSET, _PAYLOAD_LEN = 2, 3, 4
_BASE_NETWORK = 1
_BITWISE_MASK, _BITWISE_XOR = 4, 5
_CMP_OP, _CMP_DATA = 2, 3
_CMP_EQ, _CMP_NEQ = 0, 1
_META_KEY = 2
_META_IIFNAME = 6
_FIB_RESULT, _FIB_FLAGS = 2, 3
_FIB_ADDRTYPE, _FIB_SADDR = 3, 1
_RTN_LOCAL = 2
_DATA_VALUE = 1
_MARK_CHAIN = "mark-for-masquerade"


@dataclass(frozen=True, slots=True)
class Trace:
    """Where a new connection goes: ``verdict`` is ``endpoints`` (one of
    ``endpoints``), ``reject``, ``drop`` or ``untouched``; ``masquerade`` whether its
    source is rewritten (None: unknown); ``steps`` the path in words; ``unsure`` the
    matches that could not be evaluated (the path assumed they do not match)."""

    verdict: str
    endpoints: tuple[str, ...] = ()
    masquerade: bool | None = None
    frontend: FrontendView | None = None
    steps: tuple[str, ...] = ()
    unsure: tuple[str, ...] = field(default=())

    def as_json(self) -> dict[str, object]:
        """The trace as plain data (``--json``, ``/debug/trace``)."""
        return {
            "verdict": self.verdict,
            "endpoints": list(self.endpoints),
            "masquerade": self.masquerade,
            "service": self.frontend.name if self.frontend else None,
            "steps": list(self.steps),
            "unsure": list(self.unsure),
        }


def _value(raw: bytes) -> bytes:
    return next((v for k, v in nlmsg.attribute_values(raw) if k == _DATA_VALUE), b"")


class _Matcher:
    """Evaluates a rule's matches for one packet (source, destination, input interface,
    the node's addresses)."""

    def __init__(
        self,
        source: IPAddress,
        dest: IPAddress,
        local: Sequence[IPAddress],
        iif: str | None,
    ) -> None:
        self.header = bytearray(40)
        if source.version == 4:
            self.header[12:16] = source.packed
            self.header[16:20] = dest.packed
        else:
            self.header[8:24] = source.packed
            self.header[24:40] = dest.packed
        self.source = source
        self.local = set(local)
        self.iif = iif
        self.needs_iif = False

    def matches(self, rule: RuleRefs) -> bool | None:
        """Whether the rule's matches hold (None: one of them cannot be evaluated)."""
        register: bytes | None = None
        known = True
        for name, raw in rule.expressions:
            attrs = dict(raw)
            if name == "payload":
                base = struct.unpack(">I", attrs.get(_PAYLOAD_BASE, bytes(4)))[0]
                offset = struct.unpack(">I", attrs.get(_PAYLOAD_OFFSET, bytes(4)))[0]
                length = struct.unpack(">I", attrs.get(_PAYLOAD_LEN, bytes(4)))[0]
                if base != _BASE_NETWORK or offset + length > len(self.header):
                    return None
                register = bytes(self.header[offset : offset + length])
            elif name == "bitwise" and register is not None:
                mask = _value(attrs.get(_BITWISE_MASK, b""))
                xor = _value(attrs.get(_BITWISE_XOR, b"")) or bytes(len(mask))
                register = bytes((r & m) ^ x for r, m, x in zip(register, mask, xor, strict=False))
            elif name == "meta":
                key = struct.unpack(">I", attrs.get(_META_KEY, bytes(4)))[0]
                if key != _META_IIFNAME or self.iif is None:
                    self.needs_iif = self.needs_iif or key == _META_IIFNAME
                    known = False
                    register = None
                    continue
                register = self.iif.encode().ljust(16, b"\0")
            elif name == "fib":
                result = struct.unpack(">I", attrs.get(_FIB_RESULT, bytes(4)))[0]
                flags = struct.unpack(">I", attrs.get(_FIB_FLAGS, bytes(4)))[0]
                if result != _FIB_ADDRTYPE or not flags & _FIB_SADDR:
                    return None
                kind = _RTN_LOCAL if self.source in self.local else 1
                register = struct.pack("=I", kind)
            elif name == "cmp":
                op = struct.unpack(">I", attrs.get(_CMP_OP, bytes(4)))[0]
                data = _value(attrs.get(_CMP_DATA, b""))
                if register is None:
                    if not known:
                        return None
                    continue
                held = register[: len(data)]
                if (op == _CMP_EQ and held != data) or (op == _CMP_NEQ and held == data):
                    return False
                if op not in (_CMP_EQ, _CMP_NEQ):
                    return None
            elif name in ("immediate", "counter", "reject"):
                continue
            else:
                return None
        return True if known else None


def _dispatched(
    view: TableView, dest: IPAddress, port: int, proto: str, local: Sequence[IPAddress]
) -> tuple[Kind, tuple[str, ...]] | None:
    ip_key = (str(dest), proto, str(port))
    if view.get(view.names.dispatch(Kind.IP), ip_key) is not None:
        return Kind.IP, ip_key
    np_key = (proto, str(port))
    dispatched = view.get(view.names.dispatch(Kind.NODEPORT), np_key) is not None
    if dispatched and view.answers_nodeports(dest, local):
        return Kind.NODEPORT, np_key
    return None


def trace(
    view: TableView,
    source: IPAddress,
    dest: IPAddress,
    port: int,
    proto: str,
    *,
    local: Sequence[IPAddress] = (),
    iif: str | None = None,
) -> Trace:
    """The path of a new ``proto`` connection from ``source`` to ``dest:port`` through
    ``view``'s table (``local``: the node's addresses; ``iif``: the input interface)."""
    steps: list[str] = []
    unsure: list[str] = []
    names = view.names
    key = (str(dest), proto, str(port))
    if view.get(names.firewall_ips, key) is not None:
        allowed = view.get(names.firewall_allow(proto), (str(dest), str(port), str(source)))
        if allowed is None:
            steps.append(
                f"{dest}:{port}/{proto} has loadBalancerSourceRanges and {source} is in none:"
                " dropped (firewall-check)"
            )
            return Trace("drop", steps=tuple(steps))
        steps.append(f"{source} is in the loadBalancerSourceRanges of {dest}:{port}/{proto}")
    found = _dispatched(view, dest, port, proto, local)
    if found is None:
        return _not_dispatched(view, source, dest, port, proto, local, steps)
    kind, fkey = found
    comment = view.get(names.dispatch(kind), fkey)
    fe = view.explain(kind, fkey, comment.comment if comment else None)
    steps.append(f"dispatched: {fe.address} of {fe.name or 'an unnamed Service'}")
    steps.append(f"class {fe.chain}: {fe.what}")
    matcher = _Matcher(source, dest, local, iif)
    masquerade = False
    pick: str | None = None
    for rule in view.rules(fe.chain) if fe.chain else []:
        target = rule.target
        if target is None:
            continue
        held = matcher.matches(rule)
        if held is None:
            what = "the input interface (pass --iif)" if matcher.needs_iif else "a match"
            unsure.append(f"{what} of a rule of {fe.chain} toward {target}: taken as no match")
            continue
        if not held:
            continue
        if target == _MARK_CHAIN:
            masquerade = True
            continue
        pick = target
        break
    if pick is None:
        steps.append(f"no pick in {fe.chain} for {source}: no DNAT here")
        steps.extend(f"unsure: {u}" for u in unsure)
        if fe.no_endpoint is not None:
            steps.append(f"no endpoint for this client: {fe.no_endpoint} (no-endpoint set)")
            return Trace(fe.no_endpoint, (), None, fe, tuple(steps), tuple(unsure))
        return Trace("untouched", (), None, fe, tuple(steps), tuple(unsure))
    shortcut = "shortcut" in pick
    chosen = fe.shortcut if shortcut else fe.endpoints
    which = "the short-circuit list (a pod or this node)" if shortcut else "its endpoints"
    steps.append(f"{pick}: one of {which}, at random: {', '.join(map(str, chosen))}")
    held_entry = next((a for a in fe.affinity if a.client == str(source)), None)
    if held_entry is not None:
        steps.append(f"ClientIP affinity holds {source} to {held_entry.endpoint}")
    steps.append("masqueraded" if masquerade else "not masqueraded (source kept)")
    steps.extend(f"unsure: {u}" for u in unsure)
    endpoints = tuple(e for e in chosen if e is not None)
    return Trace("endpoints", endpoints, masquerade, fe, tuple(steps), tuple(unsure))


def _not_dispatched(
    view: TableView,
    source: IPAddress,
    dest: IPAddress,
    port: int,
    proto: str,
    local: Sequence[IPAddress],
    steps: list[str],
) -> Trace:
    names = view.names
    keys: list[tuple[Kind, tuple[str, ...]]] = [(Kind.IP, (str(dest), proto, str(port)))]
    if view.answers_nodeports(dest, local):
        keys.append((Kind.NODEPORT, (proto, str(port))))
    for kind, fkey in keys:
        for verdict in (NoEndpoint.REJECT, NoEndpoint.DROP):
            held = view.get(names.no_endpoint(kind, verdict), fkey)
            if held is not None:
                steps.append(
                    f"not dispatched: {held.comment or 'a Service'} has no endpoint for it:"
                    f" {verdict}"
                )
                return Trace(str(verdict), steps=tuple(steps))
    if view.get(Names.CLUSTER_IPS, (str(dest),)) is not None:
        steps.append(f"{dest} is a cluster IP with no Service port {port}/{proto}: reject")
        return Trace("reject", steps=tuple(steps))
    matcher = _Matcher(source, dest, local, None)
    for rule in view.rules(Names.CLUSTER_IPS_CHECK):
        if rule.lookups or not _drops(rule):
            continue
        if matcher.matches(rule):
            steps.append(f"{dest} is in a service CIDR but no Service's: drop")
            return Trace("drop", steps=tuple(steps))
    steps.append("not a Service frontend: left alone")
    return Trace("untouched", steps=tuple(steps))


def _drops(rule: RuleRefs) -> bool:
    return any(verb == "drop" for verb, _chain in rule.verdicts)
