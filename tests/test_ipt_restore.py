"""RestoreInput, chain names and comments: the text iptables-restore is given."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.backends.iptables.fake import tokenize
from kubeproxy.backends.iptables.restore import (
    CHAIN_NAME_MAX,
    COMMENT_MAX,
    FILTER,
    MANGLE,
    NAT,
    RestoreError,
    RestoreInput,
    check_chain_name,
    check_table,
    comment,
)


def test_render_orders_tables_and_sections() -> None:
    restore = RestoreInput()
    # Queued in a scrambled order: render puts tables in filter, nat, mangle order and,
    # within a table, declarations, creations, rules, deletions.
    restore.delete_chain(NAT, "KUBE-SVC-OLD")
    restore.append(NAT, "KUBE-SERVICES", "-d 10.0.0.1/32 -j KUBE-SVC-NEW")
    restore.declare(NAT, "KUBE-SERVICES")
    restore.create(NAT, "KUBE-SVC-NEW")
    restore.declare(NAT, "KUBE-SVC-OLD")
    restore.append(MANGLE, "KUBE-M", "-j RETURN")
    restore.declare(MANGLE, "KUBE-M")
    restore.declare(FILTER, "KUBE-FORWARD")
    assert restore.render() == (
        "*filter\n"
        ":KUBE-FORWARD - [0:0]\n"
        "COMMIT\n"
        "*nat\n"
        ":KUBE-SERVICES - [0:0]\n"
        ":KUBE-SVC-OLD - [0:0]\n"
        "-N KUBE-SVC-NEW\n"
        "-A KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-NEW\n"
        "-X KUBE-SVC-OLD\n"
        "COMMIT\n"
        "*mangle\n"
        ":KUBE-M - [0:0]\n"
        "-A KUBE-M -j RETURN\n"
        "COMMIT\n"
    )
    assert restore.tables() == [FILTER, NAT, MANGLE]
    assert restore.line_count(NAT) == 5
    assert restore.line_count(FILTER) == 1
    assert not restore.empty


def test_empty_input_renders_nothing_and_omits_untouched_tables() -> None:
    restore = RestoreInput()
    assert restore.empty
    assert restore.render() == ""
    assert restore.line_count(NAT) == 0
    restore.append(NAT, "KUBE-SERVICES", "-j RETURN")
    assert restore.render() == "*nat\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
    assert restore.tables() == [NAT]


def test_rules_keep_their_order_per_table() -> None:
    restore = RestoreInput()
    for index in range(5):
        restore.append(NAT, f"C{index % 2}", f"-m mark --mark {index} -j RETURN")
    lines = restore.render().splitlines()
    assert lines[1:-1] == [f"-A C{i % 2} -m mark --mark {i} -j RETURN" for i in range(5)]


@pytest.mark.parametrize("name", ["", "a" * (CHAIN_NAME_MAX + 1), "KUBE SVC", "a/b", "é", "a\nb"])
def test_bad_chain_names_are_refused(name: str) -> None:
    with pytest.raises(RestoreError):
        check_chain_name(name)
    restore = RestoreInput()
    with pytest.raises(RestoreError):
        restore.declare(NAT, name)
    with pytest.raises(RestoreError):
        restore.append(NAT, name, "-j RETURN")
    with pytest.raises(RestoreError):
        restore.delete_chain(NAT, name)
    assert restore.empty


def test_good_chain_names_pass() -> None:
    assert check_chain_name("KUBE-SVC-ABCDEFGHIJKLMNOP") == "KUBE-SVC-ABCDEFGHIJKLMNOP"
    assert check_chain_name("a" * CHAIN_NAME_MAX) == "a" * CHAIN_NAME_MAX
    assert check_chain_name("x_y-9") == "x_y-9"


@pytest.mark.parametrize("chain", ["INPUT", "PREROUTING", "POSTROUTING", "OUTPUT", "FORWARD"])
def test_builtin_chains_cannot_be_declared_created_or_deleted(chain: str) -> None:
    restore = RestoreInput()
    for method in (restore.declare, restore.create, restore.delete_chain):
        with pytest.raises(RestoreError, match="built-in"):
            method(NAT, chain)
    # Appending to a built-in chain is allowed (the caller decides).
    restore.append(NAT, chain, "-j KUBE-SERVICES")
    assert restore.render() == f"*nat\n-A {chain} -j KUBE-SERVICES\nCOMMIT\n"


def test_unknown_table_and_line_breaks_are_refused() -> None:
    restore = RestoreInput()
    with pytest.raises(RestoreError, match="unknown iptables table"):
        restore.declare("raw", "X")
    with pytest.raises(RestoreError, match="unknown iptables table"):
        restore.append("*nat", "X", "-j RETURN")
    with pytest.raises(RestoreError):
        check_table("security")
    with pytest.raises(RestoreError, match="line break"):
        restore.append(NAT, "X", "-j RETURN\n-A INPUT -j DROP")
    with pytest.raises(RestoreError, match="line break"):
        restore.append(NAT, "X", "-j RETURN\r")
    assert restore.empty
    assert restore.render() == ""


def test_comment_quotes_as_iptables_reads_it() -> None:
    assert comment("ns/svc:http cluster IP") == '-m comment --comment "ns/svc:http cluster IP"'
    assert comment("plain") == '-m comment --comment "plain"'
    assert comment('say "hi"') == '-m comment --comment "say \\"hi\\""'
    assert comment("back\\slash it's") == '-m comment --comment "back\\\\slash it\\\'s"'


@pytest.mark.parametrize(
    "text", ["", "a\nb", "tab\there", "nul\0", "del\x7f", "x" * (COMMENT_MAX + 1)]
)
def test_bad_comments_are_refused(text: str) -> None:
    with pytest.raises(RestoreError):
        comment(text)


PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f")


@given(st.text(PRINTABLE, min_size=1, max_size=80))
def test_comment_round_trips_through_the_restore_tokenizer(text: str) -> None:
    words = tokenize(f"-A X {comment(text)} -j RETURN")
    assert words == ["-A", "X", "-m", "comment", "--comment", text, "-j", "RETURN"]


def test_comment_length_limit_counts_bytes() -> None:
    assert comment("x" * COMMENT_MAX).endswith('"')
    with pytest.raises(RestoreError):
        comment("é" * (COMMENT_MAX // 2 + 1))


def test_a_big_input_renders_quickly_enough_to_be_linear() -> None:
    # Not a timing test: checks the shape (one line per call, nothing lost) at scale.
    restore = RestoreInput()
    for index in range(20_000):
        chain = f"KUBE-SVC-{index:016X}"
        restore.declare(NAT, chain)
        restore.append(NAT, chain, "-j RETURN")
    text = restore.render()
    assert text.count("\n") == 40_002
    assert restore.line_count(NAT) == 40_000


def test_insert_and_delete_rule_keep_their_place_among_rules() -> None:
    restore = RestoreInput()
    restore.append(NAT, "KUBE-SERVICES", "-j A")
    restore.delete_rule(NAT, "KUBE-SERVICES", "-d 10.0.0.1/32 -j KUBE-SVC-X")
    restore.insert(NAT, "KUBE-SERVICES", "-j B")
    restore.declare(NAT, "KUBE-SVC-X")
    restore.create(NAT, "KUBE-SVC-Y")
    assert restore.render().splitlines() == [
        "*nat",
        ":KUBE-SVC-X - [0:0]",
        "-N KUBE-SVC-Y",
        "-A KUBE-SERVICES -j A",
        "-D KUBE-SERVICES -d 10.0.0.1/32 -j KUBE-SVC-X",
        "-I KUBE-SERVICES -j B",
        "COMMIT",
    ]
    assert restore.chain_count(NAT) == 2
    assert restore.chain_count(FILTER) == 0
    with pytest.raises(RestoreError):
        restore.delete_rule(NAT, "KUBE-SERVICES", "")
    with pytest.raises(RestoreError):
        restore.insert(NAT, "KUBE SERVICES", "-j A")
    with pytest.raises(RestoreError):
        restore.insert(NAT, "KUBE-SERVICES", "-j A\nCOMMIT")
