"""make test-userspace's pure parts: the commands it runs, its reports, the cross table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_vm_matrix import JUNIT
from tests.userspace.cross import CrossRead, cross_table, verdict
from tests.userspace.run import CACHE, guest_command
from tests.vm.matrix import ROOT
from tests.vm.report import differences, kernel_report, versions_table

RESULT = {
    "label": "trixie",
    "kernel": "6.18.44",
    "userspace": "Debian GNU/Linux 13 (trixie)",
    "python": "3.13.5",
    "nft": "nftables v1.1.3 (Commodore Bullmoose #4)",
    "iptables": "iptables v1.8.11 (nf_tables)",
    "cpus": 2,
    "seconds": 600.0,
    "modules": {},
    "probes": [],
    "binary": {"returncode": 0, "seconds": 0.8},
    "pytest_returncode": 1,
}


def test_a_root_runs_its_own_venv_and_the_host_the_repositorys() -> None:
    inside = guest_command("trixie", Path("/out"), ["-k", "x"])
    assert inside[:3] == [
        str(ROOT / "scripts/in-userspace.sh"),
        str(CACHE / "trixie" / "root"),
        "/opt/kubeproxy-venv/bin/python",
    ]
    assert "--no-modules" in inside and inside[-3:] == ["--", "-k", "x"]
    assert "--every-test" not in inside
    host = guest_command("host", Path("/out"), [], every_test=True)
    assert host[1:3] == ["/", str(ROOT / ".venv/bin/python")]
    assert "--every-test" in host


def test_a_userspace_report_names_its_versions_and_failures(tmp_path: Path) -> None:
    (tmp_path / "trixie.xml").write_text(JUNIT)
    (tmp_path / "trixie.json").write_text(json.dumps(RESULT))
    lines, ok = kernel_report(RESULT, tmp_path, 620.0, outer="run")
    assert not ok
    assert lines[0] == (
        "== trixie: Debian GNU/Linux 13 (trixie), kernel 6.18.44, Python 3.13.5, nft 1.1.3,"
        " iptables 1.8.11 (nf_tables), 2 CPUs, guest 600 s, run 620 s"
    )
    assert "modules: none asked for (--no-modules)" in lines
    assert "  FAILED tests.test_a::test_bad" in lines
    table = versions_table([RESULT], tmp_path)
    assert table[2] == (
        "| trixie | Debian GNU/Linux 13 (trixie) | 6.18.44 | 3.13.5 | 1.1.3 |"
        " 1.8.11 (nf_tables) | 1 failed, 1 passed, 1 skipped, 1 xfailed | 10.0 min |"
    )


def test_a_kernel_run_without_userspace_fields_still_reports() -> None:
    kernel_only = {k: v for k, v in RESULT.items() if k not in ("userspace", "python")}
    del kernel_only["pytest_returncode"]
    lines, ok = kernel_report(kernel_only, Path("/nowhere"), 5.0)
    assert ok
    assert lines[0].startswith("== trixie: kernel 6.18.44, nftables v1.1.3")
    row = versions_table([kernel_only], Path("/nowhere"))[2]
    assert row.startswith("| trixie | - | 6.18.44 | - | 1.1.3 | 1.8.11 (nf_tables) | - |")


def test_differences_name_both_outcomes_and_missing_tests() -> None:
    mine = {"a": "passed", "b": "failed", "c": "skipped"}
    theirs = {"a": "passed", "b": "passed", "d": "passed"}
    assert differences(mine, theirs) == [
        ("b", "failed", "passed"),
        ("c", "skipped", "-"),
        ("d", "-", "passed"),
    ]


def test_exit_statuses_read_as_signals_where_they_are() -> None:
    assert verdict(0) == "ok"
    assert verdict(139) == "SIGSEGV"  # through a shell: 128 + 11
    assert verdict(-11) == "SIGSEGV"  # from subprocess directly
    assert verdict(1) == "exit 1"
    assert verdict(255) == "exit 255"  # no signal 127


def test_the_cross_table_has_a_row_per_writer_and_a_column_per_reader() -> None:
    found = [
        CrossRead("host", "host", 0, 0, 0),
        CrossRead("host", "sid", 0, 0, 0),
        CrossRead("sid", "host", 0, 139, 139),
        CrossRead("sid", "sid", 0, 0, 0),
    ]
    assert cross_table(found, {"host": "1.0.6", "sid": "1.1.7"}) == [
        "| table written by | read by host (nft 1.0.6): list / proxy"
        " | read by sid (nft 1.1.7): list / proxy |",
        "| --- | --- | --- |",
        "| host (nft 1.0.6)'s proxy | ok / ok | ok / ok |",
        "| sid (nft 1.1.7)'s proxy | SIGSEGV / SIGSEGV | ok / ok |",
    ]
    failed_writer = [CrossRead("sid", "sid", 1, 0, 0)]
    assert cross_table(failed_writer, {})[2] == "| sid's proxy | (writer: exit 1) |"
