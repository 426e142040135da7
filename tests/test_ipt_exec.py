"""IptablesCommands against the real kernel (both variants, both families) in namespaces.

Every test works in namespaces it creates (``kpxia-*``, one variant per namespace, always
deleted). The key check keeps the fake honest: the same input loaded into the kernel and
into FakeIptables dumps the same rules.
"""

from __future__ import annotations

import re
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kubeproxy.backends.iptables.exec import (
    IptablesCommands,
    IptablesError,
    IptablesVariant,
    _failed_line,
    check_support,
    detect_variant,
    tool_name,
)
from kubeproxy.backends.iptables.fake import FakeIptables
from kubeproxy.backends.iptables.restore import FILTER, MANGLE, NAT, RestoreInput, comment
from kubeproxy.objects import IPFamily

pytestmark = pytest.mark.kernel

V4, V6 = IPFamily.IPV4, IPFamily.IPV6
NFT, LEGACY = IptablesVariant.NFT, IptablesVariant.LEGACY
VARIANTS = [NFT, LEGACY]


@contextmanager
def namespace(tag: str) -> Iterator[str]:
    name = f"kpxia-{tag}-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.fixture(params=VARIANTS)
def commands(request: pytest.FixtureRequest) -> Iterator[IptablesCommands]:
    variant: IptablesVariant = request.param
    with namespace(variant.value) as netns:
        yield IptablesCommands(variant, netns=netns)


def normalise(save_text: str) -> str:
    """iptables-save text without its comment lines and with zero counters."""
    lines = [line for line in save_text.splitlines() if not line.startswith("#")]
    return "".join(re.sub(r"\[\d+:\d+\]", "[0:0]", line) + "\n" for line in lines)


def sample(family: IPFamily) -> RestoreInput:
    """A small kube-proxy-shaped ruleset in filter and nat."""
    v6 = family == IPFamily.IPV6
    vip, ep1, ep2 = (
        ("fd00::10", "fd01::1", "fd01::2") if v6 else ("10.96.0.10", "10.1.0.1", "10.1.0.2")
    )
    host, pods = ("/128", "fd01::/64") if v6 else ("/32", "10.1.0.0/16")
    reject = "icmp6-port-unreachable" if v6 else "icmp-port-unreachable"
    restore = RestoreInput()
    for chain in ("KUBE-FORWARD", "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"):
        restore.declare(FILTER, chain)
    restore.append(FILTER, "KUBE-FORWARD", "-m conntrack --ctstate INVALID -j DROP")
    restore.append(
        FILTER,
        "KUBE-FORWARD",
        f"{comment('kubernetes forwarding rules')} -m mark --mark 0x4000/0x4000 -j ACCEPT",
    )
    restore.append(
        FILTER,
        "KUBE-SERVICES",
        f"-d {vip}{host} -p tcp {comment('ns/empty:http has no endpoints')} -m tcp --dport 81 "
        f"-j REJECT --reject-with {reject}",
    )
    svc, sep1, sep2 = "KUBE-SVC-AAAAAAAAAAAAAAAA", "KUBE-SEP-BBBBBBBBBBBBBBBB", "KUBE-SEP-C"
    for chain in ("KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-POSTROUTING", svc, sep1, sep2):
        restore.declare(NAT, chain)
    restore.append(NAT, "KUBE-MARK-MASQ", "-j MARK --set-xmark 0x4000/0x4000")
    # The MARK shorthands and a bare REJECT, which iptables-save prints in another form.
    for shorthand in ("--or-mark 0x4000", "--xor-mark 0x8000", "--and-mark 0x10"):
        restore.append(NAT, "KUBE-MARK-MASQ", f"-j MARK {shorthand}")
    restore.append(NAT, "KUBE-MARK-MASQ", "-j MARK --set-mark 0x1")
    restore.append(NAT, "KUBE-MARK-MASQ", "-j MARK --set-mark 0x2/0xff")
    restore.append(FILTER, "KUBE-FORWARD", "-p udp -j REJECT")
    restore.append(NAT, "KUBE-POSTROUTING", "-m mark ! --mark 0x4000/0x4000 -j RETURN")
    restore.append(NAT, "KUBE-POSTROUTING", "-j MARK --set-xmark 0x4000/0x0")
    restore.append(
        NAT,
        "KUBE-POSTROUTING",
        f"{comment('kubernetes service traffic requiring SNAT')} -j MASQUERADE --random-fully",
    )
    svc_comment = comment('ns/web:http "quoted" cluster IP')
    # Some rules are written out of iptables-save's order and form (no /32, options late,
    # no "-m tcp"): the kernel and the fake must both print them in save form.
    restore.append(NAT, "KUBE-SERVICES", f"{svc_comment} -p tcp -d {vip} --dport 80 -j {svc}")
    restore.append(
        NAT,
        svc,
        f"! -s {pods} -d {vip}{host} -p tcp {svc_comment} -m tcp --dport 80 -j KUBE-MARK-MASQ",
    )
    restore.append(
        NAT,
        svc,
        f"{comment('ns/web:http -> ep1')} -m statistic --mode random --probability 0.5 -j {sep1}",
    )
    restore.append(NAT, svc, f"{comment('ns/web:http -> ep2')} -j {sep2}")
    for sep, ep in ((sep1, ep1), (sep2, ep2)):
        target = f"[{ep}]:8080" if v6 else f"{ep}:8080"
        restore.append(NAT, sep, f"-j KUBE-MARK-MASQ -s {ep}")
        restore.append(NAT, sep, f"-p tcp -m tcp -j DNAT --to-destination {target}")
    return restore


# Helpers, without the kernel ------------------------------------------------------------


def test_tool_names() -> None:
    assert tool_name(NFT, V4, "-restore") == "iptables-nft-restore"
    assert tool_name(LEGACY, V6, "-save") == "ip6tables-legacy-save"
    assert tool_name(LEGACY, V4) == "iptables-legacy"


def test_failed_line_reads_both_variants_messages() -> None:
    text = "*nat\n:A - [0:0]\n-A A -j NOPE\nCOMMIT\n"
    legacy = (
        "iptables-restore v1.8.9 (legacy): Couldn't load target `NOPE'\nError occurred at line: 3"
    )
    assert _failed_line(legacy, text) == (3, "-A A -j NOPE")
    # iptables-nft names the COMMIT line for a missing jump target; the rule is reported.
    nft = (
        "iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE' does not exist\n"
        "Error occurred at line: 4"
    )
    assert _failed_line(nft, text) == (3, "-A A -j NOPE")
    assert _failed_line("iptables-restore: line 2 failed", text) == (2, ":A - [0:0]")
    assert _failed_line("line 2: CHAIN_DEL failed (Device or resource busy): chain A", text)[0] == 2
    assert _failed_line("something else", text) == (None, None)
    assert _failed_line("line 99 failed", text) == (99, None)


# The kernel ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [V4, V6])
def test_same_input_dumps_the_same_in_kernel_and_fake(
    commands: IptablesCommands, family: IPFamily
) -> None:
    fake = FakeIptables(commands.variant)
    text = sample(family).render()
    commands.restore(family, text)
    fake.restore(family, text)
    hook = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]
    for executor in (commands, fake):
        assert executor.ensure_rule(family, NAT, "PREROUTING", hook)
    for table in (FILTER, NAT):
        assert normalise(commands.save(family, table)) == fake.dump(family, table)
    # A second sync: one endpoint gone, its chain flushed and deleted in the same input.
    update = RestoreInput()
    svc = "KUBE-SVC-AAAAAAAAAAAAAAAA"
    update.declare(NAT, svc)
    update.declare(NAT, "KUBE-SEP-C")
    update.append(NAT, svc, "-j KUBE-SEP-BBBBBBBBBBBBBBBB")
    update.delete_chain(NAT, "KUBE-SEP-C")
    # -D matches a rule written in another form than the kernel prints it (both ways).
    vip = "fd00::10" if family == IPFamily.IPV6 else "10.96.0.10"
    svc_comment = comment('ns/web:http "quoted" cluster IP')
    update.delete_rule(NAT, "KUBE-SERVICES", f"{svc_comment} -p tcp -d {vip} --dport 80 -j {svc}")
    update.insert(NAT, "KUBE-SERVICES", f"-d {vip} -p tcp {svc_comment} --dport 8080 -j {svc}")
    commands.restore(family, update.render())
    fake.restore(family, update.render())
    assert normalise(commands.save(family, NAT)) == fake.dump(family, NAT)
    assert "--dport 8080" in fake.dump(family, NAT)
    assert "--dport 80 " not in fake.dump(family, NAT)
    assert "KUBE-SEP-C" not in commands.chains(family, NAT)
    assert commands.chains(family, NAT) == fake.chains(family, NAT)


def test_failed_restore_changes_nothing_and_names_the_line(commands: IptablesCommands) -> None:
    commands.restore(V4, sample(V4).render())
    before = {table: commands.save(V4, table) for table in (FILTER, NAT)}
    bad = RestoreInput()
    bad.declare(NAT, "KUBE-SERVICES")  # would flush it
    bad.declare(NAT, "KUBE-NEW")
    bad.append(NAT, "KUBE-NEW", "-j RETURN")
    bad.append(NAT, "KUBE-SERVICES", "-j KUBE-MISSING")
    with pytest.raises(IptablesError) as caught:
        commands.restore(V4, bad.render())
    assert caught.value.line == "-A KUBE-SERVICES -j KUBE-MISSING"
    assert caught.value.returncode not in (None, 0)
    assert "KUBE-MISSING" in caught.value.stderr
    # A chain still referenced cannot go.
    referenced = RestoreInput()
    referenced.delete_chain(NAT, "KUBE-MARK-MASQ")
    with pytest.raises(IptablesError) as caught:
        commands.restore(V4, referenced.render())
    assert caught.value.line == "-X KUBE-MARK-MASQ"
    for table in (FILTER, NAT):
        assert normalise(commands.save(V4, table)) == normalise(before[table])
    assert "KUBE-NEW" not in commands.chains(V4, NAT)


def test_ensure_rule_is_idempotent_and_delete_rule(commands: IptablesCommands) -> None:
    commands.restore(V6, "*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n")
    args = ["-m", "comment", "--comment", "kubernetes forwarding rules", "-j", "KUBE-FORWARD"]
    assert commands.ensure_rule(V6, FILTER, "FORWARD", args)
    assert not commands.ensure_rule(V6, FILTER, "FORWARD", args)
    assert commands.ensure_rule(V6, FILTER, "FORWARD", ["-j", "ACCEPT"], prepend=False)
    rules = [line for line in commands.save(V6, FILTER).splitlines() if line.startswith("-A")]
    assert rules == [
        '-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD',
        "-A FORWARD -j ACCEPT",
    ]
    assert commands.delete_rule(V6, FILTER, "FORWARD", args)
    assert not commands.delete_rule(V6, FILTER, "FORWARD", args)
    with pytest.raises(IptablesError):
        commands.ensure_rule(V6, FILTER, "FORWARD", ["-j", "KUBE-NOPE"])
    # A jump to a missing chain (iptables -C exits 2) or in a missing chain: not there.
    assert not commands.delete_rule(V6, FILTER, "FORWARD", ["-j", "KUBE-NOPE"])
    assert not commands.delete_rule(V6, FILTER, "KUBE-NOPE", ["-j", "ACCEPT"])
    with pytest.raises(IptablesError, match="bogus"):
        commands.delete_rule(V6, FILTER, "FORWARD", ["-j", "ACCEPT", "--bogus"])
    check_support(commands, (V4, V6))


def test_check_support_explains_a_failure() -> None:
    commands = IptablesCommands(NFT, netns="kpxia-does-not-exist")
    with pytest.raises(IptablesError, match="cannot read the IPv4 nat table"):
        check_support(commands)


@pytest.mark.parametrize(
    ("variant", "family", "content", "expected"),
    [
        (None, V4, "", NFT),  # an empty node: nft
        (LEGACY, V4, "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n", LEGACY),
        (LEGACY, V6, "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n", LEGACY),
        (NFT, V6, "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n", NFT),
        (LEGACY, V4, "*filter\n:X - [0:0]\n-A X -j RETURN\n-A INPUT -j X\nCOMMIT\n", LEGACY),
    ],
)
def test_detect_variant(
    variant: IptablesVariant | None, family: IPFamily, content: str, expected: IptablesVariant
) -> None:
    with namespace("detect") as netns:
        if variant is not None:
            IptablesCommands(variant, netns=netns).restore(family, content)
        assert detect_variant(netns) is expected
        assert IptablesCommands(netns=netns).variant is expected


def test_restore_with_counters(commands: IptablesCommands) -> None:
    commands.restore(
        V4, "*mangle\n:KUBE-C - [0:0]\n[7:420] -A KUBE-C -j RETURN\nCOMMIT\n", counters=True
    )
    assert (
        "[7:420] -A KUBE-C -j RETURN"
        in subprocess.run(
            [
                "nsenter",
                f"--net=/run/netns/{commands.netns}",
                tool_name(commands.variant, V4, "-save"),
                "-c",
                "-t",
                MANGLE,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


SETUP = "*nat\n:FULL - [0:0]\n:REF - [0:0]\n-A FULL -j RETURN\n-A REF -j FULL\nCOMMIT\n"
REFUSED = [
    "*nat\n-A NOPE -j RETURN\nCOMMIT\n",
    "*nat\n:A - [0:0]\n-A A -j NOPE\nCOMMIT\n",
    "*nat\n:A - [0:0]\n-A A -j PREROUTING\nCOMMIT\n",
    "*nat\n:A - [0:0]\n-A A -j REJECT\nCOMMIT\n",
    "*filter\n:A - [0:0]\n-A A -p tcp -j DNAT --to-destination 1.2.3.4\nCOMMIT\n",
    "*nat\n-X NOPE\nCOMMIT\n",
    "*nat\n-X FULL\nCOMMIT\n",
    "*nat\n:FULL - [0:0]\n-X FULL\nCOMMIT\n",
    "*nat\n-N FULL\nCOMMIT\n",
    "*nat\n-D FULL -j ACCEPT\nCOMMIT\n",
    "*nat\n:A - [0:0]\n",
    "*raw2\nCOMMIT\n",
]


def test_kernel_and_fake_refuse_the_same_inputs(commands: IptablesCommands) -> None:
    fake = FakeIptables(commands.variant)
    for executor in (commands, fake):
        executor.restore(V4, SETUP)
    for text in REFUSED:
        for executor in (commands, fake):
            with pytest.raises(IptablesError):
                executor.restore(V4, text)
        for table in (FILTER, NAT):
            assert normalise(commands.save(V4, table)) == fake.dump(V4, table), text
    # And both accept flushing and deleting in one input.
    accepted = "*nat\n:FULL - [0:0]\n:REF - [0:0]\n-X REF\n-X FULL\nCOMMIT\n"
    for executor in (commands, fake):
        executor.restore(V4, accepted)
    assert normalise(commands.save(V4, NAT)) == fake.dump(V4, NAT)
