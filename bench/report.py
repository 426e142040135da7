"""Benchmark results: records, machine information, the JSON file and the Markdown summary.

A run collects flat records (one dict per measurement, ``kind`` says which), then writes
``bench/results/<date>-<host>.json`` (machine info, command, records, target checks) and
``bench/results/latest.md``. Records are plain JSON so later tools (plots, other backends)
read them without importing this module.

Record kinds and their fields (every record also has ``subject``, one of
:data:`bench.subjects.SUBJECTS`' names: ``kubeproxy-nftables`` (the map structure),
``kubeproxy-nftables-chains`` (the per-Service-chain structure), ``kubeproxy-iptables-nft``,
``kubeproxy-iptables-legacy``, or ``upstream-nft`` for upstream's structure applied with
``nft``):

* ``cold`` (a first sync into an empty namespace) and ``restart`` (a fresh process's first
  sync over the rules a previous one left): ``services``, ``endpoints``, optional
  ``affinity`` (true) or ``mix`` (its description), ``seconds`` (end to end), ``feed_s``,
  ``sync_s``, ``tool_s`` (inside the kernel tools), ``tool_calls``, ``tools`` (per tool:
  seconds, calls, during the sync),
  ``proxy_peak_mb`` (peak RSS of our proxy process; None for upstream), ``rss_after_mb``
  (its resident size holding the Services after the sync), ``input_mb`` (how much of
  that resident size the benchmark's own synthetic input takes: the growth while it was
  built), ``tool_peak_mb`` (the largest tool process: iptables-restore, nft), ``ok``,
  ``timed_out`` (killed after ``seconds``);
* ``incremental``: ``services``, ``op`` (endpoint/add/remove), ``rounds``, ``median_ms``,
  ``p90_ms``, ``max_ms``, ``tool_median_ms``, ``ok``;
* ``dataplane``: ``services`` (installed), ``case`` (direct, service-10, service-2,
  service-1000), ``p50_us``, ``p90_us``, ``p99_us``, ``mean_us``, ``count``, ``failures``,
  ``overhead_us`` (p50 minus the direct case's p50 in the same topology);
* ``dataplane_skipped``: ``services``, ``timed_out``: the sync never finished;
* ``whole_process``: ``services``, ``how`` (the command), ``rounds``, ``seconds`` (median
  from process start to exit), ``min_s``, ``max_s``, ``peak_mb`` (the process's peak RSS,
  ``wait4``), ``ok``, ``timed_out``;
* ``daemon`` (issue 20: ``kube-proxy-nftables`` started as a process, :mod:`bench.daemonbench`):
  ``services``, ``source`` (``api``, ``manifests``, ``manifests-yaml``), ``livez_s`` and
  ``healthz_s`` (first answers, from the process start), ``healthz_before_sync`` (the
  codes ``/healthz`` gave before its first 200), ``first_sync_s`` (``/healthz`` turning
  200), ``peak_mb`` and ``rss_mb`` (the daemon's), ``split_source_mb``,
  ``split_proxier_mb``, ``split_backend_mb`` (where its memory is, at 100k), and with
  partial syncs ``median_ms``, ``p90_ms``, ``max_ms``, ``mean_ms`` (its own
  partial-sync metric, one endpoint change at a time), ``ok``;
* ``daemon_churn``: ``services``, ``rate``, ``wall_s``, ``cpu_share``, ``partial_syncs``,
  ``syncs_per_s``, ``partial_mean_ms``, ``programming_p50_s``/``programming_p99_s`` (the
  histogram buckets holding them), ``programming_mean_s``, ``programming_over_1s``, ``ok``;
* ``incremental_cadence``: ``services``, ``gap_s``, ``median_ms``, ``p90_ms``, ``max_ms``:
  the in-process endpoint change, one every ``gap_s`` seconds (the daemon's cadence);
* ``churn``: ``services``, ``rate`` (endpoint changes per second), ``seconds`` (the
  window), ``changes``, ``syncs``, ``syncs_per_s``, ``full_syncs``, ``failed_syncs``,
  ``sync_p50_ms``, ``sync_p99_ms``, ``sync_max_ms`` (the core's sync durations),
  ``services_per_sync`` (median), ``cpu_s`` (process CPU time in the window),
  ``cpu_share`` (``cpu_s`` / ``seconds``: share of one core), ``late_max_s`` (how far
  the change feed fell behind its schedule), ``min_sync_period_s``, ``ok``.

Target checks: issue 4's (the nftables backend against upstream and linear growth) and
issue 11's (per-change cost independent of the cluster, 100k Services), each evaluated on
the shipped nftables backend (``kubeproxy-nftables``) with the per-Service-chain
structure's figure of the same run quoted next to it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.targets import (
    CHAINS,
    IPT_NFT,
    NO_RULES,
    OURS,
    SUBJECT_ORDER,
    SUBJECT_TITLES,
    UPSTREAM,
    Record,
    TargetCheck,
    evaluate_targets,
    find,
    full_sync,
    one,
    plain,
    size_label,
    whole_process_ratio,
)

__all__ = [
    "Results",
    "machine_info",
    "newest_document",
    "readme_headline",
    "readme_summary",
    "render_markdown",
    "sizing_table",
    "subject_titles",
    "write_document",
]


def _run(argv: Sequence[str]) -> str:
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return result.stdout.strip()


# The folders of the code a run measures: the core and the backends, the chain structure.
_MEASURED_CODE = ("kubeproxy", "bench/chain_structure")


def code_fingerprint() -> str:
    """A hash of the measured code as it is on disk (``_MEASURED_CODE``).

    Taken at the start and the end of a run: children import the code afresh, so code
    edited during a run would make its figures mix two versions.
    """
    repo = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for folder in _MEASURED_CODE:
        for path in sorted((repo / folder).rglob("*.py")):
            digest.update(str(path.relative_to(repo)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def machine_info() -> dict[str, Any]:
    """Where the figures come from: cores, kernel, nft, Python, memory, commit, date."""
    meminfo = Path("/proc/meminfo")
    total_kb = 0
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total_kb = int(line.split()[1])
    repo = Path(__file__).resolve().parents[1]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "nft": _run(["nft", "--version"]),
        "iptables": _run(["iptables", "--version"]),
        "python": platform.python_version(),
        "memory_gb": round(total_kb / 1024 / 1024, 1),
        "commit": _run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"]),
        # Uncommitted changes to the measured code make the commit inexact.
        "dirty": bool(
            _run(["git", "-C", str(repo), "status", "--porcelain", "--", *_MEASURED_CODE])
        ),
    }


def recorded_command(default: str, environ: Mapping[str, str] = os.environ) -> str:
    """The command a results file records: ``KPXB_COMMAND`` when set, else ``default``;
    with the ``BENCH_ARGS`` a ``make bench`` run was given (make exports command-line
    variables to its recipes). A selection recorded as plain ``make bench`` would pass
    for a full run, and ``bench.readme`` would quote its partial figures as the run."""
    command = environ.get("KPXB_COMMAND") or default
    selection = environ.get("BENCH_ARGS", "").strip()
    if command == "make bench" and selection:
        return f"make bench BENCH_ARGS={shlex.quote(selection)}"
    return command


def write_document(
    out: Path, kind: str, command: str, fields: dict[str, Any]
) -> tuple[Path, dict[str, Any]]:
    """The results document of a benchmark that keeps its own (``kind``: the network
    programming, the kernel floor, the memory): when, the commit, the command
    (``KPXB_COMMAND`` when set, else ``command``), the machine, then ``fields``; written
    as ``out/<date>-<kind>-<host>.json``. Returns the path and the document."""
    now = datetime.datetime.now(datetime.UTC)
    machine = machine_info()
    document = {
        "kind": kind,
        "when": now.isoformat(timespec="seconds"),
        "commit": machine["commit"] or None,
        "command": recorded_command(command),
        "machine": machine,
        **fields,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{kind}-{machine['host']}.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path, document


def newest_document(results: Path, kind: str) -> tuple[Path, dict[str, Any]]:
    """The newest document of ``kind`` (see :func:`write_document`) in ``results``."""
    found = []
    for path in results.glob(f"*-{kind}-*.json"):
        document = json.loads(path.read_text())
        if document.get("kind") == kind:
            found.append((document["when"], path.name, path, document))
    if not found:
        raise FileNotFoundError(f"no {kind} results in {results}")
    _, _, path, document = max(found)
    return path, document


def _verdict(holds: bool | None) -> str:
    return {True: "holds", False: "**missed**", None: "-"}[holds]


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


_CASE_ORDER = {"direct": 0, "service-10": 1, "service-2": 2, "service-1000": 3}


def _present(records: Sequence[Record], kind: str) -> list[str]:
    """The subjects with records of ``kind``, in the usual order."""
    seen = {r["subject"] for r in records if r["kind"] == kind}
    return [s for s in SUBJECT_ORDER if s in seen] + sorted(seen - set(SUBJECT_ORDER))


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _sync_cell(r: Record | None) -> str:
    """``seconds (kernel tools)`` or what went wrong."""
    if r is None:
        return "-"
    if r.get("timed_out"):
        return f"> {r['seconds']:.0f} (killed)"
    text = f"{_seconds(r['seconds'])} ({_seconds(r['tool_s'])})"
    return text if r["ok"] else text + " FAILED"


def _ratio(r: Record | None, base: Record | None) -> str:
    if r is None or base is None or not base["ok"] or base["seconds"] <= 0:
        return "-"
    sign = ">" if r.get("timed_out") else ""
    return f"{sign}{r['seconds'] / base['seconds']:.1f}x"


def _mb_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


LEGACY_SUBJECT_TITLES = {**SUBJECT_TITLES, OURS: "nftables"}
"""The titles of runs written before runs recorded their own (``subject_titles``): there
``kubeproxy-nftables`` was the nftables backend of its commit, the per-Service-chain
structure until issue 11 made the map structure the backend."""


def subject_titles(run: dict[str, Any]) -> dict[str, str]:
    """How ``run`` names its subjects: as recorded with it, else the titles of the time."""
    recorded = run.get("subject_titles")
    return dict(recorded) if isinstance(recorded, dict) else dict(LEGACY_SUBJECT_TITLES)


def _title(subject: str) -> str:
    return SUBJECT_TITLES.get(subject, subject)


def _subject_rank(subject: str) -> int:
    return SUBJECT_ORDER.index(subject) if subject in SUBJECT_ORDER else len(SUBJECT_ORDER)


def _sync_table(records: Sequence[Record], kind: str, **shape: bool) -> list[str]:
    """Rows of Services, a column per subject (the map structure first, the chain
    structure next to it), then each subject's ratio to the map structure."""
    subjects = [
        s
        for s in _present(records, kind)
        if any(_match_shape(r, s, kind, **shape) for r in records)
    ]
    sizes = sorted({r["services"] for r in records if _match_shape(r, None, kind, **shape)})
    if not sizes:
        return []
    others = [s for s in subjects if s != OURS]
    header = [
        "Services",
        *(_title(s) for s in subjects),
        *(f"{_title(s)} / {_title(OURS)}" for s in others if OURS in subjects),
    ]
    rows = []
    for n in sizes:
        cells = {s: full_sync(records, n, s, kind=kind, **shape) for s in subjects}
        row = [size_label(n), *(_sync_cell(cells[s]) for s in subjects)]
        if OURS in subjects:
            row += [_ratio(cells[s], cells[OURS]) for s in others]
        rows.append(row)
    return _table(header, rows)


def _match_shape(
    r: Record, subject: str | None, kind: str, *, affinity: bool = False, mix: bool = False
) -> bool:
    return (
        r["kind"] == kind
        and (subject is None or r["subject"] == subject)
        and bool(r.get("affinity")) == affinity
        and bool(r.get("mix")) == mix
    )


def _memory_table(records: Sequence[Record]) -> list[str]:
    """One row per full sync; at each size and kind of sync the subjects side by side."""
    rows = []
    for r in sorted(
        (r for r in records if r["kind"] in ("cold", "restart") and plain(r) and r["ok"]),
        key=lambda r: (r["services"], r["kind"], _subject_rank(r["subject"])),
    ):
        in_proxy = r["subject"] in (OURS, CHAINS) and (r.get("tool_peak_mb") or 0) < 1
        rows.append(
            (
                size_label(r["services"]),
                r["kind"],
                _title(r["subject"]),
                _mb_cell(r.get("rss_after_mb")),
                _mb_cell(r.get("proxy_peak_mb")),
                _mb_cell(r.get("input_mb")),
                "in the proxy (libnftables)" if in_proxy else _mb_cell(r.get("tool_peak_mb")),
            )
        )
    if not rows:
        return []
    return _table(
        (
            "Services",
            "sync",
            "subject",
            "proxy resident after (MB)",
            "proxy peak (MB)",
            "of which synthetic input (MB)",
            "largest tool process peak (MB)",
        ),
        rows,
    )


def _pair(ours: str, theirs: str) -> str:
    return f"{ours} / {theirs}"


def _median_cell(r: Record | None) -> str:
    if r is None:
        return "-"
    return f"{r['median_ms']:.1f}" + ("" if r["ok"] else " FAILED")


def _plain_seconds(r: Record | None) -> str:
    if r is None:
        return "-"
    if r.get("timed_out"):
        return f"> {r['seconds']:.0f}"
    return _seconds(r["seconds"]) + ("" if r["ok"] else " FAILED")


def _structures_table(records: Sequence[Record]) -> list[str]:
    """The map structure against the per-Service-chain structure, size by size: cold and
    restart seconds, incremental medians, the proxy's peak (cold). Each cell: maps / chains."""
    sizes = sorted(
        {
            r["services"]
            for r in records
            if r["subject"] in (OURS, CHAINS)
            and (r["kind"] == "incremental" or (r["kind"] in ("cold", "restart") and plain(r)))
        }
    )
    if not sizes or not any(r["subject"] == CHAINS for r in records):
        return []
    rows = []
    for n in sizes:
        cold = [full_sync(records, n, s) for s in (OURS, CHAINS)]
        restart = [full_sync(records, n, s, kind="restart") for s in (OURS, CHAINS)]
        row = [
            size_label(n),
            _pair(*(_plain_seconds(r) for r in cold)),
            _pair(*(_plain_seconds(r) for r in restart)),
        ]
        for op in ("endpoint", "add", "remove"):
            found = [
                one(records, kind="incremental", subject=s, services=n, op=op)
                for s in (OURS, CHAINS)
            ]
            row.append(_pair(*(_median_cell(r) for r in found)))
        row.append(_pair(*(_mb_cell(r.get("proxy_peak_mb") if r else None) for r in cold)))
        rows.append(row)
    return _table(
        (
            "Services",
            "cold (s)",
            "restart (s)",
            "endpoint change (ms)",
            "Service add (ms)",
            "Service remove (ms)",
            "proxy peak, cold (MB)",
        ),
        rows,
    )


def _whole_process_table(records: Sequence[Record]) -> list[str]:
    found = find(records, kind="whole_process")
    if not found:
        return []
    subjects = _present(records, "whole_process")
    ours = [s for s in subjects if s != UPSTREAM]
    header = [
        "Services",
        *(f"{_title(s)}: s (peak MB)" for s in subjects),
        *(f"{_title(UPSTREAM)} / {_title(s)}" for s in ours if UPSTREAM in subjects),
    ]
    rows = []
    for n in sorted({r["services"] for r in found}):
        row = [size_label(n)]
        for s in subjects:
            r = one(found, subject=s, services=n)
            row.append(
                "-"
                if r is None
                else f"{_plain_seconds(r)} ({r['peak_mb']:.0f})"
                + (f", {r['min_s']:.2f}-{r['max_s']:.2f}" if r.get("rounds", 1) > 1 else "")
            )
        if UPSTREAM in subjects:
            for s in ours:
                ratio = whole_process_ratio(records, n, s)
                row.append("-" if ratio is None else f"{ratio:.1f}x")
        rows.append(row)
    how = {r["subject"]: r.get("how", "") for r in found}
    lines = _table(header, rows)
    lines += [
        "",
        "Median over the rounds (min-max after the comma), from process start to exit. "
        + "; ".join(f"{_title(s)}: `{how[s]}`" for s in subjects if how.get(s))
        + ".",
    ]
    return lines


def _churn_table(records: Sequence[Record]) -> list[str]:
    found = sorted(
        find(records, kind="churn"), key=lambda r: (r["services"], _subject_rank(r["subject"]))
    )
    if not found:
        return []
    return _table(
        (
            "Services",
            "subject",
            "changes/s for s",
            "syncs/s",
            "Services per sync (median)",
            "sync p50 / p99 / max (ms)",
            "CPU (s)",
            "CPU share of one core",
        ),
        (
            (
                size_label(r["services"]),
                _title(r["subject"]),
                f"{r['rate']:g} for {r['seconds']:.0f}",
                f"{r['syncs_per_s']:.2f}",
                f"{r['services_per_sync']:g}",
                f"{r['sync_p50_ms']:.1f} / {r['sync_p99_ms']:.1f} / {r['sync_max_ms']:.1f}",
                f"{r['cpu_s']:.1f}",
                f"{r['cpu_share']:.1%}" + ("" if r["ok"] else " (a sync FAILED)"),
            )
            for r in found
        ),
    )


def _seconds_or_dash(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _daemon_table(records: Sequence[Record]) -> list[str]:
    found = sorted(find(records, kind="daemon"), key=lambda r: (r["services"], r["source"]))
    if not found:
        return []
    rows = []
    for r in found:
        cold = full_sync(records, r["services"])
        inproc = one(
            records, kind="incremental", subject=OURS, services=r["services"], op="endpoint"
        )
        split = (
            f"{r['split_source_mb']:.0f} / {r['split_proxier_mb']:.0f} / "
            f"{r['split_backend_mb']:.0f}"
            if r.get("split_source_mb") is not None
            else "-"
        )
        rows.append(
            (
                size_label(r["services"]),
                r["source"],
                f"{_seconds_or_dash(r.get('livez_s'))} / {_seconds_or_dash(r.get('healthz_s'))}",
                f"{r['first_sync_s']:.1f}" + (f" ({cold['seconds']:.1f})" if cold else ""),
                f"{r['peak_mb']:.0f}",
                split,
                "-"
                if r.get("median_ms") is None
                else f"{r['median_ms']:.2f} / {r['p90_ms']:.2f} / {r['max_ms']:.2f}"
                + (f" ({inproc['median_ms']:.2f})" if inproc else ""),
            )
        )
    lines = _table(
        (
            "Services",
            "source",
            "/livez / /healthz listening (s)",
            "first sync s (in-process cold)",
            "peak MB",
            "source / proxier / backend MB",
            "partial sync p50 / p90 / max ms (in-process p50)",
        ),
        rows,
    )
    return [
        *lines,
        "",
        "Times from the process start. The first sync ends when `/healthz` turns 200 (it "
        "answers 503 until every family's first sync); a partial sync is the daemon's own "
        "`kubeproxy_sync_partial_proxy_rules_duration_seconds` for one endpoint change at a "
        "time (minSyncPeriod 1 s apart), the in-process figure the incremental endpoint "
        "median of `test_control_plane` in this run.",
    ]


def _daemon_churn_table(records: Sequence[Record]) -> list[str]:
    found = sorted(find(records, kind="daemon_churn"), key=lambda r: r["services"])
    if not found:
        return []
    return _table(
        (
            "Services",
            "changes/s for s",
            "partial syncs/s",
            "mean partial sync (ms)",
            "network programming p50 / p99 (s, buckets)",
            "CPU share of one core",
        ),
        (
            (
                size_label(r["services"]),
                f"{r['rate']:g} for {r['wall_s']:.0f}",
                f"{r['syncs_per_s']:.2f}",
                _seconds_or_dash(r.get("partial_mean_ms")),
                f"{r.get('programming_p50_s')} / {r.get('programming_p99_s')}",
                f"{r['cpu_share']:.1%}",
            )
            for r in found
        ),
    )


def _tools_table(records: Sequence[Record]) -> list[str]:
    """Per full sync, the seconds (calls) of each kernel tool that took a tenth or more."""
    rows = []
    for r in sorted(
        (r for r in records if r["kind"] in ("cold", "restart") and plain(r) and r["ok"]),
        key=lambda r: (
            _subject_rank(r["subject"]),
            r["services"],
            r["kind"],
        ),
    ):
        tools = r.get("tools") or {}
        parts = [
            f"{name} {seconds:.1f} s ({calls})"
            for name, (seconds, calls) in sorted(tools.items(), key=lambda item: -item[1][0])
            if seconds >= 0.1
        ]
        if parts:
            rows.append(
                (
                    _title(r["subject"]),
                    size_label(r["services"]),
                    r["kind"],
                    ", ".join(parts),
                )
            )
    if not rows:
        return []
    return _table(("subject", "Services", "sync", "seconds (calls) per tool"), rows)


def _incremental_table(records: Sequence[Record]) -> list[str]:
    found = find(records, kind="incremental")
    if not found:
        return []
    subjects = _present(records, "incremental")
    header = ["Services", "change", *(_title(s) for s in subjects)]
    rows = []
    for n in sorted({r["services"] for r in found}):
        for op in ("endpoint", "add", "remove"):
            row = [size_label(n), op]
            for s in subjects:
                r = one(found, subject=s, services=n, op=op)
                row.append(
                    "-"
                    if r is None
                    else f"{r['median_ms']:.1f} / {r['p90_ms']:.1f} ({r['tool_median_ms']:.1f})"
                    + ("" if r["ok"] else " FAILED")
                )
            rows.append(row)
    return _table(header, rows)


def _dataplane_table(records: Sequence[Record]) -> list[str]:
    found = find(records, kind="dataplane")
    if not found:
        return []
    ordered = sorted(
        found,
        key=lambda r: (
            _subject_rank(r["subject"]),
            r["services"],
            _CASE_ORDER.get(r["case"], 99),
            r["case"],
        ),
    )
    lines = _table(
        (
            "subject",
            "Services installed",
            "target",
            "p50",
            "p90",
            "p99",
            "p50 - direct",
            "connections",
        ),
        (
            (
                _title(r["subject"]),
                size_label(r["services"]),
                r["case"],
                f"{r['p50_us']:.1f}",
                f"{r['p90_us']:.1f}",
                f"{r['p99_us']:.1f}",
                f"{r['overhead_us']:+.1f}",
                f"{r['count']}" + (f" ({r['failures']} failed)" if r["failures"] else ""),
            )
            for r in ordered
        ),
    )
    return [
        *lines,
        "",
        "`direct`: straight to an endpoint address (no DNAT); `service-N`: a ClusterIP "
        "whose Service has N endpoints.",
    ]


def _dataplane_summary(records: Sequence[Record]) -> list[str]:
    """p50 (p99) of the 10-endpoint Service per subject and size, side by side."""
    found = find(records, kind="dataplane", case="service-10")
    if not found:
        return []
    subjects = [s for s in _present(records, "dataplane") if s != NO_RULES]
    rows = []
    for n in sorted({r["services"] for r in found}):
        row = [size_label(n)]
        for s in subjects:
            r = one(found, subject=s, services=n)
            row.append("-" if r is None else f"{r['p50_us']:.1f} ({r['p99_us']:.0f})")
        rows.append(row)
    lines = _table(["Services installed", *(_title(s) for s in subjects)], rows)
    base = one(records, kind="dataplane", subject=NO_RULES, case="direct")
    if base:
        lines += [
            "",
            f"The same connections with no rules at all (straight to an endpoint): "
            f"p50 {base['p50_us']:.1f} us, p99 {base['p99_us']:.0f} us.",
        ]
    return lines


_TARGET_TITLES = {
    4: "nftables backend targets (issue 4)",
    11: "nftables at 100k Services: targets (issue 11), the map structure "
    "(chain structure's figures quoted)",
    19: "Real clusters: targets (issue 19), the map structure (one rule per class, before, quoted)",
    20: "The daemon a node runs, against the in-process figures of this run (issue 20)",
    32: "Every change data only (issue 32 item 4)",
}


def _new_count_table(records: Sequence[Record]) -> list[str]:
    """Per size and subject: each kind of change of ``test_new_count``, and the full sync
    before them."""
    found = find(records, kind="new_count_incremental")
    ops = ("endpoint", "add", "remove", "newcount", "seencount")
    rows = []
    for n in sorted({r["services"] for r in found}):
        for subject in _present(records, "new_count_incremental"):
            cold = one(records, kind="new_count_cold", subject=subject, services=n)
            cells = []
            for op in ops:
                r = one(found, subject=subject, services=n, op=op)
                cells.append(
                    "-"
                    if r is None
                    else f"{r['median_ms']:.2f} / {r.get('p99_ms', r['max_ms']):.2f} "
                    f"({r['tool_median_ms']:.2f})"
                )
            rows.append(
                (size_label(n), _title(subject), "-" if cold is None else _sync_cell(cold), *cells)
            )
    return _table(("Services", "subject", "full sync", *ops), rows)


def _realistic_table(records: Sequence[Record]) -> list[str]:
    """Per size and subject: the uniform and the realistic mix's full syncs, the
    realistic mix's incremental medians and first connections."""
    found = [r for r in records if str(r["kind"]).startswith("realistic_")]
    if not found:
        return []

    def cell(r: Record | None) -> str:
        if r is None:
            return "-"
        return f"{_sync_cell(r)}, {(r.get('proxy_peak_mb') or 0):.0f} MB"

    rows = []
    for n in sorted({r["services"] for r in found}):
        for subject in _present(records, "realistic_cold"):
            uniform = one(records, kind="cold", subject=subject, services=n, endpoints=10)
            medians = [
                one(records, kind="realistic_incremental", subject=subject, services=n, op=op)
                for op in ("endpoint", "add", "remove")
            ]
            connects = [
                one(records, kind="realistic_dataplane", subject=subject, services=n, case=case)
                for case in ("service", "direct")
            ]
            rows.append(
                (
                    size_label(n),
                    _title(subject),
                    cell(uniform if uniform is not None and plain(uniform) else None),
                    cell(one(records, kind="realistic_cold", subject=subject, services=n)),
                    cell(one(records, kind="realistic_restart", subject=subject, services=n)),
                    " / ".join("-" if m is None else f"{m['median_ms']:.2f}" for m in medians),
                    " / ".join("-" if c is None else f"{c['p50_us']:.1f}" for c in connects),
                )
            )
    return _table(
        (
            "Services",
            "subject",
            "uniform cold",
            "realistic cold",
            "realistic restart",
            "endpoint / add / remove",
            "first connection p50 us: Service / direct",
        ),
        rows,
    )


def _classes_table(records: Sequence[Record]) -> list[str]:
    found = find(records, kind="dataplane_classes")
    if not found:
        return []
    rows = []
    for subject in _present(records, "dataplane_classes"):
        for classes in sorted({r["classes"] for r in found if r["subject"] == subject}):
            cells = []
            for case in ("last-class", "first-class", "direct"):
                r = one(found, subject=subject, classes=classes, case=case)
                cells.append("-" if r is None else f"{r['p50_us']:.1f} ({r['p99_us']:.0f})")
            rows.append((_title(subject), str(classes), *cells))
    return _table(
        ("subject", "classes", "the last class", "the first class", "no Service (direct)"), rows
    )


def render_markdown(run: dict[str, Any]) -> str:
    """The Markdown summary of one run (what ``latest.md`` holds)."""
    machine, records = run["machine"], run["records"]
    out = [
        "# Benchmark results",
        "",
        f"Command: `{run['command']}`  ",
        f"Date: {machine['date']}; {machine['nproc']} cores, kernel {machine['kernel']}, "
        f"{machine['nft']}, {machine.get('iptables', 'iptables ?')}, Python "
        f"{machine['python']}, {machine['memory_gb']} GB, "
        f"commit {machine['commit']}{' + uncommitted changes' if machine.get('dirty') else ''}; "
        f"run took {run['duration_s'] / 60:.1f} min.",
        "",
        *(
            ["**The measured code changed during this run: figures mix versions.**", ""]
            if run.get("code_changed_during_run")
            else []
        ),
        "Every comparison below was measured in this one run, side by side. Seconds are end "
        "to end (objects in memory to rules committed); in parentheses the part spent inside "
        "the kernel tools (libnftables calls for nftables, iptables-restore/-save/iptables "
        "processes for iptables, every nft process for upstream's structure). "
        "`> N (killed)`: stopped after N seconds.",
        "",
    ]
    sections: list[tuple[str, list[str]]] = [
        (
            "nftables: the map structure / the per-Service-chain structure (before), same run",
            _structures_table(records),
        ),
        (
            "Cold full sync (N Services x 10 endpoints, empty namespace)",
            _sync_table(records, "cold"),
        ),
        (
            "Restart (a fresh process's first sync over the rules of a previous one)",
            _sync_table(records, "restart"),
        ),
        (
            "Cold full sync, the 250-endpoint mix (1 Service in 100 has 250 endpoints)",
            _sync_table(records, "cold", mix=True),
        ),
        (
            "Cold full sync, every Service with session affinity",
            _sync_table(records, "cold", affinity=True),
        ),
        (
            "Incremental sync after a restart: median / p90 ms (median inside the kernel tools)",
            _incremental_table(records),
        ),
        ("Memory (MB)", _memory_table(records)),
        (
            "Where the kernel-tool time of the full syncs goes",
            _tools_table(records),
        ),
        (
            "First connection through a 10-endpoint ClusterIP: p50 (p99), microseconds",
            _dataplane_summary(records),
        ),
        (
            "First-connection latency, every case (TCP connect through the node, microseconds)",
            _dataplane_table(records),
        ),
        (
            "Whole process: kube-proxy-nftables --manifests DIR --once vs nft -f of "
            "upstream's structure",
            _whole_process_table(records),
        ),
        (
            "Churn: random endpoint changes through the proxier's own sync loop "
            "(minSyncPeriod 1 s)",
            _churn_table(records),
        ),
        (
            "The realistic mix next to the uniform one (issue 19): seconds (kernel tools), "
            "peak MB, incremental medians in ms",
            _realistic_table(records),
        ),
        (
            "Every kind of change on the realistic mix, a never-seen endpoint count included "
            "(issue 32): median / p99 ms (median inside the kernel tools)",
            _new_count_table(records),
        ),
        (
            "Endpoint-count classes and the first packet: p50 (p99) microseconds per new "
            "connection",
            _classes_table(records),
        ),
        (
            "The daemon a node runs (kube-proxy-nftables, started as a process; issue 20)",
            _daemon_table(records),
        ),
        ("The daemon under churn through the API (issue 20)", _daemon_churn_table(records)),
    ]
    for title, lines in sections:
        if lines:
            out += [f"## {title}", "", *lines, ""]
    failed_cleanups = [r for r in find(records, kind="incremental") if r.get("cleanup_failures")]
    if failed_cleanups:
        out += [
            "Stale-chain cleanups of upstream's structure that the kernel refused (EBUSY; "
            "upstream logs them, counts them and forces its next sync to be a full one, which "
            "the model does not do, so these medians are a lower bound): "
            + ", ".join(
                f"{size_label(r['services'])} {r['op']}: {r['cleanup_failures']} so far"
                for r in failed_cleanups
            ),
            "",
        ]
    skipped = find(records, kind="dataplane_skipped")
    if skipped:
        out += [
            "Data plane not measured (the sync did not finish in time): "
            + ", ".join(f"{r['subject']} {size_label(r['services'])}" for r in skipped),
            "",
        ]
    checks = evaluate_targets(records)
    for issue, title in _TARGET_TITLES.items():
        mine = [c for c in checks if c.issue == issue]
        if mine:
            out += ["", f"## {title}", ""]
            out += _table(
                ("target", "measured", "verdict"),
                ((c.target, c.measured, _verdict(c.holds)) for c in mine),
            )
    plots = run.get("plots") or []
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    out.append("")
    return "\n".join(out)


class Results:
    """The records of one benchmark run, written out at its end."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.records: list[Record] = []
        self._started = datetime.datetime.now(datetime.UTC)
        self._machine = machine_info()
        self._code_at_start = code_fingerprint()

    def add(self, kind: str, subject: str, **fields: Any) -> Record:
        """Add a record and return it."""
        record: Record = {"kind": kind, "subject": subject, **fields}
        self.records.append(record)
        return record

    def as_run(self) -> dict[str, Any]:
        """The whole run as one JSON-ready dict."""
        duration = (datetime.datetime.now(datetime.UTC) - self._started).total_seconds()
        code_at_end = code_fingerprint()
        return {
            "command": self.command,
            "machine": self._machine,
            "code": self._code_at_start,
            "code_changed_during_run": code_at_end != self._code_at_start,
            "duration_s": duration,
            # What each subject was in this run (a later run may give a name to another
            # structure: kubeproxy-nftables was the per-Service-chain one before issue 11).
            "subject_titles": dict(SUBJECT_TITLES),
            "records": self.records,
            "targets": [asdict(c) for c in evaluate_targets(self.records)],
        }

    def write(self, directory: Path) -> list[Path]:
        """Write ``<date>-<host>.json``, the plots (PNG) and ``latest.md`` into ``directory``."""
        from bench.plots import write_plots  # matplotlib: only when writing

        directory.mkdir(parents=True, exist_ok=True)
        run = self.as_run()
        plots = write_plots(run, directory)
        run["plots"] = [p.name for p in plots]
        stamp = self._started.strftime("%Y%m%dT%H%M%SZ")
        json_path = directory / f"{stamp}-{run['machine']['host']}.json"
        json_path.write_text(json.dumps(run, indent=1) + "\n")
        md_path = directory / "latest.md"
        md_path.write_text(render_markdown(run))
        return [json_path, *plots, md_path]


# --- the summaries the documents carry (bench/readme.py writes them) ----------------------


def _run_line(run: dict[str, Any], source: str) -> str:
    machine = run["machine"]
    dirty = " + uncommitted changes" if machine.get("dirty") else ""
    return (
        f"Measured by `{run['command']}` at commit {machine['commit']}{dirty} on "
        f"{machine['date'][:10]} (`{source}`, {run['duration_s'] / 60:.1f} min; "
        f"{machine['nproc']} cores, kernel {machine['kernel']}, {machine['nft']}, "
        f"{machine.get('iptables', 'iptables ?')}, Python {machine['python']})."
    )


def _compared(value: float, base: float | None, text: str) -> str:
    if base is None or base <= 0 or value == base:
        return text
    return f"{text} ({value / base:.1f}x)"


def _sync_summary_cell(r: Record | None, base: Record | None) -> str:
    if r is None:
        return "-"
    if r.get("timed_out"):
        return f"> {r['seconds']:.0f} s (killed)"
    if not r["ok"]:
        return "failed"
    reference = base["seconds"] if base is not None and base["ok"] else None
    return _compared(r["seconds"], reference, f"{_seconds(r['seconds'])} s")


def readme_summary(run: dict[str, Any], source: str, *, root: str = "") -> str:
    """The benchmark section of ``docs/benchmarks.md`` for one run (``source``: its
    results file): where it was measured, one row per measurement and size, a column per
    subject the run holds (ratios to nftables in parentheses), the targets, the plots.
    ``root`` is the way from the page to the repository's top (``"../"`` from ``docs/``),
    for its links."""
    records = run["records"]
    titles = subject_titles(run)
    subjects = [s for s in SUBJECT_ORDER if any(r["subject"] == s for r in records)]
    subjects += sorted({r["subject"] for r in records} - set(subjects) - {NO_RULES})
    rows: list[list[str]] = []
    for kind, what in (("cold", "cold sync"), ("restart", "restart over existing rules")):
        sizes = sorted({r["services"] for r in records if r["kind"] == kind and plain(r)})
        for n in sizes:
            base = full_sync(records, n, OURS, kind=kind)
            cells = [
                _sync_summary_cell(full_sync(records, n, s, kind=kind), base) for s in subjects
            ]
            rows.append([f"{what}, {size_label(n)}", *cells])
    incremental = find(records, kind="incremental", op="endpoint")
    for n in sorted({r["services"] for r in incremental}):
        base = one(incremental, subject=OURS, services=n)
        row = [f"incremental sync at {size_label(n)}, endpoint changed (median)"]
        for s in subjects:
            r = one(incremental, subject=s, services=n)
            if r is None:
                row.append("-")
                continue
            reference = base["median_ms"] if base is not None else None
            row.append(_compared(r["median_ms"], reference, f"{r['median_ms']:.1f} ms"))
        rows.append(row)
    first = find(records, kind="dataplane", case="service-10")
    for n in sorted({r["services"] for r in first}):
        row = [f"first connection p50 with {size_label(n)} Services"]
        for s in subjects:
            r = one(first, subject=s, services=n)
            row.append("-" if r is None else f"{r['p50_us']:.0f} us")
        rows.append(row)
    peaks = [r for r in records if r["kind"] in ("cold", "restart") and plain(r) and r["ok"]]
    for n in sorted({r["services"] for r in peaks}):
        row = [f"proxy peak memory at {size_label(n)} (cold / restart)"]
        for s in subjects:
            found = [
                _mb_cell(r.get("proxy_peak_mb"))
                for kind in ("cold", "restart")
                if (r := one(peaks, subject=s, services=n, kind=kind)) is not None
            ]
            row.append(" / ".join(found) + " MB" if found and "-" not in found else "-")
        rows.append(row)
    lines = [
        _run_line(run, source),
        "Seconds end to end (Kubernetes objects in memory to rules committed), "
        "N Services x 10 endpoints; in parentheses, the ratio to nftables. Every figure of "
        f"the run: [`bench/results/latest.md`]({root}bench/results/latest.md).",
        "",
        *_table(["", *(titles.get(s, s) for s in subjects)], rows),
        "",
    ]
    targets = run.get("targets")
    checks = (
        [TargetCheck(**t) for t in targets] if targets is not None else evaluate_targets(records)
    )
    lines += _table(
        ("target (nftables backend)", "measured", "verdict"),
        ((c.target, c.measured, _verdict(c.holds)) for c in checks),
    )
    for plot in run.get("plots") or []:
        lines += ["", f"![{Path(plot).stem}]({root}bench/results/{Path(plot).name})"]
    return "\n".join(lines) + "\n"


def readme_headline(run: dict[str, Any], source: str, *, full: str = "") -> str:
    """The top-level README's headline figures for one run: the shipped nftables backend
    by size (cold sync, endpoint change, first connection, peak memory), the cold sync of
    iptables-nft and of upstream's nftables structure beside it, and which targets hold.
    ``full`` links the page with every figure of the same run."""
    records = run["records"]
    titles = subject_titles(run)
    others = [s for s in (IPT_NFT, UPSTREAM) if any(r["subject"] == s for r in records)]
    colds = [r for r in records if r["kind"] == "cold" and plain(r) and r["subject"] == OURS]
    incremental = find(records, kind="incremental", op="endpoint", subject=OURS)
    first = find(records, kind="dataplane", case="service-10", subject=OURS)
    rows = []
    for n in sorted({r["services"] for r in colds}):
        base = full_sync(records, n, OURS, kind="cold")
        change = one(incremental, services=n)
        connection = one(first, services=n)
        rows.append(
            [
                size_label(n),
                _sync_summary_cell(base, None),
                "-" if change is None else f"{change['median_ms']:.1f} ms",
                "-" if connection is None else f"{connection['p50_us']:.0f} us",
                "-" if base is None else f"{_mb_cell(base.get('proxy_peak_mb'))} MB",
                *(_sync_summary_cell(full_sync(records, n, s, kind="cold"), base) for s in others),
            ]
        )
    targets = run.get("targets")
    checks = (
        [TargetCheck(**t) for t in targets] if targets is not None else evaluate_targets(records)
    )
    missed = [c.target for c in checks if c.holds is False]
    held = sum(1 for c in checks if c.holds)
    verdicts = f"Targets: {held} of {len(checks)} hold" + (
        "; missed: " + "; ".join(f"*{m}*" for m in missed) + "." if missed else "."
    )
    page = full.split("#", 1)[0]
    where = f" (every figure, the targets and the plots: [{page}]({full}))" if full else ""
    lines = [
        _run_line(run, source),
        f"Seconds end to end, N Services x 10 endpoints{where}; in parentheses, the ratio "
        "to nftables.",
        "",
        *_table(
            [
                "Services",
                f"cold sync, {titles.get(OURS, OURS)}",
                "endpoint change (median)",
                "first connection p50",
                "peak memory (cold)",
                *(f"cold sync, {titles.get(s, s)}" for s in others),
            ],
            rows,
        ),
        "",
        verdicts,
    ]
    return "\n".join(lines) + "\n"


def _round_up(mb: float, step: int) -> int:
    return max(step, math.ceil(mb / step) * step)


def sizing_table(run: dict[str, Any], source: str) -> str:
    """Memory to give ``kube-proxy-nftables`` by cluster size, from one run's nftables
    records: the resident size once synced and the peak during a cold sync or a restart
    (the larger), with the request (resident, rounded up to 64 Mi) and the limit (peak
    plus a quarter, rounded up to 128 Mi) they suggest."""
    records = [
        r
        for r in run["records"]
        if r["subject"] == OURS and r["kind"] in ("cold", "restart") and plain(r) and r["ok"]
    ]
    rows = []
    for n in sorted({r["services"] for r in records}):
        mine = [r for r in records if r["services"] == n]
        resident = max(r.get("rss_after_mb") or 0.0 for r in mine)
        peak = max(r.get("proxy_peak_mb") or 0.0 for r in mine)
        rows.append(
            (
                size_label(n),
                f"{resident:.0f}",
                f"{peak:.0f}",
                f"{_round_up(resident, 64)}Mi",
                f"{_round_up(peak * 1.25, 128)}Mi",
            )
        )
    lines = [
        _run_line(run, source),
        "",
        *_table(
            (
                "Services (x 10 endpoints)",
                "resident once synced (MB)",
                "peak, cold sync or restart (MB)",
                "memory request",
                "memory limit, if you set one",
            ),
            rows,
        ),
    ]
    return "\n".join(lines) + "\n"
