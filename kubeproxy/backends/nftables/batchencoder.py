"""A :class:`~.transaction.Transaction` as nf_tables netlink messages: one batch, one
transaction, with nothing of nft in between.

Every operation a transaction can queue has its message here: tables (with the owner
flags the owned table needs), chains (base chains with their hook, priority and policy;
comments), sets and maps (:mod:`.declarations`), rules (:mod:`.ruleencoder`), elements
(values, verdicts, ranges), and flushes and deletions of each. Consecutive elements of
one container share a message (split where one attribute would pass 64 KiB), so a batch
of a thousand verdicts is a handful of messages. Each message keeps the nft line it
stands for, so a refusal reads like nft's (``add rule ip kube-proxy services ...: No
such file or directory``).

Sets a transaction declares are known to the rules and elements after them; sets it
does not declare come from ``declared`` (what the session wrote before, or read back
from the kernel). A transaction of flushes and deletions only needs none of that
(:func:`deletion_messages`): any nf_tables socket can send it, before any of our table
is known, and for any table (iptables-nft's ``nat`` too); a rule goes by its handle there.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchsocket import Frame
from kubeproxy.backends.nftables.declarations import Declaration
from kubeproxy.backends.nftables.elements import element_encoder, supports, with_comment
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
    validate_name,
)
from kubeproxy.backends.nftables.ruleencoder import RuleEncoder
from kubeproxy.backends.nftables.transaction import (
    ElementParts,
    ElementRun,
    Transaction,
    render_operation,
)

__all__ = [
    "FAMILY_NUMBERS",
    "NFT_TABLE_F_OWNER",
    "NFT_TABLE_F_PERSIST",
    "EncodedBatch",
    "Message",
    "deletion_messages",
    "encode_transaction",
    "table_message",
]

FAMILY_NUMBERS = {Family.IP: socket.AF_INET, Family.IP6: socket.AF_INET6, Family.INET: 1}
"""``nfgenmsg.nfgen_family`` of each nftables family."""

NFT_TABLE_F_OWNER = 0x2
"""The table belongs to the netlink socket that set the flag (Linux 5.12)."""
NFT_TABLE_F_PERSIST = 0x4
"""An owned table outlives its owner's socket, orphaned, until adopted (Linux 6.9)."""

# nf_tables.h message types and attributes.
_NEWTABLE, _DELTABLE, _NEWCHAIN, _DELCHAIN = 0, 2, 3, 5
_NEWRULE, _DELRULE, _NEWSET, _DELSET, _NEWSETELEM, _DELSETELEM = 6, 8, 9, 11, 12, 14
_NLM_F_EXCL, _NLM_F_APPEND = 0x200, 0x800
_TABLE_NAME, _TABLE_FLAGS, _TABLE_USERDATA = 1, 2, 6
_CHAIN_TABLE, _CHAIN_NAME, _CHAIN_HOOK, _CHAIN_POLICY, _CHAIN_TYPE = 1, 3, 4, 5, 7
_CHAIN_USERDATA = 12
_HOOK_NUM, _HOOK_PRIORITY = 1, 2
_RULE_TABLE, _RULE_CHAIN, _RULE_HANDLE, _RULE_EXPRESSIONS, _RULE_USERDATA = 1, 2, 3, 4, 7
_SET_TABLE, _SET_NAME = 1, 2
_ELEM_LIST_TABLE, _ELEM_LIST_SET, _ELEM_LIST_ELEMENTS, _ELEM_LIST_SET_ID = 1, 2, 3, 4
_UDATA_COMMENT = 0
_HOOKS = {"prerouting": 0, "input": 1, "forward": 2, "output": 3, "postrouting": 4}
_POLICIES = {"drop": 0, "accept": 1}


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a batch: its nf_tables type, flags, attributes (after
    ``nfgenmsg``) and the nft line it stands for."""

    kind: int
    flags: int
    body: bytes
    what: str

    def refusal(self, code: int, offset: int | None, message: str) -> NftError:
        """The error for the kernel's refusal of this message, in nft's words."""
        reason = os.strerror(code) + (f" ({message})" if message else "")
        return NftError(f"{self.what}: {reason}", code)

    def frame(self) -> Frame:
        """This message for a :class:`~.batchsocket.BatchSocket`."""
        return Frame(self.kind, self.flags, self.body, self)


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """A transaction's messages and what it does to the table's declarations (applied
    by the caller once the kernel committed it)."""

    messages: tuple[Message, ...]
    declared: dict[str, Declaration]
    deleted: frozenset[str]
    table_deleted: bool
    """Whether the table is gone once the batch committed (deleted, not added again)."""

    @property
    def creates_table(self) -> bool:
        """Whether the batch adds the table (creating it if missing)."""
        return any(m.kind == _NEWTABLE for m in self.messages) and not self.table_deleted


def _comment(comment: str | None) -> bytes:
    if comment is None:
        return b""
    text = comment.encode() + b"\0"
    return bytes((_UDATA_COMMENT, len(text))) + text


def table_message(table: str, flags: int | None, comment: str | None, *, create: bool) -> Message:
    """``add table`` (``create``: fail if it exists) with ``flags`` (None: leave them)."""
    body = nlmsg.attr(_TABLE_NAME, nlmsg.string(table))
    if flags is not None:
        body += nlmsg.attr(_TABLE_FLAGS, struct.pack(">I", flags))
    if comment is not None:
        body += nlmsg.attr(_TABLE_USERDATA, _comment(comment))
    verb = "create" if create else "add"
    return Message(
        _NEWTABLE,
        nlmsg.NLM_F_CREATE | (_NLM_F_EXCL if create else 0),
        body,
        f"{verb} table {table}",
    )


class _Encoder:
    """Encodes one transaction (see :func:`encode_transaction`)."""

    def __init__(
        self,
        tx: Transaction,
        declared: Callable[[str], Declaration],
        table_flags: int | None,
        set_ids: Iterator[int],
    ) -> None:
        self.tx = tx
        self.family = tx.family
        self.table = tx.table
        self.prefix = nlmsg.attr(1, nlmsg.string(tx.table))
        self._declared = declared
        self.table_flags = table_flags
        self.set_ids = set_ids
        self.messages: list[Message] = []
        self.pending: dict[str, Declaration] = {}
        self.deleted: set[str] = set()
        self.table_deleted = False
        self.rules = RuleEncoder(self.family, self.declaration, lambda: next(self.set_ids))

    def declaration(self, name: str) -> Declaration:
        found = self.pending.get(name)
        if found is not None:
            return found
        if name in self.deleted or self.table_deleted:
            raise NftError(f"set {name} does not exist", errno.ENOENT)
        return self._declared(name)

    def add(self, kind: int, flags: int, body: bytes, what: str) -> None:
        self.messages.append(Message(kind, flags, body, what))

    def encode(self) -> None:
        for step in self.tx.runs():
            if isinstance(step, ElementRun):
                # Consecutive elements of one container and verb share messages.
                self.elements(step.verb, step.container, step.parts())
            else:
                self.operation(*step)

    def operation(self, verb: str, obj: object) -> None:
        what = render_operation(self.family, self.table, verb, obj)  # type: ignore[arg-type]
        create = nlmsg.NLM_F_CREATE | (_NLM_F_EXCL if verb == "create" else 0)
        if isinstance(obj, Table):
            if verb == "delete":
                self.add(_DELTABLE, 0, self.prefix, what)
                self.table_deleted = True
                self.pending.clear()
            elif verb == "flush":
                self.add(_DELRULE, 0, self.prefix, what)
            else:
                message = table_message(
                    self.table, self.table_flags, obj.comment, create=verb == "create"
                )
                self.add(message.kind, message.flags, message.body, what)
                self.table_deleted = False
        elif isinstance(obj, Chain):
            name = nlmsg.attr(_CHAIN_NAME, nlmsg.string(obj.name))
            if verb == "delete":
                self.add(_DELCHAIN, 0, self.prefix + name, what)
            elif verb == "flush":
                self.add(
                    _DELRULE, 0, self.prefix + nlmsg.attr(_RULE_CHAIN, nlmsg.string(obj.name)), what
                )
            else:
                self.add(_NEWCHAIN, create, self.chain_body(obj), what)
        elif isinstance(obj, Rule):
            encoded = self.rules.encode(obj.rule)
            for anonymous in encoded.anonymous:
                decl = anonymous.declaration
                self.add(
                    _NEWSET,
                    nlmsg.NLM_F_CREATE,
                    decl.attributes(self.table, anonymous.set_id),
                    f"{what} (its anonymous set)",
                )
                self.add(
                    _NEWSETELEM,
                    nlmsg.NLM_F_CREATE,
                    self.prefix
                    + nlmsg.attr(_ELEM_LIST_SET, nlmsg.string(decl.name))
                    + nlmsg.attr(_ELEM_LIST_SET_ID, struct.pack(">I", anonymous.set_id))
                    + nlmsg.nested(_ELEM_LIST_ELEMENTS, *anonymous.elements),
                    f"{what} (its anonymous set's elements)",
                )
            body = (
                self.prefix
                + nlmsg.attr(_RULE_CHAIN, nlmsg.string(obj.chain))
                + nlmsg.nested(_RULE_EXPRESSIONS, encoded.expressions)
            )
            if obj.comment is not None:
                body += nlmsg.attr(_RULE_USERDATA, _comment(obj.comment))
            flags = nlmsg.NLM_F_CREATE | (_NLM_F_APPEND if verb != "insert" else 0)
            self.add(_NEWRULE, flags, body, what)
        elif isinstance(obj, Set | Map):
            name = nlmsg.attr(_SET_NAME, nlmsg.string(obj.name))
            if verb == "delete":
                self.add(_DELSET, 0, self.prefix + name, what)
                self.pending.pop(obj.name, None)
                self.deleted.add(obj.name)
            elif verb == "flush":
                self.add(_DELSETELEM, 0, self.prefix + name, what)
            else:
                declaration = Declaration.of(obj)
                # The kernel wants every new set to have a batch-unique id (6.18: EINVAL
                # without one), as nft always sends.
                body = declaration.attributes(self.table, next(self.set_ids))
                self.add(_NEWSET, create, body, what)
                self.pending[obj.name] = declaration
                self.deleted.discard(obj.name)
        else:
            raise NftError(f"cannot encode {what}", errno.EINVAL)

    def chain_body(self, chain: Chain) -> bytes:
        body = self.prefix + nlmsg.attr(_CHAIN_NAME, nlmsg.string(chain.name))
        if chain.hook is not None:
            assert chain.priority is not None and chain.type is not None
            body += nlmsg.nested(
                _CHAIN_HOOK,
                nlmsg.attr(_HOOK_NUM, struct.pack(">I", _HOOKS[chain.hook])),
                nlmsg.attr(_HOOK_PRIORITY, struct.pack(">i", chain.priority)),
            )
            body += nlmsg.attr(_CHAIN_TYPE, nlmsg.string(chain.type))
            if chain.policy is not None:
                body += nlmsg.attr(_CHAIN_POLICY, struct.pack(">I", _POLICIES[chain.policy]))
        if chain.comment is not None:
            body += nlmsg.attr(_CHAIN_USERDATA, _comment(chain.comment))
        return body

    def elements(self, verb: str, container: str, elements: Iterable[ElementParts]) -> None:
        """Encode ``elements`` (key, value, comment, timeout) into messages of at most
        :data:`~kubeproxy.host.nlmsg.MESSAGE_BYTES` each (one element may be alone and over),
        each message made as soon as it is full: what is held at once is one message's
        elements, not every element of the run encoded first."""
        declaration = self.declaration(container)
        kind = _DELSETELEM if verb == "delete" else _NEWSETELEM
        flags = 0
        if kind == _NEWSETELEM:
            flags = nlmsg.NLM_F_CREATE | (_NLM_F_EXCL if verb == "create" else 0)
        head = self.prefix + nlmsg.attr(_ELEM_LIST_SET, nlmsg.string(container))
        types = declaration.data_types()
        # Plain data elements take elements.py's encoder (0.4 us an element, against
        # 2.9 us through the declaration's general one; timeit, this machine).
        fast = element_encoder(*types) if types is not None and all(map(supports, types)) else None
        budget = nlmsg.MESSAGE_BYTES
        encoded: list[bytes] = []
        shown: list[tuple[str, ...]] = []  # the message's first three keys, for its text
        size = 0

        def flush() -> None:
            listed = ", ".join(" . ".join(key) for key in shown)
            more = f" and {len(encoded) - 3} more" if len(encoded) > 3 else ""
            what = f"{verb} element {self.family} {self.table} {container} {{ {listed}{more} }}"
            self.add(kind, flags, head + nlmsg.nested(_ELEM_LIST_ELEMENTS, *encoded), what)

        for key, value, comment, timeout in elements:
            if timeout is not None:
                raise NftError(
                    f"element {key} of {container}: timeouts are not written by the owned table",
                    errno.EINVAL,
                )
            if verb == "delete":
                value = ()
            if fast is None:
                data = declaration.element(key, value)
            else:
                try:
                    data = fast(key, value)
                except ValueError:  # the general encoder names what is wrong
                    data = declaration.element(key, value)
            if comment is not None and verb != "delete":
                try:  # the frontends' Service names (user data as libnftnl writes it)
                    data = with_comment(data, comment)
                except ValueError as err:
                    raise NftError(f"element {key} of {container}: {err}", errno.EINVAL) from None
            if encoded and size + len(data) > budget:
                flush()
                encoded, shown, size = [], [], 0
            encoded.append(data)
            size += len(data)
            if len(shown) < 3:
                shown.append(key)
        if encoded:
            flush()


def encode_transaction(
    tx: Transaction,
    declared: Callable[[str], Declaration],
    *,
    table_flags: int | None = None,
    set_ids: Iterator[int] | None = None,
) -> EncodedBatch:
    """The messages of ``tx`` (raises :class:`NftError` for what cannot be encoded, or a
    latched validation error). ``declared`` returns the declaration of a set the
    transaction does not declare itself (raise ``ENOENT`` when there is none);
    ``table_flags`` go into every ``add table`` (the owner flags); ``set_ids`` numbers
    anonymous sets (batch-unique)."""
    if tx.error is not None:
        raise tx.error
    encoder = _Encoder(tx, declared, table_flags, set_ids or itertools.count(1))
    encoder.encode()
    return EncodedBatch(
        tuple(encoder.messages),
        encoder.pending,
        frozenset(encoder.deleted),
        encoder.table_deleted,
    )


def _undeclared(name: str) -> Declaration:
    raise NftError(f"set {name}: a deletion names no declaration", errno.EINVAL)


def deletion_messages(tx: Transaction, *, rules: Sequence[tuple[str, int]] = ()) -> list[Message]:
    """The messages of ``tx``, flushes and deletions only (chains, sets, maps, elements
    of none), after one deleting each of ``rules`` (``(chain, handle)``: rules of other
    chains that name what ``tx`` deletes, as iptables-nft's built-in chains jump to
    ours). None needs a declaration, so any socket can send them for any table.

    Why a batch of our own for these: libnftables lists the table for its cache before
    every run, and at 10k Services upstream's table holds 110k chains: deleting them took
    8.7 s through libnftables, 0.8 s as one netlink batch (``make bench-takeover``).
    """
    if tx.error is not None:
        raise tx.error
    for verb, obj in tx.operations():
        if verb not in ("flush", "delete") or isinstance(obj, Element):
            what = render_operation(tx.family, tx.table, verb, obj)
            raise NftError(f"{what}: not a flush or deletion of an object", errno.EINVAL)
    prefix = nlmsg.attr(_RULE_TABLE, nlmsg.string(tx.table))
    messages = []
    for chain, handle in rules:
        validate_name("chain", chain)
        body = prefix + nlmsg.attr(_RULE_CHAIN, nlmsg.string(chain))
        body += nlmsg.attr(_RULE_HANDLE, struct.pack(">Q", handle))
        what = f"delete rule {tx.family} {tx.table} {chain} handle {handle}"
        messages.append(Message(_DELRULE, 0, body, what))
    messages += encode_transaction(tx, _undeclared).messages
    return messages
