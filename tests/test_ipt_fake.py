"""FakeIptables: restore syntax, --noflush semantics, the kernel's checks, save format."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubeproxy.backends.iptables.exec import IptablesError, IptablesExecutor, IptablesVariant
from kubeproxy.backends.iptables.fake import FakeIptables, _tokenize_chars, save_form, tokenize
from kubeproxy.backends.iptables.restore import FILTER, NAT, RestoreInput, comment
from kubeproxy.objects import IPFamily

V4, V6 = IPFamily.IPV4, IPFamily.IPV6

EMPTY_NAT = """\
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
"""


def rules(fake: FakeIptables, family: IPFamily = V4, table: str = NAT) -> list[str]:
    return [line for line in fake.dump(family, table).splitlines() if line.startswith("-A ")]


def test_fake_is_an_executor() -> None:
    executor: IptablesExecutor = FakeIptables(IptablesVariant.LEGACY)
    assert executor.variant is IptablesVariant.LEGACY


def test_fresh_tables_hold_the_builtin_chains() -> None:
    fake = FakeIptables()
    assert fake.save(V4, NAT) == EMPTY_NAT
    assert fake.chains(V4, FILTER) == {"INPUT", "FORWARD", "OUTPUT"}
    assert fake.chains(V6, "mangle") == {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"}
    # Every table touched so far (IPv4 filter and nat here) is dumped, in order.
    assert fake.dump(V4) == fake.save(V4, FILTER) + fake.save(V4, NAT)
    mangle = fake.save(V4, "mangle")
    assert fake.dump(V4) == fake.save(V4, FILTER) + fake.save(V4, NAT) + mangle


def test_dump_matches_iptables_save_form() -> None:
    fake = FakeIptables()
    # The same input and expected output as measured with iptables 1.8.9, both variants.
    fake.restore(
        V4,
        "*nat\n"
        ":Z - [0:0]\n"
        ":A - [0:0]\n"
        ":M - [0:0]\n"
        '-A Z -m comment --comment "x y" -p tcp -o eth0 ! -d 10.0.0.1 -i lo '
        "-s 10.1.0.0/16 --dport 80 -j A\n"
        "-A A -p udp -m udp --dport 53 -j DNAT --to-destination 10.2.0.1:53\n"
        "-A M -m statistic --mode random --probability 0.5 -j A\n"
        "-A M -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
        "-A M -j MARK --set-xmark 0x4000/0x4000\n"
        '-A M -m comment --comment "a \\"b\\" c\\\\d e\'f" -j RETURN\n'
        '-A M -m comment --comment "ab" -j RETURN\n'
        "-A M -j MASQUERADE --random-fully\n"
        "COMMIT\n",
    )
    assert fake.dump(V4, NAT) == (
        "*nat\n"
        ":PREROUTING ACCEPT [0:0]\n"
        ":INPUT ACCEPT [0:0]\n"
        ":OUTPUT ACCEPT [0:0]\n"
        ":POSTROUTING ACCEPT [0:0]\n"
        ":A - [0:0]\n"
        ":M - [0:0]\n"
        ":Z - [0:0]\n"
        "-A A -p udp -m udp --dport 53 -j DNAT --to-destination 10.2.0.1:53\n"
        "-A M -m statistic --mode random --probability 0.50000000000 -j A\n"
        "-A M -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
        "-A M -j MARK --set-xmark 0x4000/0x4000\n"
        '-A M -m comment --comment "a \\"b\\" c\\\\d e\\\'f" -j RETURN\n'
        "-A M -m comment --comment ab -j RETURN\n"
        "-A M -j MASQUERADE --random-fully\n"
        "-A Z -s 10.1.0.0/16 ! -d 10.0.0.1/32 -i lo -o eth0 -p tcp "
        '-m comment --comment "x y" -m tcp --dport 80 -j A\n'
        "COMMIT\n"
    )


def test_save_form_ipv6_hosts_get_128() -> None:
    assert save_form(["-d", "fd00::1", "-j", "RETURN"], V6) == ("-d", "fd00::1/128", "-j", "RETURN")
    assert save_form(["-s", "fd00::/64", "-j", "RETURN"], V6) == ("-s", "fd00::/64", "-j", "RETURN")
    with pytest.raises(ValueError):
        save_form(["-j", "RETURN", "-d"], V4)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("-A X -j RETURN", ["-A", "X", "-j", "RETURN"]),
        ('-A X --comment "a b"  -j Y', ["-A", "X", "--comment", "a b", "-j", "Y"]),
        ('--comment ab"c d"', ["--comment", "abc d"]),  # a quote may open mid-word
        ('--comment "\\x\\"\\\\"', ["--comment", 'x"\\']),
        ('--comment ""', ["--comment", ""]),
        ('--comment "a\tb"', ["--comment", "a\tb"]),
    ],
)
def test_tokenize_reads_words_as_iptables_restore(line: str, words: list[str]) -> None:
    assert tokenize(line) == words


@given(st.text(st.sampled_from(['"', " ", "\t", "a", "-", "\\", "x"]), max_size=30))
def test_tokenize_fast_paths_agree_with_the_general_one(line: str) -> None:
    try:
        expected: list[str] | None = _tokenize_chars(line)
    except ValueError:
        expected = None
    try:
        got: list[str] | None = tokenize(line)
    except ValueError:
        got = None
    assert got == expected


def test_tokenize_refuses_an_unterminated_quote() -> None:
    with pytest.raises(ValueError):
        tokenize('-A X --comment "open')


def test_noflush_declared_chains_are_flushed_others_untouched() -> None:
    fake = FakeIptables()
    fake.restore(
        V4,
        "*nat\n:KEEP - [0:0]\n:SWAP - [0:0]\n-A KEEP -j RETURN\n-A SWAP -j KEEP\nCOMMIT\n",
    )
    fake.restore(V4, "*nat\n:SWAP - [0:0]\n:NEW - [0:0]\n-A SWAP -j NEW\nCOMMIT\n")
    assert rules(fake) == ["-A KEEP -j RETURN", "-A SWAP -j NEW"]
    assert fake.chains(V4, NAT) >= {"KEEP", "SWAP", "NEW"}
    # Other family and other tables are separate.
    assert rules(fake, V6) == []
    assert rules(fake, V4, FILTER) == []


def test_builtin_declaration_flushes_and_sets_policy() -> None:
    fake = FakeIptables()
    fake.restore(V4, "*filter\n-A INPUT -j ACCEPT\nCOMMIT\n")
    fake.restore(V4, "*filter\n:INPUT DROP [0:0]\nCOMMIT\n")
    assert ":INPUT DROP [0:0]" in fake.dump(V4, FILTER)
    assert rules(fake, V4, FILTER) == []


@pytest.mark.parametrize(
    ("text", "line_number", "message"),
    [
        ("*raw\nCOMMIT\n", 1, "invalid"),
        ("*nat\n-A NOPE -j RETURN\nCOMMIT\n", 2, "No chain"),
        ("*nat\n:A - [0:0]\n-A A -j NOPE\nCOMMIT\n", 3, "does not exist"),
        ("*nat\n:A - [0:0]\n-A A -j PREROUTING\nCOMMIT\n", 3, "does not exist"),
        ("*filter\n:A - [0:0]\n-A A -p tcp -j DNAT --to-destination 1.2.3.4\nCOMMIT\n", 3, "nat"),
        ("*nat\n:A - [0:0]\n-A A -j REJECT\nCOMMIT\n", 3, "filter"),
        ("*nat\n-X NOPE\nCOMMIT\n", 2, "No chain"),
        ("*nat\n-X PREROUTING\nCOMMIT\n", 2, "built-in"),
        ("*nat\n-X FULL\nCOMMIT\n", 2, "not empty"),
        ("*nat\n:FULL - [0:0]\n-X FULL\nCOMMIT\n", 3, "referenced"),
        ("*nat\n-N FULL\nCOMMIT\n", 2, "exists"),
        ("*nat\n-Q FULL -j RETURN\nCOMMIT\n", 2, "unknown command"),
        ("*nat\n-A FULL -j\nCOMMIT\n", 2, "needs a target"),
        ('*nat\n-A FULL -m comment --comment "x -j RETURN\nCOMMIT\n', 2, "quote"),
        ("*nat\n:FULL ACCEPT [0:0]\nCOMMIT\n", 2, "policy"),
        ("-A FULL -j RETURN\n", 1, "no table"),
        ("*nat\n*filter\nCOMMIT\n", 2, "COMMIT expected"),
        ("*nat\n-D FULL -j ACCEPT\nCOMMIT\n", 2, "Bad rule"),
        ("*nat\n-I FULL 5 -j RETURN\nCOMMIT\n", 2, "too big"),
    ],
)
def test_kernel_checks_fail_the_restore_and_change_nothing(
    text: str, line_number: int, message: str
) -> None:
    fake = FakeIptables()
    fake.restore(
        V4, "*nat\n:FULL - [0:0]\n:REF - [0:0]\n-A FULL -j RETURN\n-A REF -j FULL\nCOMMIT\n"
    )
    before = fake.dump(V4, NAT)
    with pytest.raises(IptablesError, match=message) as caught:
        fake.restore(V4, text)
    assert caught.value.line_number == line_number
    assert caught.value.line == text.splitlines()[line_number - 1]
    assert fake.dump(V4, NAT) == before
    assert rules(fake, V4, FILTER) == []
    assert fake.chains(V4, FILTER) == {"INPUT", "FORWARD", "OUTPUT"}
    assert fake.restores[-1] == (V4, text)


def test_missing_commit_fails_and_changes_nothing() -> None:
    fake = FakeIptables()
    with pytest.raises(IptablesError, match="COMMIT expected"):
        fake.restore(V4, "*nat\n:A - [0:0]\n")
    assert fake.save(V4, NAT) == EMPTY_NAT


def test_tables_commit_one_by_one_like_the_real_tools() -> None:
    fake = FakeIptables()
    with pytest.raises(IptablesError):
        fake.restore(V4, "*filter\n:C - [0:0]\nCOMMIT\n*nat\n-A NOPE -j RETURN\nCOMMIT\n")
    assert "C" in fake.chains(V4, FILTER)
    assert fake.save(V4, NAT) == EMPTY_NAT


def test_declare_and_delete_in_one_restore_and_rule_commands() -> None:
    fake = FakeIptables()
    fake.restore(V4, "*nat\n:A - [0:0]\n:B - [0:0]\n-A A -j B\n-A B -j RETURN\nCOMMIT\n")
    fake.restore(V4, "*nat\n:A - [0:0]\n:B - [0:0]\n-X A\n-X B\nCOMMIT\n")
    assert fake.chains(V4, NAT) == {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}
    fake.restore(
        V4,
        "# a comment line\n*nat\n-N C\n-A C -j RETURN\n-I C -j ACCEPT\n-I C 2 -j DROP\n"
        "-A C -m mark --mark 1 -j RETURN\n-D C 1\n-D C -m mark --mark 1 -j RETURN\nCOMMIT\n",
    )
    assert rules(fake) == ["-A C -j DROP", "-A C -j RETURN"]
    fake.restore(V4, "*nat\n-F C\nCOMMIT\n")
    assert rules(fake) == []


def test_a_rule_without_matches_or_target_is_kept() -> None:
    fake = FakeIptables()
    fake.restore(V4, "*filter\n:A - [0:0]\n-A A\n-A A -p tcp -m tcp --dport 80\nCOMMIT\n")
    assert rules(fake, V4, FILTER) == ["-A A", "-A A -p tcp -m tcp --dport 80"]


def test_counters_prefix_is_accepted_with_counters() -> None:
    fake = FakeIptables()
    fake.restore(V4, "*nat\n:A - [0:0]\n[5:300] -A A -j RETURN\nCOMMIT\n", counters=True)
    assert rules(fake) == ["-A A -j RETURN"]


def test_fail_next_fails_once_and_changes_nothing() -> None:
    fake = FakeIptables()
    fake.fail_next("boom")
    text = "*nat\n:A - [0:0]\nCOMMIT\n"
    with pytest.raises(IptablesError, match="boom"):
        fake.restore(V4, text)
    assert "A" not in fake.chains(V4, NAT)
    fake.restore(V4, text)
    assert "A" in fake.chains(V4, NAT)
    assert fake.restores == [(V4, text), (V4, text)]


def test_ensure_and_delete_rule() -> None:
    fake = FakeIptables()
    fake.restore(V4, "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n")
    args = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]
    assert fake.ensure_rule(V4, NAT, "PREROUTING", args)
    assert not fake.ensure_rule(V4, NAT, "PREROUTING", args)
    assert fake.ensure_rule(V4, NAT, "PREROUTING", ["-j", "RETURN"])  # prepended
    assert fake.ensure_rule(V4, NAT, "PREROUTING", ["-j", "ACCEPT"], prepend=False)
    assert rules(fake) == [
        "-A PREROUTING -j RETURN",
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "-A PREROUTING -j ACCEPT",
    ]
    assert fake.delete_rule(V4, NAT, "PREROUTING", args)
    assert not fake.delete_rule(V4, NAT, "PREROUTING", args)
    assert not fake.delete_rule(V4, NAT, "NOPE", args)
    assert not fake.delete_rule(V4, NAT, "PREROUTING", ["-j", "KUBE-NOPE"])
    with pytest.raises(IptablesError, match="does not exist"):
        fake.ensure_rule(V4, NAT, "PREROUTING", ["-j", "KUBE-NOPE"])
    with pytest.raises(IptablesError, match="No chain"):
        fake.ensure_rule(V4, NAT, "KUBE-NOPE", ["-j", "RETURN"])
    with pytest.raises(IptablesError):
        fake.save(V4, "raw")


def test_dump_reloads_into_a_fresh_fake() -> None:
    restore = RestoreInput()
    restore.declare(NAT, "KUBE-SERVICES")
    restore.declare(NAT, "KUBE-SVC-A")
    restore.append(NAT, "KUBE-SERVICES", f"-d 10.0.0.1/32 {comment('ns/a:p')} -j KUBE-SVC-A")
    restore.append(NAT, "KUBE-SVC-A", "-p tcp -m tcp -j DNAT --to-destination 10.1.0.1:80")
    first = FakeIptables()
    first.restore(V4, restore.render())
    second = FakeIptables()
    second.restore(V4, first.dump(V4))
    assert second.dump(V4) == first.dump(V4)


# Model-based property: random restores against a plain model of --noflush semantics. ----

CHAINS = ["KA", "KB", "KC"]


@dataclass
class Model:
    """User chains of one table: name -> rules (each a rendered rule after '-A CHAIN')."""

    chains: dict[str, list[str]] = field(default_factory=dict)

    def apply(self, ops: list[tuple[str, str, str]]) -> bool:
        """Apply one restore's ops; False (and no change) if the kernel would refuse it."""
        work = {name: list(body) for name, body in self.chains.items()}
        for op, chain, arg in ops:
            if op == "declare":
                work[chain] = []
            elif op == "append":
                if chain not in work or (arg not in ("RETURN", "ACCEPT") and arg not in work):
                    return False
                work[chain].append(f"-j {arg}")
            elif op == "delete":
                referenced = any(f"-j {chain}" in body for body in work.values())
                if chain not in work or work[chain] or referenced:
                    return False
                del work[chain]
        self.chains = work
        return True


OPS = st.lists(
    st.tuples(
        st.sampled_from(["declare", "append", "delete"]),
        st.sampled_from(CHAINS),
        st.sampled_from([*CHAINS, "RETURN", "ACCEPT"]),
    ),
    max_size=10,
)


def render_ops(ops: list[tuple[str, str, str]]) -> str:
    # Declarations first, then rules, then deletions: RestoreInput's order, which is also
    # the order the model applies them in.
    restore = RestoreInput()
    for op, chain, arg in ops:
        if op == "declare":
            restore.declare(NAT, chain)
        elif op == "append":
            restore.append(NAT, chain, f"-j {arg}")
        else:
            restore.delete_chain(NAT, chain)
    return restore.render()


def ordered(ops: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    rank = {"declare": 0, "append": 1, "delete": 2}
    return sorted(ops, key=lambda op: rank[op[0]])


@settings(max_examples=200, deadline=None)
@given(st.lists(OPS, min_size=1, max_size=6))
def test_random_restores_match_the_model(restores: list[list[tuple[str, str, str]]]) -> None:
    fake = FakeIptables()
    model = Model()
    for ops in restores:
        text = render_ops(ops)
        if not text:
            continue
        accepted = model.apply(ordered(ops))
        if accepted:
            fake.restore(V4, text)
        else:
            with pytest.raises(IptablesError):
                fake.restore(V4, text)
        user = {name for name in fake.chains(V4, NAT) if name.startswith("K")}
        assert user == set(model.chains)
        expected = sorted(
            f"-A {name} {rule}" for name, body in model.chains.items() for rule in body
        )
        assert sorted(rules(fake)) == expected
        # Per chain, order is kept.
        for name, body in model.chains.items():
            assert [r for r in rules(fake) if r.startswith(f"-A {name} ")] == [
                f"-A {name} {rule}" for rule in body
            ]
