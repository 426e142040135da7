"""FakeNft: kernel-like checks, atomic runs, dumps; and the same cases on the real kernel.

Every case in ``CASES`` runs on the fake (unit test) and, in a network namespace, on the
kernel through LibNftables (kernel test): both must accept or refuse it alike (same errno
where the kernel reports one) and end up with the same chains, sets and elements.
"""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubeproxy.backends.nftables.exec import LibNftables, NftExecutor
from kubeproxy.backends.nftables.fake import FakeNft, parse_commands
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Rule,
    Set,
    Table,
    is_already_exists,
    is_busy,
    is_not_found,
)
from kubeproxy.backends.nftables.transaction import Transaction

T = (Family.IP, "t")
T6 = (Family.IP6, "t6")


def transactions(text: str) -> list[Transaction]:
    """Commands (as Transaction.render writes them) as transactions, one per table run."""
    txs: list[Transaction] = []
    for family, table, verb, obj in parse_commands(text):
        if not txs or (txs[-1].family, txs[-1].table) != (family, table):
            txs.append(Transaction(family, table))
        getattr(txs[-1], verb)(obj)
    for tx in txs:
        assert tx.error is None, tx.error
    return txs


def one_tx(text: str) -> Transaction:
    (tx,) = transactions(text)
    return tx


def state(ex: NftExecutor, tables: tuple[tuple[Family, str], ...] = (T, T6)) -> dict[Any, Any]:
    """What the executor lists: chains with comments, sets and maps, sorted elements."""
    out: dict[Any, Any] = {}
    for family, table in tables:
        if not ex.table_exists(family, table):
            out[(family, table)] = None
            continue
        sets = sorted(ex.list_sets(family, table))
        elements = {
            name: sorted(ex.list_elements(family, table, name), key=lambda e: (e.key, e.value))
            for name in sets
        }
        out[(family, table)] = (ex.list_chains(family, table), sets, elements)
    return out


BASE = """
add table ip t { comment "a" ; }
add chain ip t c { comment "cc" ; }
add chain ip t c2
add chain ip t c3
add chain ip t c4
add chain ip t c5
add chain ip t base { type nat hook prerouting priority -100 ; }
add set ip t s { type ipv4_addr ; comment "sc" ; }
add set ip t u { type ipv4_addr ; }
add set ip t ti { type ipv4_addr ; timeout 10s ; }
add set ip t iv { type ipv4_addr ; flags interval ; }
add set ip t pp { type inet_proto . inet_service ; size 2 ; }
add set ip t k { type ipv4_addr ; flags constant ; }
add map ip t m { type ipv4_addr : verdict ; }
add map ip t mm { type ipv4_addr : ipv4_addr . inet_service ; }
add map ip t um { type ipv4_addr . inet_proto . inet_service : verdict ; }
add rule ip t base ip daddr @s jump c
add rule ip t base ip daddr vmap @m
add rule ip t base ip saddr @k accept
add rule ip t c2 counter
add rule ip t c3 goto c4
add element ip t m { 1.1.1.1 : goto c }
add element ip t m { 3.3.3.3 : jump c5 }
add element ip t mm { 1.1.1.1 : 2.2.2.2 . 80 }
add element ip t s { 2.2.2.2 comment "x" }
add element ip t pp { tcp . 80 }
add table ip6 t6
add set ip6 t6 s6 { type ipv6_addr ; }
add element ip6 t6 s6 { fd00::1 }
"""


@dataclass(frozen=True)
class Case:
    """A transaction run on top of BASE, and the errno it must fail with (None: succeed);
    ``older``: the errno older kernels of the matrix answer instead, where it changed;
    ``accepted_since``: the kernel version from which the kernel accepts what the fake
    (as the matrix's oldest kernel) refuses."""

    id: str
    tx: str
    fails: int | None = None
    older: int | None = None
    accepted_since: tuple[int, int] | None = None


CASES = [
    # add of existing objects
    Case("add table again, other comment", 'add table ip t { comment "b" ; }'),
    Case("add chain again, other comment", 'add chain ip t c { comment "dd" ; }'),
    Case("add regular chain over a base chain", "add chain ip t base"),
    Case(
        "base chain, other priority",
        "add chain ip t base { type nat hook prerouting priority -90 ; }",
        errno.EOPNOTSUPP,
        older=errno.EEXIST,  # Debian 12's 6.1 (make test-kernels); 6.12 and 6.18 as the fake
    ),
    Case(
        "base chain, other hook",
        "add chain ip t base { type nat hook output priority -100 ; }",
        errno.EOPNOTSUPP,
        older=errno.EEXIST,  # Debian 12's 6.1 (make test-kernels); 6.12 and 6.18 as the fake
    ),
    Case(
        "base chain, other type",
        "add chain ip t base { type filter hook prerouting priority -100 ; }",
        errno.EEXIST,
    ),
    Case(
        "base chain over a regular one",
        "add chain ip t c { type filter hook prerouting priority -100 ; }",
        errno.EEXIST,
    ),
    Case(
        "base chain, new policy",
        "add chain ip t base { type nat hook prerouting priority -100 ; policy accept ; }",
    ),
    Case("set again, other comment", 'add set ip t s { type ipv4_addr ; comment "zz" ; }'),
    Case("set again, other type", "add set ip t s { type ipv6_addr ; }", errno.EEXIST),
    Case(
        "set again, other flags",
        "add set ip t s { type ipv4_addr ; flags interval ; }",
        errno.EEXIST,
    ),
    Case(
        "set again, with a timeout",
        "add set ip t s { type ipv4_addr ; timeout 10s ; }",
        errno.EEXIST,
    ),
    Case("set again, other timeout", "add set ip t ti { type ipv4_addr ; timeout 20s ; }"),
    Case("set again, other size", "add set ip t u { type ipv4_addr ; size 1000 ; }"),
    Case("map over a set", "add map ip t s { type ipv4_addr : verdict ; }", errno.EEXIST),
    Case("set over a map", "add set ip t m { type ipv4_addr ; }", errno.EEXIST),
    Case("map, other value type", "add map ip t m { type ipv4_addr : ipv4_addr ; }", errno.EEXIST),
    # create
    Case("create existing table", "create table ip t", errno.EEXIST),
    Case("create existing chain", "create chain ip t c", errno.EEXIST),
    Case("create existing set", "create set ip t s { type ipv4_addr ; }", errno.EEXIST),
    Case("create existing element", "create element ip t s { 2.2.2.2 }", errno.EEXIST),
    Case("create new objects", "create chain ip t fresh\ncreate element ip t s { 9.9.9.9 }"),
    # elements
    Case("element again, same value", "add element ip t m { 1.1.1.1 : goto c }"),
    Case("element again, other value", "add element ip t m { 1.1.1.1 : goto c2 }", errno.EEXIST),
    Case(
        "data map element, other value",
        "add element ip t mm { 1.1.1.1 : 3.3.3.3 . 80 }",
        errno.EEXIST,
    ),
    Case("element again, other comment", 'add element ip t s { 2.2.2.2 comment "y" }'),
    Case(
        "same element twice in one run",
        "add element ip t u { 5.5.5.5 }\nadd element ip t u { 5.5.5.5 }",
    ),
    Case(
        "same map key twice, other values",
        "add element ip t m { 7.7.7.7 : goto c }\nadd element ip t m { 7.7.7.7 : goto c2 }",
        errno.EEXIST,
    ),
    Case("delete a missing element", "delete element ip t s { 9.9.9.9 }", errno.ENOENT),
    Case(
        "delete and re-add with another value",
        "delete element ip t m { 1.1.1.1 }\nadd element ip t m { 1.1.1.1 : goto c2 }",
    ),
    Case("map element without a value", "add element ip t m { 8.8.8.8 }", errno.EINVAL),
    Case(
        "verdict map, non-verdict value", "add element ip t m { 8.8.8.8 : 1.2.3.4 }", errno.EINVAL
    ),
    Case(
        "verdict to a missing chain", "add element ip t m { 8.8.8.8 : goto nochain }", errno.ENOENT
    ),
    Case("verdict to a base chain", "add element ip t m { 8.8.8.8 : goto base }", errno.EOPNOTSUPP),
    Case("element of a missing set", "add element ip t nope { 1.1.1.1 }", errno.ENOENT),
    Case("prefix without flags interval", "add element ip t u { 10.0.0.0/8 }", errno.EINVAL),
    Case("prefix with host bits", "add element ip t iv { 10.0.0.1/8 }"),
    Case("range", "add element ip t iv { 192.168.1.1-192.168.1.5 }"),
    Case(
        "timeout without flags timeout", "add element ip t u { 1.1.1.1 timeout 10s }", errno.EINVAL
    ),
    # (Not "{ tcp }": nft 1.0.6 reads that as a header expression and stores "ip . 0".)
    Case("too few key parts", "add element ip t pp { 6 }", errno.EINVAL),
    Case("wrong key type", "add element ip t pp { tcp . 1.1.1.1 }", errno.EINVAL),
    Case("IPv6 address in an IPv4 set", "add element ip t u { fd00::1 }", errno.EINVAL),
    Case(
        "set full",
        "add element ip t pp { udp . 53 }\nadd element ip t pp { udp . 54 }",
        errno.ENFILE,
    ),
    Case("constant set in use", "add element ip t k { 1.1.1.1 }", errno.EBUSY),
    Case("port with a leading zero", "add element ip t pp { tcp . 080 }"),
    Case("concatenated verdict map", "add element ip t um { 10.0.0.1 . tcp . 80 : goto c }"),
    # The shared ClientIP affinity maps (issue 32): pin numbers as "numgen ... offset N",
    # IPv6 clients as a hash; entries written by the kernel, and by hand here.
    Case(
        "shared affinity map, its rules and an entry",
        "add map ip t aff { typeof numgen random mod 1 . numgen random mod 1 . ip saddr"
        " : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; }\n"
        "add chain ip t lk\n"
        "add rule ip t lk meta l4proto tcp dnat to numgen random mod 1 offset 7"
        " . numgen random mod 1 offset 8 . ip saddr map @aff\n"
        "add chain ip t rec\n"
        "add rule ip t rec update @aff { numgen random mod 1 offset 7 . numgen random mod 1"
        " offset 8 . ip saddr timeout 60s : ip daddr . th dport } return\n"
        "add rule ip t rec jump c2\n"
        "add element ip t aff { 7 . 8 . 10.0.0.5 : 10.180.0.1 . 8080 }",
    ),
    Case(
        "shared IPv6 affinity map keyed by a hash of the client",
        "add map ip6 t6 aff { typeof numgen random mod 1 . numgen random mod 1"
        " . numgen random mod 1 : ip6 daddr ; flags dynamic,timeout ; timeout 10800s ; }\n"
        "add chain ip6 t6 lk\n"
        "add rule ip6 t6 lk meta l4proto tcp dnat to numgen random mod 1 offset 7"
        " . numgen random mod 1 offset 8 . jhash ip6 saddr mod 4294967295 seed 0x0"
        " map @aff : 8080\n"
        "add chain ip6 t6 rec\n"
        "add rule ip6 t6 rec th dport 8080 update @aff { numgen random mod 1 offset 7"
        " . numgen random mod 1 offset 8 . jhash ip6 saddr mod 4294967295 seed 0x0"
        " timeout 60s : ip6 daddr } return\n"
        "add element ip6 t6 aff { 7 . 8 . 4294967294 : fd00:180::1 }",
    ),
    # flush and delete
    Case("delete a chain with rules", "delete chain ip t c2"),
    Case("delete a chain a rule jumps to", "delete chain ip t c4", errno.EBUSY),
    Case("delete a chain a map element names", "delete chain ip t c5", errno.EBUSY),
    Case(
        "delete a chain after its map element",
        "delete element ip t m { 3.3.3.3 }\ndelete chain ip t c5",
    ),
    Case("delete a chain after flushing its user", "flush chain ip t c3\ndelete chain ip t c4"),
    Case("delete a missing chain", "delete chain ip t nope", errno.ENOENT),
    Case("flush a missing chain", "flush chain ip t nope", errno.ENOENT),
    Case("flush a missing set", "flush set ip t nope", errno.ENOENT),
    Case("flush a set as a map", "flush map ip t s", errno.ENOENT),
    Case("flush a map", "flush map ip t m\ndelete chain ip t c5"),
    Case("delete a set a rule uses", "delete set ip t s", errno.EBUSY),
    Case("delete a map a rule uses", "delete map ip t m", errno.EBUSY),
    Case("delete an unused set", "delete set ip t u"),
    Case("delete an unused map as a set", "delete set ip t mm"),
    Case("delete a set after flushing its user", "flush chain ip t base\ndelete set ip t s"),
    Case(
        "delete a map and then its chains",
        "flush chain ip t base\ndelete map ip t m\ndelete chain ip t c5",
    ),
    Case(
        "flush table keeps sets and elements", "flush table ip t\ndelete chain ip t c5", errno.EBUSY
    ),
    Case("flush table empties chains", "flush table ip t\ndelete chain ip t c4\ndelete set ip t s"),
    Case("delete a missing table", "delete table ip nope", errno.ENOENT),
    Case("flush a missing table", "flush table ip nope", errno.ENOENT),
    Case("delete a table with everything", "delete table ip t"),
    Case("delete and re-create a table", "delete table ip t\nadd table ip t\nadd chain ip t x"),
    Case(
        "delete and re-create a base chain",
        "delete chain ip t base\nadd chain ip t base { type nat hook prerouting priority -90 ; }",
    ),
    Case("add and delete a chain in one run", "add chain ip t tmp\ndelete chain ip t tmp"),
    # rules
    Case("rule naming a missing set", "add rule ip t c ip daddr @nope accept", errno.ENOENT),
    Case("rule in a missing chain", "add rule ip t nope accept", errno.ENOENT),
    Case("rule jumping to a missing chain", "add rule ip t c jump nope", errno.ENOENT),
    Case("rule jumping to a base chain", "add rule ip t c jump base", errno.EOPNOTSUPP),
    Case("self jump outside any base chain", "add rule ip t c2 jump c2"),
    Case("loop not reachable from a base chain", "add rule ip t c4 goto c3"),
    Case("loop through a verdict map", "add rule ip t c ip daddr vmap @m", errno.EMLINK),
    Case("vmap on a set", "add rule ip t c ip daddr vmap @u", errno.EINVAL),
    # Debian 12's 6.1 (make test-kernels) refuses a map lookup without a value.
    Case("map read as a set", "add rule ip t c ip daddr @mm accept", errno.EINVAL, None, (6, 5)),
    Case(
        "map read as a set, inverted",
        "add rule ip t c ip daddr != @mm accept",
        errno.EINVAL,
        accepted_since=(6, 5),
    ),
    Case("map read for its value", "add rule ip t c meta l4proto tcp dnat to ip saddr map @mm"),
    Case(
        "anonymous vmap targets",
        "add rule ip t c numgen random mod 2 vmap { 0 : goto c2, 1 : goto c3 }",
    ),
    Case(
        "anonymous vmap to a missing chain",
        "add rule ip t c numgen random mod 2 vmap { 0 : goto c2, 1 : goto zz }",
        errno.ENOENT,
    ),
    Case(
        "comment words are not references",
        'add rule ip t c counter comment "jump nowhere @nothing"',
    ),
    # other tables
    Case("chain in a missing table", "add chain ip nope c", errno.ENOENT),
    Case(
        "IPv6 canonical form",
        "add element ip6 t6 s6 { fd00:0::0002 }\n"
        "delete element ip6 t6 s6 { fd00::2 }\n"
        "delete element ip6 t6 s6 { FD00::1 }",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fake_case(case: Case) -> None:
    fake = FakeNft()
    for tx in transactions(BASE):
        fake.run(tx)
    before = fake.dump()
    txs = transactions(case.tx)
    if case.fails is None:
        for tx in txs:
            fake.run(tx)
        return
    assert len(txs) == 1
    with pytest.raises(NftError) as caught:
        fake.run(txs[0])
    assert caught.value.errno == case.fails, caught.value
    assert fake.dump() == before, "a refused transaction changed the state"


def test_case_outcomes_are_visible_in_the_state() -> None:
    """Spot checks that the successful cases did what they say (not only 'no error')."""

    def after(text: str) -> FakeNft:
        fake = FakeNft()
        for tx in transactions(BASE + text):
            fake.run(tx)
        return fake

    assert after('add chain ip t c { comment "dd" ; }').list_chains(*T)["c"] == "cc"
    assert (
        "policy drop"
        in after(
            "add chain ip t base { type nat hook prerouting priority -100 ; policy drop ; }"
        ).dump()
    )
    assert "size 1000" in after("add set ip t u { type ipv4_addr ; size 1000 ; }").dump()
    assert "timeout 20s" in after("add set ip t ti { type ipv4_addr ; timeout 20s ; }").dump()
    assert after('add element ip t s { 2.2.2.2 comment "y" }').list_elements(*T, "s") == [
        Element("s", ("2.2.2.2",), comment="x")
    ]
    assert "c2" not in after("delete chain ip t c2").list_chains(*T)
    assert after("add element ip t iv { 10.0.0.1/8 }").list_elements(*T, "iv")[0].key == (
        "10.0.0.0/8",
    )
    assert after("add element ip t pp { tcp . 080 }").list_elements(*T, "pp")[-1].key == (
        "tcp",
        "80",
    )
    flushed = after("flush table ip t")
    assert "add rule" not in flushed.dump()
    assert flushed.list_elements(*T, "m")
    assert after("delete table ip t").table_exists(*T) is False
    replaced = after("delete element ip t m { 1.1.1.1 }\nadd element ip t m { 1.1.1.1 : goto c2 }")
    assert Element("m", ("1.1.1.1",), ("goto c2",), is_map=True) in replaced.list_elements(*T, "m")
    assert not after("flush map ip t m").list_elements(*T, "m")


def test_run_is_atomic_and_recorded() -> None:
    fake = FakeNft()
    setup = one_tx("add table ip t\nadd chain ip t c")
    fake.run(setup)
    before = fake.dump()
    bad = one_tx("add chain ip t d\nadd rule ip t d accept\nadd rule ip t c jump absent")
    with pytest.raises(NftError) as caught:
        fake.run(bad)
    assert is_not_found(caught.value)
    assert "add rule ip t c jump absent" in str(caught.value)
    assert fake.dump() == before
    assert fake.transactions == [setup, bad]


def test_check_applies_nothing() -> None:
    fake = FakeNft()
    tx = one_tx("add table ip t\nadd chain ip t c")
    fake.check(tx)
    assert not fake.table_exists(*T)
    with pytest.raises(NftError):
        fake.check(one_tx("add table ip t\nadd rule ip t c accept"))
    assert fake.transactions == []


def test_fail_next_refuses_one_run() -> None:
    fake = FakeNft()
    fake.fail_next = NftError("injected", errno.EPERM)
    tx = one_tx("add table ip t")
    with pytest.raises(NftError, match="injected"):
        fake.run(tx)
    assert not fake.table_exists(*T)
    fake.run(tx)
    assert fake.table_exists(*T)
    assert fake.fail_next is None


def test_latched_error_is_raised_without_applying() -> None:
    fake = FakeNft()
    tx = Transaction(Family.IP, "t")
    tx.add(Table())
    tx.add_rule("c", "bad; rule")
    with pytest.raises(NftError) as caught:
        fake.run(tx)
    assert caught.value is tx.error
    assert not fake.table_exists(*T)


def test_error_helpers() -> None:
    fake = FakeNft()
    fake.run(one_tx("add table ip t\nadd chain ip t c\nadd chain ip t d\nadd rule ip t c jump d"))
    with pytest.raises(NftError) as caught:
        fake.run(one_tx("add table ip t\ncreate chain ip t c"))
    assert is_already_exists(caught.value) and not is_not_found(caught.value)
    with pytest.raises(NftError) as caught:
        fake.run(one_tx("delete chain ip t d"))
    assert is_busy(caught.value)


def test_dump_is_sorted_and_loadable() -> None:
    fake = FakeNft()
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add(Table(comment="rules for kube-proxy"))
    tx.add_chain("zeta")
    tx.add_chain("alpha", comment="first")
    tx.add(Chain("nat-output", type="nat", hook="output", priority=-100))
    tx.add(Map("service-ips", "ipv4_addr . inet_proto . inet_service : verdict"))
    tx.add(Set("cluster-ips", "ipv4_addr"))
    tx.add_rule("zeta", "counter")
    tx.add_rule("nat-output", "ip daddr . meta l4proto . th dport vmap @service-ips")
    tx.add_rule("alpha", "ip daddr @cluster-ips accept", "known")
    tx.insert(Rule("alpha", "counter"))
    tx.add_element("service-ips", ("10.0.0.2", "tcp", "80"), ("goto zeta",), comment="b")
    tx.add_element("service-ips", ("10.0.0.1", "udp", "53"), ("goto alpha",))
    tx.add_element("cluster-ips", ("10.0.0.2",))
    tx.add_element("cluster-ips", ("10.0.0.1",))
    fake.run(tx)
    other = Transaction(Family.IP6, "other")
    other.add(Table())
    fake.run(other)
    expected = (
        'add table ip kube-proxy { comment "rules for kube-proxy" ; }\n'
        'add chain ip kube-proxy alpha { comment "first" ; }\n'
        "add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }\n"
        "add chain ip kube-proxy zeta\n"
        "add set ip kube-proxy cluster-ips { type ipv4_addr ; }\n"
        "add map ip kube-proxy service-ips"
        " { type ipv4_addr . inet_proto . inet_service : verdict ; }\n"
        "add rule ip kube-proxy alpha counter\n"
        'add rule ip kube-proxy alpha ip daddr @cluster-ips accept comment "known"\n'
        "add rule ip kube-proxy nat-output ip daddr . meta l4proto . th dport vmap @service-ips\n"
        "add rule ip kube-proxy zeta counter\n"
        "add element ip kube-proxy cluster-ips { 10.0.0.1 }\n"
        "add element ip kube-proxy cluster-ips { 10.0.0.2 }\n"
        "add element ip kube-proxy service-ips { 10.0.0.1 . udp . 53 : goto alpha }\n"
        'add element ip kube-proxy service-ips { 10.0.0.2 . tcp . 80 comment "b" : goto zeta }\n'
    )
    assert fake.dump(Family.IP, "kube-proxy") == expected
    assert fake.dump(Family.IP) == expected
    assert fake.dump() == expected + "add table ip6 other\n"
    assert fake.dump(table="other") == "add table ip6 other\n"
    assert fake.run_text("list table ip kube-proxy") == expected
    # Insertion order is kept for listing.
    assert [e.key[0] for e in fake.list_elements(Family.IP, "kube-proxy", "cluster-ips")] == [
        "10.0.0.2",
        "10.0.0.1",
    ]
    reloaded = FakeNft()
    assert reloaded.run_text(fake.dump()) == ""
    assert reloaded.dump() == fake.dump()
    assert reloaded.run_text("list ruleset") == fake.dump()


def test_listing_missing_things() -> None:
    fake = FakeNft()
    assert fake.list_chains(*T) == {}
    assert fake.list_sets(*T) == []
    assert fake.table_exists(*T) is False
    with pytest.raises(NftError) as caught:
        fake.list_elements(*T, "s")
    assert is_not_found(caught.value)
    with pytest.raises(NftError):
        fake.run_text("list table ip t")
    with pytest.raises(NftError):
        fake.run_text("list chains")
    with pytest.raises(NftError):
        fake.run_text("frobnicate table ip t")
    assert fake.version() == "1.0.6"


def test_jump_depth_limit() -> None:
    def chain_of(n: int, verb: str = "jump") -> str:
        lines = ["add table ip t", "add chain ip t base { type filter hook input priority 0 ; }"]
        lines += [f"add chain ip t c{i}" for i in range(1, n + 1)]
        lines.append("add rule ip t base jump c1")
        lines += [f"add rule ip t c{i} {verb} c{i + 1}" for i in range(1, n)]
        return "\n".join(lines)

    for verb in ("jump", "goto"):
        FakeNft().run(one_tx(chain_of(15, verb)))
        with pytest.raises(NftError) as caught:
            FakeNft().run(one_tx(chain_of(16, verb)))
        assert caught.value.errno == errno.EMLINK
    # A loop that is formed and broken again within one run is fine.
    fake = FakeNft()
    fake.run(one_tx(chain_of(3)))
    fake.run(one_tx("add rule ip t c3 jump c1\nflush chain ip t c3"))
    # Through a verdict map.
    fake.run(
        one_tx("add map ip t m { type ipv4_addr : verdict ; }\nadd rule ip t c3 ip daddr vmap @m")
    )
    with pytest.raises(NftError) as caught:
        fake.run(one_tx("add element ip t m { 1.1.1.1 : goto c1 }"))
    assert caught.value.errno == errno.EMLINK


def test_multiple_elements_per_command_and_options_parse() -> None:
    fake = FakeNft()
    fake.run_text(
        "add table ip t\n"
        "add set ip t s { type ipv4_addr ; flags timeout ; }\n"
        'add element ip t s { 1.1.1.1 timeout 5s comment "a, b : c", 2.2.2.2 }\n'
    )
    assert fake.list_elements(*T, "s") == [
        Element("s", ("1.1.1.1",), comment="a, b : c", timeout=5),
        Element("s", ("2.2.2.2",)),
    ]
    with pytest.raises(NftError):
        parse_commands("add chain ip t c { type nat hook prerouting }")
    with pytest.raises(NftError):
        parse_commands("add chain bridge t c")


# Property: random operations on a small universe keep the fake consistent.

_CHAINS = ["c0", "c1", "c2", "c3"]
_ops = st.one_of(
    st.tuples(st.just("add_chain"), st.sampled_from(_CHAINS)),
    st.tuples(st.just("flush_chain"), st.sampled_from(_CHAINS)),
    st.tuples(st.just("delete_chain"), st.sampled_from(_CHAINS)),
    st.tuples(st.just("create_chain"), st.sampled_from(_CHAINS)),
    st.tuples(st.just("jump"), st.sampled_from([*_CHAINS, "base"]), st.sampled_from(_CHAINS)),
    st.tuples(
        st.just("insert_goto"), st.sampled_from(_CHAINS), st.sampled_from([*_CHAINS, "base"])
    ),
    st.tuples(st.just("use_set"), st.sampled_from([*_CHAINS, "base"])),
    st.tuples(st.just("vmap"), st.sampled_from([*_CHAINS, "base"])),
    st.tuples(st.just("element"), st.integers(1, 4), st.sampled_from([*_CHAINS, "base"])),
    st.tuples(st.just("delete_element"), st.integers(1, 4)),
    st.tuples(st.just("drop_element"), st.integers(1, 4)),
    st.tuples(st.just("set_element"), st.integers(1, 4)),
    st.tuples(
        st.just("flush_map"),
    ),
    st.tuples(
        st.just("delete_map"),
    ),
    st.tuples(
        st.just("add_set"),
    ),
    st.tuples(
        st.just("delete_set"),
    ),
    st.tuples(
        st.just("flush_table"),
    ),
)
PROPERTY_BASE = (
    "add table ip t\n"
    "add chain ip t base { type filter hook input priority 0 ; }\n"
    "add chain ip t c0\n"
    "add map ip t m { type ipv4_addr : verdict ; }\n"
    "add set ip t s { type ipv4_addr ; }\n"
)


def _queue(tx: Transaction, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "add_chain":
        tx.add_chain(op[1])
    elif kind == "flush_chain":
        tx.flush_chain(op[1])
    elif kind == "delete_chain":
        tx.delete_chain(op[1])
    elif kind == "create_chain":
        tx.create(Chain(op[1]))
    elif kind == "jump":
        tx.add_rule(op[1], f"jump {op[2]}")
    elif kind == "insert_goto":
        tx.insert(Rule(op[1], f"ip saddr 10.1.1.1 goto {op[2]}"))
    elif kind == "use_set":
        tx.add_rule(op[1], "ip daddr @s accept")
    elif kind == "vmap":
        tx.add_rule(op[1], "ip daddr vmap @m")
    elif kind == "element":
        tx.add_element("m", (f"10.0.0.{op[1]}",), (f"goto {op[2]}",))
    elif kind == "delete_element":
        tx.delete_element("m", (f"10.0.0.{op[1]}",))
    elif kind == "drop_element":
        tx.add_element("m", (f"10.0.0.{op[1]}",), ("drop",))
    elif kind == "set_element":
        tx.add_element("s", (f"10.0.0.{op[1]}",))
    elif kind == "flush_map":
        tx.flush(Map("m", "ipv4_addr : verdict"))
    elif kind == "delete_map":
        tx.delete(Map("m", "ipv4_addr : verdict"))
    elif kind == "add_set":
        tx.add(Set("s", "ipv4_addr"))
    elif kind == "delete_set":
        tx.delete(Set("s", "ipv4_addr"))
    else:
        tx.flush(Table())


def _references_resolve(dump: str) -> None:
    """Every name a rule or element uses exists in the dump (what the kernel guarantees)."""
    chains, sets, bases = set(), set(), set()
    for _, _, _verb, obj in parse_commands(dump):
        if isinstance(obj, Chain):
            chains.add(obj.name)
            if obj.hook is not None:
                bases.add(obj.name)
        elif isinstance(obj, Set | Map):
            sets.add(obj.name)
    for _, _, _, obj in parse_commands(dump):
        if isinstance(obj, Rule):
            assert obj.chain in chains
            words = obj.rule.split()
            for i, word in enumerate(words):
                if word in ("jump", "goto"):
                    assert words[i + 1] in chains and words[i + 1] not in bases
                if word.startswith("@"):
                    assert word[1:] in sets
        elif isinstance(obj, Element) and obj.value and obj.value[0].startswith("goto "):
            assert obj.value[0][5:] in chains


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_ops, min_size=1, max_size=3), max_size=12))
def test_random_transactions_keep_the_fake_consistent(batches: list[list[tuple[Any, ...]]]) -> None:
    fake = FakeNft()
    fake.run_text(PROPERTY_BASE)
    for batch in batches:
        tx = Transaction(Family.IP, "t")
        for op in batch:
            _queue(tx, op)
        before = fake.dump()
        try:
            fake.run(tx)
        except NftError:
            assert fake.dump() == before
        dump = fake.dump()
        _references_resolve(dump)
        reloaded = FakeNft()
        reloaded.run_text(dump)
        assert reloaded.dump() == dump


# Kernel parity -----------------------------------------------------------------------------


@contextmanager
def netns(tag: str) -> Iterator[str]:
    name = f"kpxn-{tag}-{os.getpid() % 100000}-{secrets.token_hex(2)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.fixture(scope="module")
def kernel() -> Iterator[LibNftables]:
    with netns("fake") as name:
        executor = LibNftables(netns=name)
        try:
            yield executor
        finally:
            executor.close()


def _reset(kernel: LibNftables) -> None:
    kernel.run_text("flush ruleset")


def _same_errno(kernel_error: NftError, expected: int, older: int | None = None) -> bool:
    # Errors found by nft itself (before the kernel) carry no errno text; the fake says
    # EINVAL for those. The fake answers as the newer kernels do; an older kernel's other
    # answer is still a refusal, which is all a sync relies on.
    answers = {expected} if older is None else {expected, older}
    return kernel_error.errno in answers or (
        expected == errno.EINVAL and kernel_error.errno is None
    )


def _kernel_version() -> tuple[int, int]:
    major, minor = os.uname().release.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.kernel
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_agrees(kernel: LibNftables, case: Case) -> None:
    _reset(kernel)
    fake = FakeNft()
    for tx in transactions(BASE):
        kernel.run(tx)
        fake.run(tx)
    assert state(kernel) == state(fake)
    if case.accepted_since is not None and _kernel_version() >= case.accepted_since:
        (tx,) = transactions(case.tx)
        kernel.run(tx)
        with pytest.raises(NftError) as refused:
            fake.run(tx)
        assert refused.value.errno == case.fails
        return
    for tx in transactions(case.tx):
        if case.fails is None:
            kernel.run(tx)
            fake.run(tx)
        else:
            with pytest.raises(NftError) as caught:
                kernel.run(tx)
            assert _same_errno(caught.value, case.fails, case.older), caught.value
            with pytest.raises(NftError):
                fake.run(tx)
    assert state(kernel) == state(fake)


@pytest.mark.kernel
def test_fake_dump_loads_into_the_kernel(kernel: LibNftables) -> None:
    _reset(kernel)
    fake = FakeNft()
    for tx in transactions(BASE):
        fake.run(tx)
    kernel.run_text(fake.dump())
    assert state(kernel) == state(fake)


@pytest.mark.kernel
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.lists(_ops, min_size=1, max_size=3), max_size=8))
def test_kernel_and_fake_agree_on_random_transactions(
    kernel: LibNftables, batches: list[list[tuple[Any, ...]]]
) -> None:
    _reset(kernel)
    fake = FakeNft()
    for tx in transactions(PROPERTY_BASE):
        kernel.run(tx)
        fake.run(tx)
    tables = (T,)
    for batch in batches:
        tx = Transaction(Family.IP, "t")
        for op in batch:
            _queue(tx, op)
        outcomes: list[int | None] = []
        for ex in (kernel, fake):
            try:
                ex.run(tx)
                outcomes.append(None)
            except NftError as err:
                outcomes.append(err.errno)
        assert outcomes[0] == outcomes[1], f"{tx.render()}kernel {outcomes[0]}, fake {outcomes[1]}"
        assert state(kernel, tables) == state(fake, tables)
