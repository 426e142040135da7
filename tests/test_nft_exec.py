"""LibNftables against the real kernel in network namespaces, plus its parsing helpers.

Kernel tests only ever change namespaces they create (``kpxn-*``); the host ruleset is
only read, with ``nft list tables``.
"""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kubeproxy.backends.nftables.exec import (
    LibNftables,
    _element_from_json,
    _parse_chain_listing,
    errno_from_message,
    parse_version,
)
from kubeproxy.backends.nftables.objects import (
    Chain,
    Element,
    Family,
    Map,
    NftError,
    Set,
    Table,
    is_already_exists,
    is_not_found,
)
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.host.netns import in_netns, netns_path, run_in_netns

# Unit tests of the helpers ---------------------------------------------------------------


def test_errno_from_message_takes_the_first_error() -> None:
    assert errno_from_message("Error: Could not process rule: File exists") == errno.EEXIST
    both = (
        "line 1:2-3: Error: Could not process rule: Device or resource busy\n"
        "line 2:2-3: Error: No such file or directory; did you mean chain 'c'"
    )
    assert errno_from_message(both) == errno.EBUSY
    assert errno_from_message("Error: syntax error, unexpected colon") is None


@pytest.mark.parametrize(
    "message",
    [
        # nft 1.1.0+ on a base chain redeclared with another hook or priority.
        "line 1:23-56: Error: Chain \"base\" already exists in table ip 't' with different"
        " declaration",
        # nft 1.0.7+ on a chain type the kernel lacks.
        'Error: Chain of type "nat" is not supported, perhaps kernel support is missing?',
        'Error: Chains of type "nat" must have a priority value above -200',
    ],
)
def test_nfts_own_words_for_a_refused_base_chain_mean_eopnotsupp(message: str) -> None:
    # nft replaces the kernel's strerror with these hints; the kernel said EOPNOTSUPP.
    assert errno_from_message(message) == errno.EOPNOTSUPP


def test_parse_version() -> None:
    assert parse_version("1.0.6") == (1, 0, 6)
    assert parse_version("nftables v1.0.1 (Fearless Fosdick #3)") == (1, 0, 1)
    assert parse_version("0.9") == (0, 9, 0)
    assert parse_version("1.0.6.1") == (1, 0, 6, 1)
    assert (1, 0, 6) < parse_version("1.0.6.1") < (1, 0, 7)
    with pytest.raises(NftError):
        parse_version("unknown")


# Element JSON exactly as nft 1.0.6 prints it.
JSON_CASES: list[tuple[Any, bool, Element]] = [
    ("1.2.3.4", False, Element("s", ("1.2.3.4",))),
    ("::1", False, Element("s", ("::1",))),
    ({"concat": ["udp", 53]}, False, Element("s", ("udp", "53"))),
    (
        {"elem": {"val": {"concat": ["tcp", 80]}, "comment": "ns/svc:http"}},
        False,
        Element("s", ("tcp", "80"), comment="ns/svc:http"),
    ),
    ({"prefix": {"addr": "10.0.0.0", "len": 8}}, False, Element("s", ("10.0.0.0/8",))),
    ({"range": ["192.168.1.1", "192.168.1.5"]}, False, Element("s", ("192.168.1.1-192.168.1.5",))),
    (
        {"elem": {"val": "1.1.1.1", "timeout": 100, "expires": 96}},
        False,
        Element("s", ("1.1.1.1",), timeout=100, expires=96),
    ),
    (
        [{"concat": ["10.0.0.5", "tcp", 1]}, {"return": None}],
        True,
        Element("s", ("10.0.0.5", "tcp", "1"), ("return",), is_map=True),
    ),
    (
        [{"concat": ["10.0.0.2", "udp", 53]}, {"drop": None}],
        True,
        Element("s", ("10.0.0.2", "udp", "53"), ("drop",), is_map=True),
    ),
    (
        [
            {"elem": {"val": {"concat": ["10.0.0.1", "tcp", 80]}, "comment": "ns/a:b"}},
            {"goto": {"target": "service-X/ns/a/tcp/p"}},
        ],
        True,
        Element("s", ("10.0.0.1", "tcp", "80"), ("goto service-X/ns/a/tcp/p",), "ns/a:b", True),
    ),
    (
        [{"concat": ["10.0.0.4", "tcp", 8080]}, {"jump": {"target": "c"}}],
        True,
        Element("s", ("10.0.0.4", "tcp", "8080"), ("jump c",), is_map=True),
    ),
    (["1.1.1.1", "2.2.2.2"], True, Element("s", ("1.1.1.1",), ("2.2.2.2",), is_map=True)),
    (
        ["1.1.1.1", {"concat": ["2.2.2.2", 80]}],
        True,
        Element("s", ("1.1.1.1",), ("2.2.2.2", "80"), is_map=True),
    ),
]


@pytest.mark.parametrize(("item", "is_map", "expected"), JSON_CASES)
def test_element_from_json(item: Any, is_map: bool, expected: Element) -> None:
    got = _element_from_json("s", item, is_map)
    assert got == expected
    assert got.expires == expected.expires


@pytest.mark.parametrize("item", [{"weird": 1}, True, None, [1, 2, 3], {"concat": [{"x": 1}]}])
def test_element_from_json_refuses_the_unknown(item: Any) -> None:
    with pytest.raises(NftError):
        _element_from_json("s", item, isinstance(item, list))


def test_parse_chain_listing() -> None:
    text = (
        "table ip other {\n"
        "\tchain c {\n"
        '\t\tcomment "not ours"\n'
        "\t}\n"
        "}\n"
        "table ip kube-proxy {\n"
        "\tchain nat-prerouting {\n"
        "\t\ttype nat hook prerouting priority dstnat; policy accept;\n"
        '\t\tcomment "base, with a comment"\n'
        "\t}\n"
        "\tchain service-X/ns/s/tcp/p {\n"
        "\t}\n"
        "\tchain reject-chain {\n"
        '\t\tcomment "helper for @no-endpoint-services"\n'
        "\t}\n"
        "}\n"
    )
    assert _parse_chain_listing(text, "kube-proxy") == {
        "nat-prerouting": "base, with a comment",
        "service-X/ns/s/tcp/p": None,
        "reject-chain": "helper for @no-endpoint-services",
    }
    assert _parse_chain_listing(text, "other") == {"c": "not ours"}
    assert _parse_chain_listing(text, "missing") == {}


def test_netns_names_are_checked() -> None:
    assert netns_path("kpxn-a") == "/run/netns/kpxn-a"
    for bad in ("", ".", "..", "a/b", "../etc"):
        with pytest.raises(ValueError):
            netns_path(bad)


# Kernel tests ----------------------------------------------------------------------------


@contextmanager
def netns(tag: str) -> Iterator[str]:
    name = f"kpxn-{tag}-{os.getpid() % 100000}-{secrets.token_hex(2)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.fixture
def ns() -> Iterator[str]:
    with netns("exec") as name:
        yield name


@pytest.fixture
def nft(ns: str) -> Iterator[LibNftables]:
    executor = LibNftables(netns=ns)
    try:
        yield executor
    finally:
        executor.close()


def host_tables() -> str:
    """The host's table list (read only)."""
    return subprocess.run(
        ["nft", "list", "tables"], check=True, capture_output=True, text=True
    ).stdout


def netns_inode() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


@pytest.mark.kernel
def test_runs_only_inside_the_namespace(ns: str, nft: LibNftables) -> None:
    table = f"kpxn-only-{secrets.token_hex(3)}"
    tx = Transaction(Family.IP, table)
    tx.add(Table(comment="namespace test"))
    tx.add_chain("c")
    nft.run(tx)
    assert nft.table_exists(Family.IP, table)
    assert nft.list_chains(Family.IP, table) == {"c": None}
    assert table not in host_tables()
    inside = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "list", "tables"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert f"table ip {table}" in inside


@pytest.mark.kernel
def test_check_applies_nothing(nft: LibNftables) -> None:
    tx = Transaction(Family.IP, "t")
    tx.add(Table())
    tx.add_chain("c")
    nft.check(tx)
    assert not nft.table_exists(Family.IP, "t")
    bad = Transaction(Family.IP, "t")
    bad.add(Table())
    bad.add_chain("c")
    bad.add_rule("c", "jump absent")
    with pytest.raises(NftError) as caught:
        nft.check(bad)
    assert is_not_found(caught.value)
    assert not nft.table_exists(Family.IP, "t")
    nft.run(tx)
    assert nft.table_exists(Family.IP, "t")


def _populate() -> Transaction:
    tx = Transaction(Family.IP, "kube-proxy")
    tx.add(Table(comment="rules for kube-proxy"))
    tx.add(Chain("nat-prerouting", type="nat", hook="prerouting", priority=-100))
    tx.add(Chain("filter-input", type="filter", hook="input", priority=0, comment="base"))
    tx.add_chain("services")
    tx.add_chain("reject-chain", comment="helper for @no-endpoint-services")
    tx.add_chain("service-ULMVA6XW-ns1/svc1/tcp/p80")
    tx.add_chain("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80")
    tx.add(Map("service-ips", "ipv4_addr . inet_proto . inet_service : verdict", comment="m"))
    tx.add(Map("service-nodeports", "inet_proto . inet_service : verdict"))
    tx.add(Map("endpoints", "ipv4_addr : ipv4_addr . inet_service"))
    tx.add(Set("cluster-ips", "ipv4_addr", comment="Active ClusterIPs"))
    tx.add(Set("ranges", "ipv4_addr", flags=("interval",)))
    tx.add_rule("nat-prerouting", "jump services")
    tx.add_rule("services", "ip daddr . meta l4proto . th dport vmap @service-ips")
    tx.add_rule("services", "fib daddr type local meta l4proto . th dport vmap @service-nodeports")
    tx.add_rule("reject-chain", "reject", comment="why")
    tx.add_rule(
        "service-ULMVA6XW-ns1/svc1/tcp/p80",
        "numgen random mod 1 0 goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
    )
    tx.add_rule(
        "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
        "meta l4proto tcp dnat to 10.180.0.1:80",
    )
    return tx


@pytest.mark.kernel
def test_refused_transaction_keeps_the_previous_state(nft: LibNftables) -> None:
    nft.run(_populate())
    chains = nft.list_chains(Family.IP, "kube-proxy")
    sets = nft.list_sets(Family.IP, "kube-proxy")
    bad = Transaction(Family.IP, "kube-proxy")
    bad.add_chain("new-chain")
    bad.add_rule("new-chain", "counter")
    bad.add_element("cluster-ips", ("172.30.0.1",))
    bad.add_rule("services", "jump no-such-chain")
    with pytest.raises(NftError) as caught:
        nft.run(bad)
    message = str(caught.value)
    assert is_not_found(caught.value)
    assert "No such file or directory" in message
    # nft names the offending command and its line in the batch.
    assert "line 4:" in message and "add rule ip kube-proxy services jump no-such-chain" in message
    assert nft.list_chains(Family.IP, "kube-proxy") == chains
    assert nft.list_sets(Family.IP, "kube-proxy") == sets
    assert nft.list_elements(Family.IP, "kube-proxy", "cluster-ips") == []
    again = Transaction(Family.IP, "kube-proxy")
    again.create(Chain("services"))
    with pytest.raises(NftError) as caught:
        nft.run(again)
    assert is_already_exists(caught.value)


@pytest.mark.kernel
def test_listings_round_trip_what_was_queued(nft: LibNftables) -> None:
    tx = _populate()
    svc = "service-ULMVA6XW-ns1/svc1/tcp/p80"
    queued = [
        Element(
            "service-ips", ("172.30.0.41", "tcp", "80"), (f"goto {svc}",), "ns1/svc1:p80", True
        ),
        Element("service-ips", ("172.30.0.42", "udp", "53"), ("drop",), is_map=True),
        Element("service-ips", ("172.30.0.43", "sctp", "9"), ("accept",), is_map=True),
        Element("service-ips", ("172.30.0.44", "tcp", "1"), ("jump reject-chain",), "j", True),
        Element("service-ips", ("172.30.0.45", "tcp", "2"), ("return",), is_map=True),
        Element("service-ips", ("172.30.0.46", "tcp", "3"), ("continue",), is_map=True),
        Element("service-nodeports", ("tcp", "30080"), ("goto reject-chain",), is_map=True),
        Element("endpoints", ("1.1.1.1",), ("10.180.0.1", "8080"), "x", True),
        Element("cluster-ips", ("172.30.0.41",), comment="ns1/svc1:p80"),
        Element("cluster-ips", ("172.30.0.42",)),
        Element("ranges", ("10.0.0.0/8",)),
        Element("ranges", ("192.168.1.1-192.168.1.5",), comment="range"),
    ]
    for element in queued:
        tx.add(element)
    nft.run(tx)
    assert nft.list_chains(Family.IP, "kube-proxy") == {
        "nat-prerouting": None,
        "filter-input": "base",
        "services": None,
        "reject-chain": "helper for @no-endpoint-services",
        svc: None,
        "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80": None,
    }
    assert sorted(nft.list_sets(Family.IP, "kube-proxy")) == [
        "cluster-ips",
        "endpoints",
        "ranges",
        "service-ips",
        "service-nodeports",
    ]
    listed = [
        element
        for name in ("service-ips", "service-nodeports", "endpoints", "cluster-ips", "ranges")
        for element in nft.list_elements(Family.IP, "kube-proxy", name)
    ]
    assert sorted(listed, key=repr) == sorted(queued, key=repr)

    # What was listed can be deleted again by key.
    cleanup = Transaction(Family.IP, "kube-proxy")
    for element in listed:
        cleanup.delete(element)
    nft.run(cleanup)
    assert all(
        nft.list_elements(Family.IP, "kube-proxy", name) == []
        for name in nft.list_sets(Family.IP, "kube-proxy")
    )


@pytest.mark.kernel
def test_ipv6_and_dynamic_sets(nft: LibNftables) -> None:
    tx = Transaction(Family.IP6, "kube-proxy")
    tx.add(Table())
    tx.add(Set("cluster-ips", "ipv6_addr"))
    tx.add(Set("affinity", "ipv6_addr . ipv6_addr", flags=("dynamic", "timeout"), timeout=10800))
    tx.add_element("cluster-ips", ("fd00:10:96::1",))
    tx.add(Element("affinity", ("fd00::1", "fd00::2"), timeout=300))
    nft.run(tx)
    assert nft.list_elements(Family.IP6, "kube-proxy", "cluster-ips") == [
        Element("cluster-ips", ("fd00:10:96::1",))
    ]
    (entry,) = nft.list_elements(Family.IP6, "kube-proxy", "affinity")
    assert entry.key == ("fd00::1", "fd00::2")
    assert entry.timeout == 300
    assert entry.expires is not None and 0 < entry.expires <= 300
    assert not nft.table_exists(Family.IP, "kube-proxy")


@pytest.mark.kernel
def test_missing_things(nft: LibNftables) -> None:
    assert nft.list_chains(Family.IP, "kube-proxy") == {}
    assert nft.list_sets(Family.IP, "kube-proxy") == []
    assert not nft.table_exists(Family.IP, "kube-proxy")
    with pytest.raises(NftError) as caught:
        nft.list_elements(Family.IP, "kube-proxy", "cluster-ips")
    assert is_not_found(caught.value)
    nft.run(_populate())
    with pytest.raises(NftError) as caught:
        nft.list_elements(Family.IP, "kube-proxy", "no-such-set")
    assert is_not_found(caught.value)
    assert nft.list_chains(Family.IP6, "kube-proxy") == {}


@pytest.mark.kernel
def test_listings_refuse_bad_names(nft: LibNftables) -> None:
    for call in (
        lambda: nft.table_exists(Family.IP, "t; flush ruleset"),
        lambda: nft.list_chains(Family.IP, "t t"),
        lambda: nft.list_sets(Family.IP, "9t"),
        lambda: nft.list_elements(Family.IP, "t", "s }"),
    ):
        with pytest.raises(NftError):
            call()


@pytest.mark.kernel
def test_empty_latched_and_closed(ns: str) -> None:
    executor = LibNftables(netns=ns)
    executor.run(Transaction(Family.IP, "t"))
    assert executor.run_text("list ruleset") == ""
    tx = Transaction(Family.IP, "t")
    tx.add(Table())
    tx.add_rule("c", "bad; rule")
    with pytest.raises(NftError) as caught:
        executor.run(tx)
    assert caught.value is tx.error
    with pytest.raises(NftError):
        executor.check(tx)
    assert executor.run_text("list ruleset") == ""
    executor.close()
    executor.close()
    with pytest.raises(NftError, match="closed"):
        executor.run_text("list ruleset")


@pytest.mark.kernel
def test_run_text_returns_output(nft: LibNftables) -> None:
    nft.run_text('add table ip t\nadd chain ip t c { comment "x" ; }\n')
    assert 'comment "x"' in nft.run_text("list table ip t")
    with pytest.raises(NftError) as caught:
        nft.run_text("add table ip t\nadd rule ip t nope accept\n")
    assert "line 2:" in str(caught.value)


@pytest.mark.kernel
def test_big_transaction_in_chunks(nft: LibNftables) -> None:
    tx = Transaction(Family.IP, "t")
    tx.add(Table())
    tx.add(Map("m", "ipv4_addr . inet_proto . inet_service : verdict"))
    for i in range(1000):
        tx.add_chain(f"svc-{i}")
        tx.add_rule(f"svc-{i}", f"meta l4proto tcp dnat to 10.1.{i // 256}.{i % 256}:80")
    for i in range(20000):
        key = (f"10.0.{i // 256}.{i % 256}", "tcp", "80")
        tx.add_element("m", key, (f"goto svc-{i % 1000}",))
    assert len(list(tx.render_chunks())) > 2
    nft.run(tx)
    assert len(nft.list_chains(Family.IP, "t")) == 1000
    assert len(nft.list_elements(Family.IP, "t", "m")) == 20000


@pytest.mark.kernel
def test_one_executor_from_many_threads(nft: LibNftables) -> None:
    setup = Transaction(Family.IP, "t")
    setup.add(Table())
    setup.add(Set("s", "ipv4_addr"))
    nft.run(setup)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                tx = Transaction(Family.IP, "t")
                tx.add_element("s", (f"10.{n}.0.{i}",))
                nft.run(tx)
                nft.list_sets(Family.IP, "t")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(nft.list_elements(Family.IP, "t", "s")) == 40


@pytest.mark.kernel
def test_netns_helpers(ns: str) -> None:
    home = netns_inode()
    with in_netns(ns):
        inside = netns_inode()
        assert inside != home
    assert netns_inode() == home
    assert run_in_netns(ns, netns_inode) == inside
    assert netns_inode() == home

    def boom() -> None:
        raise KeyError("from the helper thread")

    with pytest.raises(KeyError, match="from the helper thread"):
        run_in_netns(ns, boom)
    with pytest.raises(RuntimeError), in_netns(ns):
        assert netns_inode() == inside
        raise RuntimeError("leaves the namespace anyway")
    assert netns_inode() == home
    missing = f"kpxn-missing-{secrets.token_hex(3)}"
    with pytest.raises(FileNotFoundError):
        run_in_netns(missing, netns_inode)
    with pytest.raises(FileNotFoundError), in_netns(missing):
        pass
    with pytest.raises(NftError, match="cannot enter network namespace"):
        LibNftables(netns=missing)
