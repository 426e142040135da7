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


def kernel_report(result: dict[str, Any], where: Path, seconds: float) -> tuple[list[str], bool]:
    """Lines describing one kernel's run, and whether it holds no failure."""
    label = result["label"]
    ok = True
    lines = [
        f"== {label}: kernel {result['kernel']}, {result['nft']}, {result['cpus']} CPUs,"
        f" guest {result['seconds']:.0f} s, VM {seconds:.0f} s"
    ]
    failed_modules = {m: e for m, e in result["modules"].items() if e != "ok"}
    lines.append(
        "modules: all loaded"
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
            for name in sorted(set(mine) | set(theirs)):
                if mine.get(name) != theirs.get(name):
                    print(f"  differs: {name}: {mine.get(name)} here, {theirs.get(name)} there")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
