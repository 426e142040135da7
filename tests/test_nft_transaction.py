"""Transaction: validation when queued, error latching, and the exact `nft -f` text."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.backends.nftables.fake import parse_commands
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
)
from kubeproxy.backends.nftables.transaction import NftObject, Transaction, render_operation

Queue = Callable[[Transaction], None]

SVC = "service-ULMVA6XW-ns1/svc1/tcp/p80"
EP = "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
SERVICE_IPS = Map(
    "service-ips",
    "ipv4_addr . inet_proto . inet_service : verdict",
    comment="ClusterIP, ExternalIP and LoadBalancer IP traffic",
)


def test_render_golden() -> None:
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add(Table(comment="rules for kube-proxy"))
    tx.add(Chain("nat-prerouting", type="nat", hook="prerouting", priority=-100))
    tx.add(Chain("filter-input", type="filter", hook="input", priority=0, policy="accept"))
    tx.add(Chain("reject-chain", comment="helper for @no-endpoint-services"))
    tx.add(Chain(SVC))
    tx.flush(Chain(SVC))
    tx.add(SERVICE_IPS)
    tx.add(Set("cluster-ips", "ipv4_addr", comment="Active ClusterIPs"))
    tx.add(Set("affinity", "ipv4_addr . ipv4_addr", flags=("dynamic", "timeout"), timeout=10800))
    tx.add(Set("ranges", "ipv4_addr", flags=("interval",), size=65535))
    tx.add(Rule("nat-prerouting", "jump services"))
    tx.add(Rule("cluster-ips-check", "ip daddr @cluster-ips reject", comment="Reject traffic"))
    tx.insert(Rule(SVC, "ip daddr 172.30.0.41 jump mark-for-masquerade"))
    tx.add(Element("cluster-ips", ("172.30.0.41",)))
    tx.add(
        Element(
            "service-ips",
            ("172.30.0.41", "tcp", "80"),
            (f"goto {SVC}",),
            comment="ns1/svc1:p80",
            is_map=True,
        )
    )
    tx.add(Element("affinity", ("10.0.0.1", "10.180.0.1"), timeout=60))
    tx.create(Element("ranges", ("10.0.0.0/8",)))
    tx.delete(Element("service-ips", ("172.30.0.42", "udp", "53"), ("drop",), is_map=True))
    tx.flush(SERVICE_IPS)
    tx.delete(Set("ranges", "ipv4_addr"))
    tx.delete(Chain(EP))
    tx.flush(Table())
    tx.delete(Table())
    tx.create(Table())
    assert tx.error is None
    assert tx.render() == (
        'add table ip kube-proxy { comment "rules for kube-proxy" ; }\n'
        "add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }\n"
        "add chain ip kube-proxy filter-input"
        " { type filter hook input priority 0 ; policy accept ; }\n"
        'add chain ip kube-proxy reject-chain { comment "helper for @no-endpoint-services" ; }\n'
        f"add chain ip kube-proxy {SVC}\n"
        f"flush chain ip kube-proxy {SVC}\n"
        "add map ip kube-proxy service-ips"
        " { type ipv4_addr . inet_proto . inet_service : verdict ;"
        ' comment "ClusterIP, ExternalIP and LoadBalancer IP traffic" ; }\n'
        'add set ip kube-proxy cluster-ips { type ipv4_addr ; comment "Active ClusterIPs" ; }\n'
        "add set ip kube-proxy affinity"
        " { type ipv4_addr . ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }\n"
        "add set ip kube-proxy ranges { type ipv4_addr ; flags interval ; size 65535 ; }\n"
        "add rule ip kube-proxy nat-prerouting jump services\n"
        "add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject"
        ' comment "Reject traffic"\n'
        f"insert rule ip kube-proxy {SVC} ip daddr 172.30.0.41 jump mark-for-masquerade\n"
        "add element ip kube-proxy cluster-ips { 172.30.0.41 }\n"
        "add element ip kube-proxy service-ips"
        f' {{ 172.30.0.41 . tcp . 80 comment "ns1/svc1:p80" : goto {SVC} }}\n'
        "add element ip kube-proxy affinity { 10.0.0.1 . 10.180.0.1 timeout 60s }\n"
        "create element ip kube-proxy ranges { 10.0.0.0/8 }\n"
        "delete element ip kube-proxy service-ips { 172.30.0.42 . udp . 53 }\n"
        "flush map ip kube-proxy service-ips\n"
        "delete set ip kube-proxy ranges\n"
        f"delete chain ip kube-proxy {EP}\n"
        "flush table ip kube-proxy\n"
        "delete table ip kube-proxy\n"
        "create table ip kube-proxy\n"
    )
    assert tx.num_operations == len(tx) == 24
    assert str(tx) == tx.render()


def test_ip6_and_inet_prefixes() -> None:
    for family in (Family.IP6, Family.INET):
        tx = Transaction(family, "kube-proxy")
        tx.add_element("cluster-ips", ("fd00:10:96::1",))
        assert tx.render() == f"add element {family} kube-proxy cluster-ips {{ fd00:10:96::1 }}\n"


def test_fast_paths_match_the_object_paths() -> None:
    fast = Transaction(Family.IP, "kube-proxy")
    slow = Transaction(Family.IP, "kube-proxy")
    fast.add_chain(SVC)
    slow.add(Chain(SVC))
    fast.add_chain("reject-chain", comment="helper")
    slow.add(Chain("reject-chain", comment="helper"))
    fast.flush_chain(SVC)
    slow.flush(Chain(SVC))
    fast.add_rule(SVC, "meta l4proto tcp dnat to 10.180.0.1:80")
    slow.add(Rule(SVC, "meta l4proto tcp dnat to 10.180.0.1:80"))
    fast.add_rule(SVC, "jump x", "why")
    slow.add(Rule(SVC, "jump x", "why"))
    fast.add_element("service-ips", ("1.2.3.4", "tcp", "80"), (f"goto {SVC}",), True, "c")
    slow.add(Element("service-ips", ("1.2.3.4", "tcp", "80"), (f"goto {SVC}",), "c", True))
    fast.add_element("no-endpoint-services", ("1.2.3.4", "tcp", "81"), ("drop",))
    slow.add(Element("no-endpoint-services", ("1.2.3.4", "tcp", "81"), ("drop",), is_map=True))
    fast.add_element("cluster-ips", ("1.2.3.4",))
    slow.add(Element("cluster-ips", ("1.2.3.4",)))
    fast.delete_element("service-ips", ("1.2.3.4", "tcp", "80"))
    slow.delete(Element("service-ips", ("1.2.3.4", "tcp", "80")))
    fast.delete_chain(EP)
    slow.delete(Chain(EP))
    assert fast.error is None and slow.error is None
    assert fast.render() == slow.render()
    assert fast.operations() == slow.operations()


def test_operations_are_typed_objects_in_order() -> None:
    tx = Transaction(Family.IP, "t")
    base = Chain("nat-output", type="nat", hook="output", priority=-100)
    tx.add(Table())
    tx.add(base)
    tx.add_chain("c", comment="x")
    tx.add_rule("c", "counter")
    tx.insert(Rule("c", "accept", "first"))
    tx.add_element("m", ("1.1.1.1",), ("goto c",))
    tx.delete(Chain("nat-output", type="nat", hook="output", priority=-90))
    assert list(tx.operations()) == [
        ("add", Table()),
        ("add", base),
        ("add", Chain("c", comment="x")),
        ("add", Rule("c", "counter")),
        ("insert", Rule("c", "accept", "first")),
        ("add", Element("m", ("1.1.1.1",), ("goto c",), is_map=True)),
        ("delete", Chain("nat-output")),
    ]


def test_delete_needs_only_names() -> None:
    """Deleting must not fail because of stale properties of the object."""
    tx = Transaction(Family.IP, "t")
    tx.delete(Chain("old", type="nat", hook="prerouting", priority=-100, comment="x" * 200))
    tx.delete(Map("m", "not a type"))
    tx.flush(Set("s", "bogus", flags=("weird",)))
    tx.delete(Element("m", ("1.1.1.1",), ("goto c",), is_map=True))
    assert tx.error is None
    assert tx.render() == (
        "delete chain ip t old\n"
        "delete map ip t m\n"
        "flush set ip t s\n"
        "delete element ip t m { 1.1.1.1 }\n"
    )


def test_render_chunks_bound_the_text_held_at_once() -> None:
    tx = Transaction(Family.IP, "t")
    for i in range(2500):
        tx.add_rule("c", f"ip daddr 10.0.{i // 256}.{i % 256} accept")
    chunks = list(tx.render_chunks(1000))
    assert [chunk.count("\n") for chunk in chunks] == [1000, 1000, 500]
    assert "".join(chunks) == tx.render()
    assert list(Transaction(Family.IP, "t").render_chunks()) == []
    assert Transaction(Family.IP, "t").render() == ""


def test_elements_can_share_a_command() -> None:
    tx = Transaction(Family.IP, "t")
    for i in range(5):
        tx.add_element("s", (f"10.0.0.{i}",))
    tx.add_element("m", ("10.0.0.1",), ("drop",), comment="c, d")
    tx.add(Element("s", ("10.0.0.9",), timeout=5))
    tx.add_rule("c", "accept")
    tx.delete_element("s", ("10.0.0.1",))
    tx.delete_element("s", ("10.0.0.2",))
    tx.create(Element("s", ("10.0.0.3",)))
    assert "".join(tx.render_chunks(elements_per_line=3)) == (
        "add element ip t s { 10.0.0.0, 10.0.0.1, 10.0.0.2 }\n"
        "add element ip t s { 10.0.0.3, 10.0.0.4 }\n"
        'add element ip t m { 10.0.0.1 comment "c, d" : drop }\n'
        "add element ip t s { 10.0.0.9 timeout 5s }\n"
        "add rule ip t c accept\n"
        "delete element ip t s { 10.0.0.1, 10.0.0.2 }\n"
        "create element ip t s { 10.0.0.3 }\n"
    )
    # The default stays one command per operation.
    assert tx.render().count("\n") == len(tx) == 11
    # Chunks never split a command.
    chunks = list(tx.render_chunks(4, elements_per_line=64))
    assert chunks[0] == "add element ip t s { 10.0.0.0, 10.0.0.1, 10.0.0.2, 10.0.0.3 }\n"
    assert sum(len(parse_commands(chunk)) for chunk in chunks) == len(tx)


BAD_NAMES = [
    "",
    "5OJB2KTY",  # nft lexes a leading digit as a number
    "-x",
    "a b",
    "a;b",
    "a:b",  # nft accepts ':' only in names that look like IPv6 addresses
    "a{",
    'a"',
    "a\nb",
    "x" * 257,
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_names_are_refused_everywhere(name: str) -> None:
    queue: list[Queue] = [
        lambda tx: tx.add(Chain(name)),
        lambda tx: tx.add_chain(name),
        lambda tx: tx.flush_chain(name),
        lambda tx: tx.delete(Chain(name)),
        lambda tx: tx.add(Rule(name, "accept")),
        lambda tx: tx.add_rule(name, "accept"),
        lambda tx: tx.add(Set(name, "ipv4_addr")),
        lambda tx: tx.add(Map(name, "ipv4_addr : verdict")),
        lambda tx: tx.flush(Map(name, "ipv4_addr : verdict")),
        lambda tx: tx.add(Element(name, ("1.1.1.1",))),
        lambda tx: tx.add_element(name, ("1.1.1.1",)),
        lambda tx: tx.delete_element(name, ("1.1.1.1",)),
    ]
    for op in queue:
        tx = Transaction(Family.IP, "t")
        op(tx)
        assert tx.error is not None and tx.error.errno == errno.EINVAL
        assert len(tx) == 0
    assert Transaction(Family.IP, name).error is not None


def test_valid_names() -> None:
    tx = Transaction(Family.IP, "kube-proxy")
    for name in (SVC, EP, "_x", "a.b", "A-Z_09", "x" * 256):
        tx.add_chain(name)
    tx.add_chain("endpoint-X-ns/s/tcp/p__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80")
    assert tx.error is None, tx.error
    assert len(tx) == 7


@pytest.mark.parametrize("comment", ["x" * 129, 'say "hi"', "two\nlines", "cr\r", 42])
def test_invalid_comments(comment: Any) -> None:
    ops: list[Queue] = [
        lambda tx: tx.add(Table(comment=comment)),
        lambda tx: tx.add(Chain("c", comment=comment)),
        lambda tx: tx.add_chain("c", comment=comment),
        lambda tx: tx.add_rule("c", "accept", comment),
        lambda tx: tx.add(Set("s", "ipv4_addr", comment=comment)),
        lambda tx: tx.add_element("s", ("1.1.1.1",), comment=comment),
    ]
    for op in ops:
        tx = Transaction(Family.IP, "t")
        op(tx)
        assert tx.error is not None, comment
        assert len(tx) == 0


def test_comment_limits_are_inclusive() -> None:
    tx = Transaction(Family.IP, "t")
    tx.add_rule("c", "accept", "x" * 128)
    tx.add_element("s", ("1.1.1.1",), comment="ns/svc:port with spaces; and, commas")
    assert tx.error is None


@pytest.mark.parametrize(
    "rule", ["", "   ", "accept; flush ruleset", "accept\nflush ruleset", "accept\r", None, 7]
)
def test_invalid_rule_text(rule: Any) -> None:
    ops: list[Queue] = [
        lambda tx: tx.add_rule("c", rule),
        lambda tx: tx.add_rules("c", [rule]),
        lambda tx: tx.add(Rule("c", rule)),
        lambda tx: tx.insert(Rule("c", rule)),
    ]
    for op in ops:
        tx = Transaction(Family.IP, "t")
        op(tx)
        assert tx.error is not None and tx.error.errno == errno.EINVAL
        assert len(tx) == 0


def test_bulk_forms_queue_like_single_ones() -> None:
    bulk = Transaction(Family.IP, "t")
    single = Transaction(Family.IP, "t")
    rules = ["ip daddr 10.0.0.1 accept", "numgen random mod 2 0 drop", "drop"]
    bulk.add_rules("c", rules)
    for rule in rules:
        single.add_rule("c", rule)
    items = [(("10.0.0.1", "tcp", "80"), ("goto c",)), (("10.0.0.2", "tcp", "80"), ("drop",))]
    bulk.add_elements("m", items)
    bulk.add_elements("s", [(("10.0.0.1",), ())])
    for key, value in items:
        single.add_element("m", key, value)
    single.add_element("s", ("10.0.0.1",))
    assert bulk.error is None and single.error is None
    assert bulk.operations() == single.operations()
    assert bulk.render() == single.render()
    bad = Transaction(Family.IP, "t")
    bad.add_rules("bad name!", ["accept"])
    assert bad.error is not None and len(bad) == 0
    bad = Transaction(Family.IP, "t")
    bad.add_elements("bad name!", items)
    assert bad.error is not None and len(bad) == 0


BAD_PARTS: list[object] = [
    (),
    ("",),
    (" ",),
    (" 1.1.1.1",),
    ("1.1.1.1 ",),
    ("a  b",),
    ("1.1.1.1", ""),
    ("1.1.1.1}",),
    ("{1.1.1.1",),
    ("1.1.1.1,2.2.2.2",),
    ("1.1.1.1;",),
    ("1.1.1.1\n",),
    ("1.1.1.1 # hidden",),
    ('"eth0"',),
    ("1.1.1.1 . tcp",),  # a concatenation smuggled into one part
    ("1.1.1.1 : goto x",),  # a value smuggled into a key
    (".",),
    ("1.1.1.1", 80),
    ["1.1.1.1"],
    "1.1.1.1",
]


@pytest.mark.parametrize("key", BAD_PARTS)
def test_invalid_element_keys(key: Any) -> None:
    ops: list[Queue] = [
        lambda tx: tx.add_element("s", key),
        lambda tx: tx.add(Element("s", key)),
        lambda tx: tx.delete_element("s", key),
        lambda tx: tx.add_element("m", ("1.1.1.1",), key, True),
        lambda tx: tx.add_elements("s", [(key, ())]),
    ]
    for op in ops:
        tx = Transaction(Family.IP, "t")
        op(tx)
        assert tx.error is not None and tx.error.errno == errno.EINVAL, key
        assert len(tx) == 0


def test_element_value_rules() -> None:
    tx = Transaction(Family.IP, "t")
    tx.add_element("m", ("1.1.1.1",), (), True)
    assert tx.error is not None and "empty" in str(tx.error)
    tx = Transaction(Family.IP, "t")
    tx.add_element("s", ("1.1.1.1",), ("drop",), False)
    assert tx.error is not None and "value" in str(tx.error)
    tx = Transaction(Family.IP, "t")
    tx.add(Element("s", ("1.1.1.1",), ("drop",)))
    assert tx.error is not None
    tx = Transaction(Family.IP, "t")
    tx.add(Element("s", ("1.1.1.1",), timeout=0))
    assert tx.error is not None
    tx = Transaction(Family.IP, "t")
    tx.add_element("m", ("fd00::1", "tcp", "80"), ("goto a/b.c_d-e",))
    tx.add_element("s", ("10.0.0.0/8",))
    tx.add_element("s", ("10.0.0.1-10.0.0.9",))
    tx.add_element("m", ("1.1.1.1",), ("2.2.2.2", "8080"), True)
    assert tx.error is None


@pytest.mark.parametrize(
    "obj",
    [
        Chain("c", hook="prerouting", priority=-100),  # no type
        Chain("c", type="nat", hook="prerouting"),  # no priority
        Chain("c", type="nat", hook="sideways", priority=0),
        Chain("c", type="mangle", hook="output", priority=0),
        Chain("c", type="nat", hook="output", priority=2**31),
        Chain("c", type="nat"),  # type without hook
        Chain("c", policy="drop"),  # policy without hook
        Chain("c", type="filter", hook="input", priority=0, policy="reject"),
        Set("s", "ipv4_addr : verdict"),
        Set("s", ""),
        Set("s", "ipv4_addr . "),
        Set("s", "ipv4_addr", flags=("bogus",)),
        Set("s", "ipv4_addr", flags=("interval", "interval")),
        Set("s", "ipv4_addr", flags="interval"),  # type: ignore[arg-type]
        Set("s", "ipv4_addr", timeout=0),
        Set("s", "ipv4_addr", timeout=-5),
        Set("s", "ipv4_addr", size=0),
        Map("m", "ipv4_addr"),
        Map("m", "ipv4_addr : "),
        Map("m", "ipv4_addr: verdict"),
        Map("m", "ipv4_addr : verdict", timeout=True),
    ],
)
def test_invalid_objects(obj: NftObject) -> None:
    tx = Transaction(Family.IP, "t")
    tx.add(obj)
    assert tx.error is not None and tx.error.errno == errno.EINVAL
    with pytest.raises(NftError):
        obj.validate()


def test_verbs_that_do_not_apply() -> None:
    def fails(op: object) -> str:
        tx = Transaction(Family.IP, "t")
        op(tx)  # type: ignore[operator]
        assert tx.error is not None and len(tx) == 0
        return str(tx.error)

    assert "handle" in fails(lambda tx: tx.delete(Rule("c", "accept")))
    fails(lambda tx: tx.create(Rule("c", "accept")))
    fails(lambda tx: tx.flush(Rule("c", "accept")))
    fails(lambda tx: tx.flush(Element("s", ("1.1.1.1",))))
    fails(lambda tx: tx.insert(Chain("c")))
    fails(lambda tx: tx.add("add table ip t"))
    fails(lambda tx: tx.add(None))


def test_first_error_is_latched_and_later_operations_ignored() -> None:
    tx = Transaction(Family.IP, "t")
    tx.add_chain("good")
    tx.add_rule("good", "bad; rule")
    first = tx.error
    assert first is not None and "bad; rule" in str(first)
    tx.add_chain("another-good")
    tx.add(Chain("9-also-bad"))
    tx.add_element("s", ("1.1.1.1",))
    tx.delete(Table())
    assert tx.error is first
    assert len(tx) == 1
    assert tx.render() == "add chain ip t good\n"


def test_constructor_errors_are_latched() -> None:
    tx = Transaction("bridge", "t")  # type: ignore[arg-type]
    assert tx.error is not None
    tx.add_chain("c")
    assert len(tx) == 0
    assert Transaction(Family.IP, "9t").error is not None
    assert Transaction("ip6", "t").family is Family.IP6  # type: ignore[arg-type]


def test_render_operation_matches_transaction_text() -> None:
    tx = Transaction(Family.IP6, "kube-proxy")
    objs: list[NftObject] = [
        Table(comment="c"),
        Chain("nat-output", type="nat", hook="output", priority=-100),
        Set("s", "ipv6_addr", flags=("interval",)),
        SERVICE_IPS,
        Rule("c", "accept", "x"),
        Element("m", ("fd00::1", "tcp", "80"), ("goto c",), "k", True),
    ]
    for obj in objs:
        tx.add(obj)
    expected = "".join(
        render_operation(Family.IP6, "kube-proxy", "add", obj) + "\n" for obj in objs
    )
    assert tx.render() == expected


# Property: whatever valid operations are queued, the text parses back to the same ops.

_names = st.from_regex(r"[a-z_][a-z0-9_./-]{0,20}", fullmatch=True)
_comments = st.none() | st.from_regex(r"[a-zA-Z0-9 /:.,;_-]{0,30}", fullmatch=True)
_ipv4 = st.ip_addresses(v=4).map(str)
_parts = st.one_of(_ipv4, st.sampled_from(["tcp", "udp", "sctp"]), st.integers(0, 65535).map(str))
_verdicts = st.one_of(
    st.sampled_from(["drop", "accept", "return"]), _names.map(lambda n: f"goto {n}")
)


@st.composite
def _operations(draw: st.DrawFn) -> tuple[str, NftObject]:
    kind = draw(st.sampled_from(["table", "chain", "base", "rule", "set", "map", "element"]))
    obj: NftObject
    if kind == "table":
        obj = Table(draw(_comments))
    elif kind == "chain":
        obj = Chain(draw(_names), comment=draw(_comments))
    elif kind == "base":
        obj = Chain(
            draw(_names),
            type=draw(st.sampled_from(["filter", "nat"])),
            hook=draw(st.sampled_from(["prerouting", "input", "output", "postrouting"])),
            priority=draw(st.integers(-400, 400)),
            policy=draw(st.sampled_from([None, "accept", "drop"])),
            comment=draw(_comments),
        )
    elif kind == "rule":
        text = draw(st.sampled_from(["accept", "ip daddr 1.2.3.4 counter drop", "jump x"]))
        return draw(st.sampled_from(["add", "insert"])), Rule(draw(_names), text, draw(_comments))
    elif kind in ("set", "map"):
        flags = tuple(
            draw(st.lists(st.sampled_from(["interval", "timeout", "dynamic"]), unique=True))
        )
        args = (
            flags,
            draw(st.none() | st.integers(1, 10**6)),
            draw(st.none() | st.integers(1, 10**6)),
        )
        if kind == "set":
            obj = Set(draw(_names), "ipv4_addr . inet_service", *args, draw(_comments))
        else:
            obj = Map(draw(_names), "ipv4_addr : verdict", *args, draw(_comments))
    else:
        key = tuple(draw(st.lists(_parts, min_size=1, max_size=3)))
        if draw(st.booleans()):
            obj = Element(draw(_names), key, (draw(_verdicts),), draw(_comments), True)
        else:
            timeout = draw(st.none() | st.integers(1, 1000))
            obj = Element(draw(_names), key, (), draw(_comments), False, timeout)
        verbs = ["add", "create", "delete"]
        verb = draw(st.sampled_from(verbs))
        if verb == "delete":
            obj = Element(obj.container, obj.key)
        return verb, obj
    verb = draw(st.sampled_from(["add", "create", "flush", "delete"]))
    if verb in ("flush", "delete") and isinstance(obj, Chain):
        obj = Chain(obj.name)
    return verb, obj


@settings(max_examples=100, deadline=None)
@given(st.lists(_operations(), max_size=12), st.sampled_from(list(Family)))
def test_rendered_text_parses_back_to_the_operations(
    ops: list[tuple[str, NftObject]], family: Family
) -> None:
    tx = Transaction(family, "kube-proxy")
    for verb, obj in ops:
        getattr(tx, verb)(obj)
    assert tx.error is None, tx.error
    text = tx.render()
    assert text.count("\n") == len(tx) == len(ops)
    parsed = parse_commands(text)
    assert [(f, t) for f, t, _, _ in parsed] == [(family, "kube-proxy")] * len(ops)
    expected = list(tx.operations())
    got = [(verb, obj) for _, _, verb, obj in parsed]
    for (verb, obj), (got_verb, got_obj) in zip(expected, got, strict=True):
        assert got_verb == verb
        if verb in ("flush", "delete") and not isinstance(obj, Element):
            assert type(got_obj) is type(obj)
            assert getattr(got_obj, "name", None) == getattr(obj, "name", None)
        else:
            assert got_obj == obj
