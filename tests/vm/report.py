"""What a kernel's run found: counts, failures, probes (:mod:`tests.vm.guest`'s files).

``python -m tests.vm.report [LABEL...]`` prints the report of runs already in
``.cache/kernels/results/`` (and, with ``--against LABEL``, the tests whose outcome differs
from another run's, e.g. a run of the guest on this machine's own kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent.parent))

from tests.vm.matrix import CACHE

RESULTS = CACHE / "results"


def load_result(where: Path, label: str) -> dict[str, Any] | None:
    """The guest's ``<label>.json``, or None when the guest wrote none."""
    path = where / f"{label}.json"
    if not path.is_file():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed / failed / skipped / xfailed, from pytest's JUnit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                kind = child.get("type", "")
                outcome = "xfailed" if kind == "pytest.xfail" else "skipped"
        found[name] = outcome
    return found


def _nft(result: dict[str, Any]) -> str:
    """``nftables v1.1.3 (Commodore Bullmoose #4)`` -> ``1.1.3``."""
    words = str(result.get("nft", "")).split()
    return words[1].removeprefix("v") if len(words) > 1 else "?"


def _iptables(result: dict[str, Any]) -> str:
    """``iptables v1.8.11 (nf_tables)`` -> ``1.8.11 (nf_tables)``; "-" when not recorded."""
    text = str(result.get("iptables", "")).removeprefix("iptables ").removeprefix("v")
    return text or "-"


def kernel_report(
    result: dict[str, Any], where: Path, seconds: float, *, outer: str = "VM"
) -> tuple[list[str], bool]:
    """Lines describing one run (a kernel's, or a userspace's), and whether it holds no
    failure; ``seconds`` is the wall-clock time of the ``outer`` run (the VM's, say)."""
    label = result["label"]
    ok = True
    where_run = [f"kernel {result['kernel']}"]
    if "userspace" in result:
        where_run = [
            result["userspace"],
            *where_run,
            f"Python {result['python']}",
            f"nft {_nft(result)}",
            f"iptables {_iptables(result)}",
        ]
    else:
        where_run.append(result["nft"])
    lines = [
        f"== {label}: {', '.join(where_run)}, {result['cpus']} CPUs,"
        f" guest {result['seconds']:.0f} s, {outer} {seconds:.0f} s"
    ]
    failed_modules = {m: e for m, e in result["modules"].items() if e != "ok"}
    lines.append(
        "modules: none asked for (--no-modules)"
        if not result["modules"]
        else "modules: all loaded"
        if not failed_modules
        else "modules not loaded: " + "; ".join(f"{m}: {e}" for m, e in failed_modules.items())
    )
    for probe in result["probes"]:
        verdict = "ok" if probe["ok"] else f"REFUSED: {probe['error'][:200]}"
        lines.append(f"probe {probe['family']:<3} {probe['probe']}: {verdict}")
    binary = result["binary"]
    lines.append(
        f"kube-proxy-nftables --once: exit {binary['returncode']}"
        f" in {binary.get('seconds', 0):.1f} s"
    )
    if binary["returncode"] != 0:
        lines.extend(f"  {line}" for line in binary["output"][-5:])
    junit = where / f"{label}.xml"
    if "pytest_returncode" in result:
        if not junit.is_file():
            lines.append(f"pytest: exit {result['pytest_returncode']}, no results")
            return lines, False
        found = outcomes(junit)
        counts = Counter(found.values())
        lines.append(
            f"pytest: exit {result['pytest_returncode']}; "
            + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        )
        failures = sorted(name for name, outcome in found.items() if outcome == "failed")
        lines.extend(f"  FAILED {name}" for name in failures)
        ok = ok and result["pytest_returncode"] == 0 and not failures
    return lines, ok


def differences(mine: dict[str, str], theirs: dict[str, str]) -> list[tuple[str, str, str]]:
    """(test, outcome in ``mine``, outcome in ``theirs``) for every test whose outcome
    differs ("-" where a run does not have the test)."""
    return [
        (name, mine.get(name, "-"), theirs.get(name, "-"))
        for name in sorted(set(mine) | set(theirs))
        if mine.get(name) != theirs.get(name)
    ]


def versions_table(results: list[dict[str, Any]], where: Path) -> list[str]:
    """A Markdown table: each run's userspace, versions, pytest counts and time."""
    rows = [
        "| run | userspace | kernel | Python | nft | iptables | kernel tests | time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        junit = where / f"{result['label']}.xml"
        counts = Counter(outcomes(junit).values()) if junit.is_file() else Counter()
        tests = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "-"
        cells = [
            result["label"],
            result.get("userspace", "-"),
            result["kernel"],
            result.get("python", "-"),
            _nft(result),
            _iptables(result),
            tests,
            f"{result['seconds'] / 60:.1f} min",
        ]
        rows.append(f"| {' | '.join(cells)} |")
    return rows


def probe_table(results: list[dict[str, Any]]) -> list[str]:
    """A Markdown table: each probe (and family) against each run's kernel."""
    labels = [r["label"] for r in results]
    head = ["probe", "needs Linux", "used for", *(f"{r['label']} ({r['kernel']})" for r in results)]
    rows = [f"| {' | '.join(head)} |", f"|{' --- |' * len(head)}"]
    seen: dict[tuple[str, str], dict[str, str]] = {}
    facts: dict[str, tuple[str, str]] = {}
    from kubeproxy.backends.nftables.support import PROBES

    for probe in PROBES:
        facts[probe.name] = (probe.kernel, probe.used_for)
    for result in results:
        for probe in result["probes"]:
            cell = "ok" if probe["ok"] else "refused"
            seen.setdefault((probe["probe"], probe["family"]), {})[result["label"]] = cell
    for (name, family), cells in seen.items():
        kernel, used = facts.get(name, ("?", "?"))
        row = [f"{name} ({family})", kernel, used, *(cells.get(label, "-") for label in labels)]
        rows.append(f"| {' | '.join(row)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the reports of runs in the results folder."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("labels", nargs="*")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--against", help="list tests whose outcome differs from this run's")
    parser.add_argument("--probes", action="store_true", help="print the probes as a table")
    args = parser.parse_args(argv)
    if args.probes:
        found = [load_result(args.results, label) for label in args.labels]
        print("\n".join(probe_table([r for r in found if r is not None])))
        return 0
    labels = args.labels or sorted(p.stem for p in args.results.glob("*.json"))
    status = 0
    for label in labels:
        result = load_result(args.results, label)
        if result is None:
            print(f"{label}: no result")
            status = 1
            continue
        lines, ok = kernel_report(result, args.results, 0.0)
        print("\n".join(lines))
        status |= 0 if ok else 1
        if args.against and label != args.against:
            mine = outcomes(args.results / f"{label}.xml")
            theirs = outcomes(args.results / f"{args.against}.xml")
            for name, here, there in differences(mine, theirs):
                print(f"  differs: {name}: {here} here, {there} there")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
