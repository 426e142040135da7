"""The nftables support check: probes as data, one line naming what a kernel lacks.

On the fake: the nft version check, one transaction when everything works, and the
message naming the kernel, each missing feature and the kernel that has it. In the kernel
(a ``kpxs-`` namespace): every probe passes here, a probe the kernel refuses at commit
time (``reject`` in postrouting: a dry run would accept it) is caught and named, and
nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from collections.abc import Iterator

import pytest

from kubeproxy.backends.nftables import support
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.backends.nftables.layout import Dispatch, GenNames, fixed_chains
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.backends.nftables.support import (
    MIN_KERNEL,
    PROBE_TABLE,
    PROBES,
    TESTED_NFT,
    FeatureProbe,
    check_support,
    nft_cautions,
    probe_all,
    probe_transaction,
)
from kubeproxy.backends.nftables.table import tokens_for
from kubeproxy.backends.nftables.transaction import Transaction
from kubeproxy.objects import IPFamily

REFUSED = FeatureProbe(
    "refused",
    "reject in postrouting",
    "99.1",
    "1.0.0",
    "nothing (a probe no kernel accepts)",
    ("filter", "postrouting"),
    ("reject",),
)


def test_probes_are_well_formed_and_run_together() -> None:
    keys = [p.key for p in PROBES]
    assert len(keys) == len(set(keys))
    for family in (Family.IP, Family.IP6):
        tx = probe_transaction(PROBES, family)
        assert tx.error is None
        text = tx.render()
        assert f'add table {family} {PROBE_TABLE} {{ comment "kubeproxy support check" ; }}' in (
            text
        )
        # Every probe's rules hang off a jump that no packet takes.
        assert text.count("meta l4proto 255 jump") == sum(family in p.families for p in PROBES)
        FakeNft().run(tx)
    assert MIN_KERNEL == "5.10"
    assert {p.key for p in PROBES if not p.required} == {"prereject", "byteorder"}


@pytest.mark.parametrize("ip_family", [IPFamily.IPV4, IPFamily.IPV6])
def test_the_interval_probe_is_what_the_firewall_check_uses(ip_family: IPFamily) -> None:
    # The probe must be refused exactly where the structure would be: the same set
    # declaration and the same rule as the map structure's firewall-allow sets.
    tokens = tokens_for(ip_family)
    names = GenNames(1)
    (spec,) = [
        c for c in names.containers(tokens, Dispatch.TREE) if c.name == "firewall-allow-tcp.g1"
    ]
    chains = fixed_chains(
        names, tokens, masquerade_mark=0x4000, match_all_nodeports=True, service_cidrs=()
    )
    (check,) = [c for c in chains if c.name == "firewall-check"]
    family = Family(tokens.table_family)
    (probe,) = [p for p in PROBES if p.key == "interval"]
    text = probe_transaction([probe], family).render()
    table = f"{family} {PROBE_TABLE}"
    assert spec.typeof and spec.flags == ("interval",)
    assert f"add set {table} interval-set {{ typeof {spec.type} ; flags interval ; }}" in text
    rule = check.rules[0].replace("@firewall-allow-tcp.g1", "@interval-set")
    assert f"add rule {table} interval-probe {rule}\n" in text
    # No one-byte host-order field (meta l4proto) in the interval key: Debian's 6.12
    # refuses the byte-order conversion nft < 1.1.0 writes for it.
    assert "meta l4proto" not in spec.type


def test_check_support_on_the_fake(caplog: pytest.LogCaptureFixture) -> None:
    check_support(FakeNft())
    check_support(FakeNft(), Family.IP6)
    with pytest.raises(NftError, match=r"1\.0\.0 is too old"):
        check_support(FakeNft(version="1.0.0"))
    caplog.set_level(logging.INFO)
    caplog.clear()
    check_support(FakeNft(version="1.0.1"), Family.IP6)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert caplog.records[0].message.startswith("ip6: nftables 1.0.1 crashes (SIGSEGV) loading")
    caplog.clear()
    for tested in TESTED_NFT[1:]:
        check_support(FakeNft(version=tested))
    assert caplog.records == []


def test_cautions_follow_the_versions_that_lack_the_set_udata_fix() -> None:
    # nft 1.1.2 writes the user data; nftables be737a19 (1.1.4, 1.0.6.1) reads it safely;
    # 1.1.2 and 1.1.3 parse what they write themselves (1.1.3 read 1.1.7's sets here).
    cautioned = {v for v in ("0.9.8", "1.0.6", "1.0.7", "1.0.9", "1.1.1") if nft_cautions(v)}
    assert cautioned == {"0.9.8", "1.0.6", "1.0.7", "1.0.9", "1.1.1"}
    for fixed in ("1.0.6.1", "1.1.2", "1.1.3", "1.1.4", "1.1.7", "1.2.0"):
        assert nft_cautions(fixed) == [], fixed
    (line,) = nft_cautions("1.0.6")
    assert "kubernetes/kubernetes#136786" in line and "\n" not in line


class _Counting(FakeNft):
    runs = 0

    def run(self, tx: Transaction) -> None:
        if tx.table == PROBE_TABLE and len(tx) > 1:
            type(self).runs += 1
        super().run(tx)


def test_one_transaction_when_everything_works() -> None:
    fake = _Counting()
    check_support(fake, Family.IP)
    assert _Counting.runs == 1
    assert fake.dump() == ""


class _NoIntervals(FakeNft):
    """A kernel without interval concatenations (as before Linux 5.6)."""

    def run(self, tx: Transaction) -> None:
        if "flags interval" in tx.render():
            raise NftError("Error: Could not process rule: Operation not supported")
        super().run(tx)


def test_one_line_names_the_kernel_the_feature_and_the_kernel_that_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(support, "_kernel_release", lambda: "5.4.0-150-generic")
    fake = _NoIntervals()
    with pytest.raises(NftError) as caught:
        check_support(fake)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "kernel 5.4.0-150-generic lacks interval concatenations (Linux 5.6+; used for"
        " loadBalancerSourceRanges"
    )
    assert "nftables mode needs Linux 5.10 or newer" in message
    assert "numgen" not in message  # only what is missing
    assert fake.dump() == ""  # nothing left behind


def test_a_probe_that_is_not_required_refuses_nothing() -> None:
    optional = dataclasses.replace(REFUSED, required=False)
    check_support(_RefusesReject(), probes=(*PROBES[:2], optional))
    with pytest.raises(NftError, match=r"lacks reject in postrouting \(Linux 99\.1"):
        check_support(_RefusesReject(), probes=(*PROBES[:2], REFUSED))


class _RefusesReject(FakeNft):
    def run(self, tx: Transaction) -> None:
        if "refused-probe reject" in tx.render():
            raise NftError("Error: Could not process rule: Operation not supported")
        super().run(tx)


@pytest.fixture
def ns() -> Iterator[str]:
    name = f"kpxs-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.kernel
def test_every_probe_passes_in_this_kernel_and_leaves_nothing(ns: str) -> None:
    with LibNftables(netns=ns) as nft:
        for family in (Family.IP, Family.IP6):
            results = probe_all(nft, family)
            # A probe that is not required may fail (the kernel matrix reports it).
            assert [r.probe.key for r in results if not r.ok and r.probe.required] == [], results
            check_support(nft, family)
        assert nft.run_text("list ruleset") == ""


@pytest.mark.kernel
def test_a_refusal_at_commit_time_is_caught(ns: str) -> None:
    # `nft -c` accepts reject in postrouting; the commit does not. The probe must see it.
    with LibNftables(netns=ns) as nft:
        (result,) = probe_all(nft, Family.IP, (REFUSED,))
        assert not result.ok
        assert "Operation not supported" in (result.error or "")
        with pytest.raises(NftError, match=r"lacks reject in postrouting \(Linux 99\.1\+"):
            check_support(nft, probes=(*PROBES, REFUSED))
        assert nft.run_text("list ruleset") == ""


@pytest.mark.kernel
def test_the_decision_tree_probe_finds_the_kernels_depth_limit(ns: str) -> None:
    # The class dispatch may go TREE_DEPTH chains deep; 16 is where the kernel says no.
    with LibNftables(netns=ns) as nft:
        (deep_enough,) = probe_all(nft, Family.IP, (support._tree_probe(support.TREE_DEPTH),))
        assert deep_enough.ok, deep_enough.error
        (too_deep,) = probe_all(nft, Family.IP, (support._tree_probe(16),))
        assert "Too many links" in (too_deep.error or ""), too_deep
