"""Keeping a refused write (``kubeproxy.backends.nftables.failures``): bounded, named, and
never at the cost of the sync's own error."""

from __future__ import annotations

from pathlib import Path

from kubeproxy.backends.nftables.elements import ElementBatch
from kubeproxy.backends.nftables.failures import FailureDump
from kubeproxy.backends.nftables.objects import Family

TYPES = {"ports": (("inet_proto", "inet_service"), ())}


def test_a_long_refused_batch_is_cut_at_a_line_and_says_how_much_is_left(
    tmp_path: Path,
) -> None:
    adds = [("ports", ("tcp", str(1000 + i)), ()) for i in range(5000)]
    dump = FailureDump("ip", tmp_path, limit=4096)
    assert dump.write("nothing refused") is None
    dump.keep(ElementBatch(Family.IP, "kube-proxy", TYPES, adds=adds))
    path = dump.write("add element ports { tcp . 1000 }: File exists\nsecond line")
    assert path == tmp_path / "failed-sync-ip.nft"
    text = path.read_text()
    assert len(text.encode()) < 4096 + 100
    lines = text.splitlines()
    assert lines[1:3] == ["# add element ports { tcp . 1000 }: File exists", "# second line"]
    assert lines[3] == "add element ip kube-proxy ports { tcp . 1000 }"
    kept = sum(line.startswith("add element") for line in lines)
    assert lines[-1].startswith(f"# ... {5000 - kept} more lines not kept")
    assert dump.failed is None  # written once


def test_a_directory_that_cannot_be_written_costs_a_warning_only(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    dump = FailureDump("ip6", blocked / "state")
    dump.keep(ElementBatch(Family.IP6, "kube-proxy", TYPES, adds=[("ports", ("udp", "53"), ())]))
    assert dump.write("refused") is None
