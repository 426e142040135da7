"""The owned table's pieces without a kernel: the decision to own, set declarations as
the kernel stores and returns them, the rule encoder's vocabulary and its refusals, and
transactions as messages. What the kernel makes of the bytes is
``tests/test_nft_owned_kernel.py``'s (every flow-case state written both ways)."""

from __future__ import annotations

import errno
import struct

import pytest

import kubeproxy.host.nlmsg as nlmsg
from kubeproxy.backends.nftables.batchencoder import deletion_messages, encode_transaction
from kubeproxy.backends.nftables.declarations import Declaration, _udata
from kubeproxy.backends.nftables.elements import element_encoder
from kubeproxy.backends.nftables.frontends import AFFINITY4_MAP_TYPE, Kind
from kubeproxy.backends.nftables.generation import add_container
from kubeproxy.backends.nftables.layout import (
    Dispatch,
    GenNames,
    Pick,
    affinity_container,
    public_containers,
)
from kubeproxy.backends.nftables.objects import Chain, Family, Map, NftError, Set, Table
from kubeproxy.backends.nftables.ruleencoder import RuleEncoder, register
from kubeproxy.backends.nftables.support import table_ownership
from kubeproxy.backends.nftables.table import AFFINITY6_MAP_TYPE, tokens_for
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.featuregates import resolve
from kubeproxy.objects import IPFamily

# The decision -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gates", "probe", "owned", "words"),
    [
        ({}, (True, True), True, "has the owner and persist table flags"),
        ({}, (True, False), False, "has the owner table flag but lacks persist (Linux 6.9+)"),
        ({}, (False, False), False, "lacks the owner table flag (Linux 5.12+)"),
        ({"NFTablesOwnedTable": False}, (True, True), False, "NFTablesOwnedTable feature gate"),
        ({"NFTablesNetlink": False}, (True, True), False, "NFTablesNetlink is off"),
        ({"AllBeta": False}, (True, True), False, "NFTablesOwnedTable feature gate"),
    ],
)
def test_the_table_is_owned_only_with_both_flags_and_both_gates(
    gates: dict[str, bool], probe: tuple[bool, bool], owned: bool, words: str
) -> None:
    probed: list[int] = []

    def flags() -> tuple[bool, bool]:
        probed.append(1)
        return probe

    decision = table_ownership(resolve(gates), flags)
    assert decision.owned is owned
    assert words in decision.reason
    line = decision.describe(Family.IP, "kube-proxy")
    assert line.startswith(
        "table ip kube-proxy is owned" if owned else "table ip kube-proxy is not"
    )
    # The gates decide before the kernel is asked.
    assert bool(probed) == (gates == {})


def test_a_probe_that_fails_says_so_and_owns_nothing() -> None:
    def refused() -> tuple[bool, bool]:
        raise NftError("cannot open an nf_tables netlink socket: Operation not permitted")

    decision = table_ownership(resolve({}), refused)
    assert not decision.owned
    assert "could not be probed" in decision.reason and "Operation not permitted" in decision.reason


# Declarations ---------------------------------------------------------------------------------


def _containers() -> list[Set | Map]:
    out: list[Set | Map] = []
    for family in (IPFamily.IPV4, IPFamily.IPV6):
        tokens = tokens_for(family)
        names = GenNames(7)
        tx = Transaction(Family.IP, "t")
        specs = [*names.containers(tokens, Dispatch.TREE), *public_containers(tokens)]
        specs += names.slot_maps(Pick(Kind.IP, False, 5, True), tokens)
        specs += names.slot_maps(Pick(Kind.NODEPORT, True, 2, False), tokens)
        kind = AFFINITY4_MAP_TYPE if family is IPFamily.IPV4 else AFFINITY6_MAP_TYPE
        specs.append(affinity_container("affinity-X", kind))
        for spec in specs:
            add_container(tx, spec)
        out.extend(obj for _verb, obj in tx.operations() if isinstance(obj, Set | Map))
    out.append(Set("localhost-nodeports-udp", "inet_service"))
    return out


@pytest.mark.parametrize("obj", _containers(), ids=lambda o: f"{o.name}:{o.type}")
def test_a_declaration_reads_back_from_what_the_kernel_returns(obj: Set | Map) -> None:
    declaration = Declaration.of(obj)
    # The kernel returns a set's attributes as given (and some of its own: a handle).
    returned = declaration.attributes("kube-proxy", 9) + nlmsg.attr(16, struct.pack(">Q", 3))
    again = Declaration.from_kernel(returned)
    assert again == declaration


def test_a_typeof_verdict_map_records_its_value_as_a_verdict_expression() -> None:
    """As nft 1.0.6 writes it (the kernel tests compare the bytes with nft's): a data
    ``typeof`` record holding a verdict expression with no data; none for ``type``."""
    typed = _udata(Declaration.of(Map("v", "ip daddr : verdict", typeof=True)).user_data())
    assert typed[4] == bytes((0, 4, 1, 0, 0, 0, 1, 0))
    plain = _udata(Declaration.of(Map("v", "ipv4_addr : verdict")).user_data())
    assert 4 not in plain and 0 in plain


_SAMPLES = {
    "ipv4_addr": "10.1.2.3",
    "ipv6_addr": "fd00::3",
    "inet_proto": "udp",
    "inet_service": "8080",
    "integer": "7",
}


@pytest.mark.parametrize(
    "obj",
    [o for o in _containers() if Declaration.of(o).data_types() is not None],
    ids=lambda o: f"{o.name}:{o.type}",
)
def test_the_fast_element_encoder_writes_what_the_declaration_writes(obj: Set | Map) -> None:
    declaration = Declaration.of(obj)
    types = declaration.data_types()
    assert types is not None
    key = tuple(_SAMPLES[t] for t in types[0])
    value = tuple(_SAMPLES[t] for t in types[1])
    assert element_encoder(*types)(key, value) == declaration.element(key, value)


def test_types_and_elements_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(NftError, match="data type 'ether_addr'") as refused:
        Declaration.of(Set("s", "ether_addr"))
    assert refused.value.errno == errno.EINVAL
    with pytest.raises(NftError, match="typeof 'tcp sport'"):
        Declaration.of(Set("s", "tcp sport", typeof=True))
    ports = Declaration.of(Set("ports", "inet_proto . inet_service"))
    with pytest.raises(NftError, match=r"element tcp \. 70000 of ports: '70000' is not a port"):
        ports.element(("tcp", "70000"))
    verdicts = Declaration.of(Map("v", "inet_proto . inet_service : verdict"))
    with pytest.raises(NftError, match="is not a verdict"):
        verdicts.element(("tcp", "80"), ("goto",))


# Rules ----------------------------------------------------------------------------------------


def _names(expressions: bytes) -> list[str]:
    out = []
    for _kind, item in nlmsg.attribute_values(expressions):
        for part, value in nlmsg.attribute_values(item):
            if part == 1:
                out.append(value.rstrip(b"\0").decode())
    return out


SLOTS = Declaration.of(
    Map(
        "slots",
        "ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . tcp dport",
        typeof=True,
    )
)


def _encoder(family: Family = Family.IP) -> RuleEncoder:
    def declared(name: str) -> Declaration:
        if name != "slots":
            raise NftError(f"set {name} does not exist", errno.ENOENT)
        return SLOTS

    ids = iter(range(1, 100))
    return RuleEncoder(family, declared, lambda: next(ids))


def test_registers_are_numbered_as_nft_numbers_them() -> None:
    # 16-byte registers where a 4-byte slot starts one, else the 4-byte register.
    assert [register(s) for s in (0, 1, 2, 3, 4, 5, 8)] == [1, 9, 10, 11, 2, 13, 3]


def test_the_protocol_a_map_value_implies_is_matched_once_per_transaction() -> None:
    encoder = _encoder()
    rule = "dnat to ip daddr . meta l4proto . th dport . numgen random mod 3 map @slots"
    first = _names(encoder.encode(rule).expressions)
    second = _names(encoder.encode(rule).expressions)
    assert first[:2] == ["meta", "cmp"]  # meta l4proto tcp, as nft adds it
    assert second == first[2:]  # nft 1.0.6 adds it to the first rule only
    assert _names(_encoder().encode(rule).expressions) == first  # a new transaction


def test_a_protocol_already_matched_is_not_matched_again() -> None:
    names = _names(_encoder().encode("meta l4proto udp udp dport 53 accept").expressions)
    assert names == ["meta", "cmp", "payload", "cmp", "immediate"]
    implied = _names(_encoder().encode("ip daddr 127.0.0.0/8 udp dport 53 drop").expressions)
    assert implied == ["payload", "cmp", "meta", "cmp", "payload", "cmp", "immediate"]


def test_an_anonymous_set_comes_with_the_rule() -> None:
    encoded = _encoder().encode("meta l4proto { tcp, udp, sctp } accept")
    (anonymous,) = encoded.anonymous
    assert anonymous.declaration.name == "__set%d" and len(anonymous.elements) == 3
    assert _names(encoded.expressions) == ["meta", "lookup", "immediate"]


# The canonical maps of the frontend-keyed affinity (what layout.py declares them as).
_CANONICAL = {
    "ci": Declaration.of(Map("ci", "ipv4_addr . inet_proto . inet_service : ipv4_addr")),
    "cp": Declaration.of(Map("cp", "inet_proto . inet_service : inet_service")),
    "slots": SLOTS,
}


def _canonical_encoder() -> RuleEncoder:
    def declared(name: str) -> Declaration:
        if name not in _CANONICAL:
            raise NftError(f"set {name} does not exist", errno.ENOENT)
        return _CANONICAL[name]

    ids = iter(range(1, 100))
    return RuleEncoder(Family.IP, declared, lambda: next(ids))


def _expressions(expressions: bytes) -> list[tuple[str, dict[int, bytes]]]:
    """Each expression's name and its data attributes (by number)."""
    out = []
    for _kind, item in nlmsg.attribute_values(expressions):
        name, data = "", {}
        for part, value in nlmsg.attribute_values(item):
            if part == 1:
                name = value.rstrip(b"\0").decode()
            elif part == 2:
                data = dict(nlmsg.attribute_values(value))
        out.append((name, data))
    return out


def _u32s(data: dict[int, bytes], *numbers: int) -> tuple[int, ...]:
    return tuple(struct.unpack(">I", data[n])[0] for n in numbers)


# What nft 1.0.6 writes for them (``nft --debug=netlink``): the payload write's source
# register, base, offset, length, checksum type, checksum offset and flags.
_WRITES = {
    "ip daddr": (1, 1, 16, 4, 1, 10, 1),
    "tcp dport": (1, 2, 2, 2, 1, 16, 0),
    "udp dport": (1, 2, 2, 2, 1, 6, 0),
    "sctp dport": (1, 2, 2, 2, 2, 8, 0),
}


@pytest.mark.parametrize("field", sorted(_WRITES))
def test_a_field_written_from_a_map_lookup_is_encoded_as_nft_encodes_it(field: str) -> None:
    key = "ct original ip daddr . meta l4proto . ct original proto-dst"
    name = "ci"
    if field != "ip daddr":
        key, name = "meta l4proto . ct original proto-dst", "cp"
    exprs = _expressions(_canonical_encoder().encode(f"{field} set {key} map @{name}").expressions)
    kinds = [kind for kind, _data in exprs]
    loads = ["ct", "meta", "ct"] if field == "ip daddr" else ["meta", "ct"]
    # A transport field: nft's implicit protocol match first.
    implied = [] if field == "ip daddr" else ["meta", "cmp"]
    assert kinds == [*implied, *loads, "lookup", "payload"]
    lookup, write = exprs[-2][1], exprs[-1][1]
    assert lookup[1].rstrip(b"\0") == name.encode()
    assert _u32s(lookup, 2, 3) == (1, 1)  # the key from register 1, the value into it
    assert _u32s(write, 5, 2, 3, 4, 6, 7, 8) == _WRITES[field]
    # The key's conntrack parts in the original direction (NFTA_CT_DIRECTION 0).
    assert all(data[3] == b"\0" for kind, data in exprs if kind == "ct")


def test_a_field_written_from_the_reply_direction_and_an_update_with_reply_values() -> None:
    rule = (
        "update @slots { ip daddr . meta l4proto . tcp dport . ip saddr timeout 60s : "
        "ct reply ip saddr . ct reply proto-src } ip daddr set ct reply ip saddr "
        "tcp dport set ct reply proto-src accept"
    )
    exprs = _expressions(_canonical_encoder().encode(rule).expressions)
    assert [kind for kind, _data in exprs] == [
        *("meta", "cmp", "payload", "meta", "payload", "payload"),  # the key, tcp matched
        *("ct", "ct", "dynset"),  # the value from the reply direction
        *("ct", "payload", "ct", "payload", "immediate"),  # the packet put back, accept
    ]
    reply = [data for kind, data in exprs if kind == "ct"]
    # ct reply ip saddr (NFT_CT_SRC_IP 19), ct reply proto-src (NFT_CT_PROTO_SRC 11), in
    # the value's registers 2 and 13 (as nft: the second 16-byte register on), then 1.
    assert [(_u32s(d, 1, 2), d[3]) for d in reply] == [
        ((2, 19), b"\1"),
        ((13, 11), b"\1"),
        ((1, 19), b"\1"),
        ((1, 11), b"\1"),
    ]
    assert _u32s(exprs[-2][1], 5, 7) == (1, 16)  # tcp dport written, its checksum at 16


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ("ip daddr set ip daddr . th dport", "a concatenation written into a field"),
        ("ip daddr set ip daddr . meta l4proto . th dport map @slots", "no single value"),
        ("th dport set ct reply proto-src", "'set' is not a number"),
    ],
)
def test_a_field_write_outside_the_vocabulary_is_refused(rule: str, words: str) -> None:
    with pytest.raises(NftError, match=words):
        _canonical_encoder().encode(rule)


@pytest.mark.parametrize(
    ("rule", "family", "words"),
    [
        ("tcp sport 80 accept", Family.IP, "unknown selector"),
        ("ip daddr 10.0.0.1 counter packets 1 bytes 2", Family.IP, "unexpected 'packets'"),
        ("ip6 daddr ::1 drop", Family.IP, "ip6 daddr in an ip table"),
        ("ip daddr fd00::1 drop", Family.IP, "is not an IPv4 address"),
        ("dnat to ip daddr map @missing", Family.IP, "set missing does not exist"),
        ("th dport 70000 drop", Family.IP, "70000 is out of range"),
        ("meta mark set meta mark and 0x1", Family.IP, "meta mark set ... and"),
        ("update @m { ip saddr timeout 3h : ip daddr }", Family.IP, "want seconds"),
        ("meta l4proto { tcp, udp } ip daddr . th dport 1 drop", Family.IP, "concatenation"),
        ("jump", Family.IP, "ends too early"),
    ],
)
def test_a_rule_outside_the_vocabulary_is_refused_naming_it(
    rule: str, family: Family, words: str
) -> None:
    with pytest.raises(NftError) as refused:
        _encoder(family).encode(rule)
    assert refused.value.errno in (errno.EINVAL, errno.ENOENT)
    assert words in str(refused.value)
    if refused.value.errno == errno.EINVAL:
        assert f"cannot encode rule {rule!r}" in str(refused.value)


# Transactions ---------------------------------------------------------------------------------


def test_a_transaction_is_its_messages_in_order() -> None:
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add(Table(comment="rules for kube-proxy"))
    tx.add(Set("frontends", "ipv4_addr . inet_proto . inet_service"))
    tx.add(Chain("nat-prerouting", "nat", "prerouting", -100))
    tx.add_chain("services")
    tx.add_rule(
        "services", "meta l4proto { tcp, udp } ip daddr . meta l4proto . th dport @frontends accept"
    )
    tx.add_elements(
        "frontends", [((f"10.0.{i // 250}.{i % 250}", "tcp", "80"), ()) for i in range(5000)]
    )
    tx.flush(Chain("services"))
    tx.delete(Set("frontends", "ipv4_addr"))
    encoded = encode_transaction(tx, lambda name: (_ for _ in ()).throw(NftError(name, 2)))
    kinds = [m.kind for m in encoded.messages]
    # table, set, base chain, chain, the rule's anonymous set and its elements, the rule,
    # the elements (split below 48 KiB a message), the flush, the deletion.
    assert kinds[:7] == [0, 9, 3, 3, 9, 12, 6]
    elements = [m for m in encoded.messages if m.kind == 12][1:]
    assert len(elements) > 1 and all(len(m.body) < 64 * 1024 for m in elements)
    assert kinds[-2:] == [8, 11]
    assert encoded.deleted == frozenset({"frontends"}) and not encoded.table_deleted
    assert (
        encoded.messages[0].what == 'add table ip kube-proxy { comment "rules for kube-proxy" ; }'
    )


def test_an_invalid_transaction_encodes_nothing() -> None:
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add_rule("c", "drop; flush ruleset")
    with pytest.raises(NftError, match="contains ';'"):
        encode_transaction(tx, lambda name: SLOTS)


def test_deletions_by_name_need_no_declaration_and_go_after_the_rules_by_handle() -> None:
    tx = Transaction(Family.IP, "nat")
    tx.flush(Chain("KUBE-SVC-A"))
    tx.delete_chain("KUBE-SVC-A")
    tx.delete(Map("service-ips", "ipv4_addr . inet_proto . inet_service : verdict"))
    messages = deletion_messages(tx, rules=[("PREROUTING", 7)])
    # The jump by its handle, the flush, the chain, the map: DELRULE, DELRULE, DELCHAIN, DELSET.
    assert [m.kind for m in messages] == [8, 8, 5, 11]
    assert messages[0].what == "delete rule ip nat PREROUTING handle 7"
    attrs = dict(nlmsg.attribute_values(messages[0].body))
    assert struct.unpack(">Q", attrs[3]) == (7,)
    assert nlmsg.string("PREROUTING") == attrs[2]
    refused = messages[2].refusal(errno.EBUSY, None, "")
    assert str(refused).startswith("delete chain ip nat KUBE-SVC-A: Device or resource busy")
    assert refused.errno == errno.EBUSY


def test_a_deletion_batch_refuses_anything_but_flushes_and_deletions() -> None:
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add_chain("services")
    with pytest.raises(NftError, match="add chain ip kube-proxy services: not a flush"):
        deletion_messages(tx)
    bad = Transaction(Family.IP, "kube-proxy")
    bad.delete_chain("a;b")
    with pytest.raises(NftError):
        deletion_messages(bad)
    with pytest.raises(NftError):
        deletion_messages(Transaction(Family.IP, "nat"), rules=[("PRE ROUTING", 1)])
