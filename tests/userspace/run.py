"""``make test-userspace``: run the kernel tests in each userspace; report side by side.

Usage (as root, after ``scripts/setup-userspace.sh SUITE...``)::

    python -m tests.userspace.run [--report-only] [--every-test] [--no-cross] LABEL...
        [-- PYTEST_ARGS...]

A label is a Debian suite whose root filesystem ``scripts/setup-userspace.sh`` built
(``.cache/userspace/<suite>/root``, its venv in ``/opt/kubeproxy-venv``), or ``host``:
this machine's own userspace with the repository's ``.venv``, the baseline. Each runs
:mod:`tests.vm.guest` (what ``make test-kernels`` runs in each VM: the support probes, the
binary's start, every kernel test with ``CI=true``) through ``scripts/in-userspace.sh``:
new mount and PID namespaces, the repository bind-mounted, a private ``/run/netns``,
this machine's kernel, at native speed. Results (``<label>.json``, JUnit XML in
``<label>.xml``, ``<label>.pytest.log``) land in ``.cache/userspace/results/``; then one
block per userspace, as the kernel matrix prints, a table of versions, counts and times,
every test whose outcome differs from the host's, and (with two userspaces or more) how
each one's nft and proxy read the table another one's proxy wrote
(:mod:`tests.userspace.cross`, ``cross.json``). The exit status is 1 when a userspace
could not run or its results hold a failure; a crash across userspaces is reported, not
failed on (its cause is the readers' nft: see docs/kernels-and-images.md, "Userspaces tested").
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

sys.path.append(str(Path(__file__).resolve().parent.parent.parent))

from tests.userspace.cross import TIMEOUT_S, as_json, cross_read, cross_table
from tests.vm.matrix import ROOT
from tests.vm.report import differences, kernel_report, load_result, outcomes, versions_table

CACHE: Final = ROOT / ".cache" / "userspace"
RESULTS: Final = CACHE / "results"
HOST: Final = "host"
"""The label of this machine's own userspace."""
VENV_INSIDE: Final = "/opt/kubeproxy-venv"
"""Where scripts/setup-userspace.sh makes the venv in a root filesystem."""
RUN_TIMEOUT_S: Final = 3 * 3600


def has_root(label: str) -> bool:
    """Whether scripts/setup-userspace.sh made the root and venv of ``label``."""
    return (CACHE / label / "root" / VENV_INSIDE.lstrip("/")).is_dir()


def venv_bin(label: str) -> str:
    """The directory of the venv's scripts in userspace ``label`` (as seen inside it)."""
    return str(ROOT / ".venv/bin") if label == HOST else f"{VENV_INSIDE}/bin"


def in_userspace(label: str, command: Sequence[str]) -> list[str]:
    """``command`` run in userspace ``label`` by ``scripts/in-userspace.sh``."""
    root = "/" if label == HOST else str(CACHE / label / "root")
    return [str(ROOT / "scripts/in-userspace.sh"), root, *command]


def guest_command(
    label: str, out: Path, pytest_args: list[str], *, every_test: bool = False
) -> list[str]:
    """The command line running :mod:`tests.vm.guest` in the userspace ``label``."""
    return in_userspace(
        label,
        [
            f"{venv_bin(label)}/python",
            "tests/vm/guest.py",
            "--label",
            label,
            "--scope",
            "full",
            "--no-modules",
            *(["--every-test"] if every_test else []),
            "--out",
            str(out),
            "--",
            *pytest_args,
        ],
    )


def run(label: str, out: Path, pytest_args: list[str], *, every_test: bool = False) -> float:
    """Run the guest in one userspace (its output in ``<label>.log``); wall-clock seconds."""
    started = time.monotonic()
    with (out / f"{label}.log").open("w") as sink:
        subprocess.run(
            guest_command(label, out, pytest_args, every_test=every_test),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    return time.monotonic() - started


def cross(labels: list[str], out: Path) -> list[str]:
    """Each userspace reading the table each other one's proxy wrote; the table's lines."""
    binds = subprocess.run(
        [str(ROOT / "scripts/in-userspace.sh"), "--binds"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def run_in(netns: str, label: str, command: Sequence[str]) -> int:
        if command[0] == "kube-proxy-nftables":
            command = [f"{venv_bin(label)}/{command[0]}", *command[1:]]
        done = subprocess.run(
            ["ip", "netns", "exec", netns, *in_userspace(label, command)],
            env=dict(os.environ, KPX_USERSPACE_BINDS=binds),
            capture_output=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        return done.returncode

    found = cross_read(labels, run_in)
    (out / "cross.json").write_text(json.dumps(as_json(found), indent=1) + "\n")
    nft = {}
    for label in labels:
        result = load_result(out, label)
        if result is not None:
            nft[label] = result["nft"].split()[1].removeprefix("v")
    return cross_table(found, nft)


def compare(result: dict[str, Any], host: dict[str, Any] | None, where: Path) -> list[str]:
    """The tests whose outcome in ``result``'s run differs from the host's."""
    if host is None or result["label"] == HOST:
        return []
    mine, theirs = where / f"{result['label']}.xml", where / f"{HOST}.xml"
    if not (mine.is_file() and theirs.is_file()):
        return []
    here, there = outcomes(mine), outcomes(theirs)
    found = [d for d in differences(here, there) if "-" not in d[1:]]
    # A run of the whole suite against a run of the kernel tests: the tests one of them
    # did not run are counted, not listed.
    lines = [
        f"{result['label']} against {HOST}: {len(found)} tests differ"
        f" ({len(here.keys() - there.keys())} ran only here,"
        f" {len(there.keys() - here.keys())} only on {HOST})"
    ]
    lines.extend(f"  {name}: {a} here, {b} on {HOST}" for name, a, b in found)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run every userspace named; print the reports; 0 when all ran without failure."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("labels", nargs="+", help=f"Debian suites, or {HOST}")
    parser.add_argument("--report-only", action="store_true", help="print stored results")
    parser.add_argument(
        "--every-test", action="store_true", help="the whole suite, not only the kernel tests"
    )
    parser.add_argument(
        "--no-cross", action="store_true", help="skip reading tables across userspaces"
    )
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    pytest_args = argv[cut + 1 :]
    RESULTS.mkdir(parents=True, exist_ok=True)
    # One run at a time (scripts/setup-userspace.sh takes the same lock): two would
    # share the results folder.
    lock = (CACHE / ".lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    status = 0
    seconds: dict[str, float] = {}
    for label in args.labels:
        if args.report_only:
            continue
        if label != HOST and not has_root(label):
            print(f"test-userspace: {label}: no root (scripts/setup-userspace.sh {label})")
            status = 1
            continue
        for stale in RESULTS.glob(f"{label}.*"):
            stale.unlink()
        print(f"test-userspace: {label}: running the kernel tests", flush=True)
        seconds[label] = run(label, RESULTS, pytest_args, every_test=args.every_test)
    found = [r for r in (load_result(RESULTS, label) for label in args.labels) if r is not None]
    host = load_result(RESULTS, HOST)
    for label in args.labels:
        result = next((r for r in found if r["label"] == label), None)
        if result is None:
            print(f"test-userspace: {label}: no result (see {RESULTS / label}.log)")
            status = 1
            continue
        lines, ok = kernel_report(result, RESULTS, seconds.get(label, 0.0), outer="run")
        lines.extend(compare(result, host, RESULTS))
        print("\n".join(lines), flush=True)
        status |= 0 if ok else 1
    shown = found if host is None or HOST in args.labels else [host, *found]
    print("\n".join(versions_table(shown, RESULTS)))
    ran = [label for label in args.labels if label == HOST or has_root(label)]
    if len(ran) > 1 and not args.no_cross:
        print("test-userspace: tables written in one userspace, read in another", flush=True)
        print("\n".join(cross(ran, RESULTS)))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
