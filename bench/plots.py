"""PNG plots of one benchmark run (matplotlib, Agg backend: no display needed).

* ``sync_time.png``: cold full sync (left) and restart (right) time against the number
  of Services, per subject, log-log (timed-out points drawn as open triangles at the time they were
  stopped: a lower bound);
* ``first_connection.png``: first-connection latency (p50, with p90 and p99) through a
  10-endpoint ClusterIP against the number of Services installed, per subject; the bare
  endpoint (no DNAT) as a baseline;
* ``incremental.png``: median incremental sync per change against the number of Services.

Run on its own to redraw from a results file::

    python -m bench.plots bench/results/<run>.json [OUTDIR]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.axes import Axes

from bench.targets import NO_RULES, SUBJECT_ORDER, SUBJECT_TITLES

__all__ = ["main", "write_plots"]

Record = dict[str, Any]

_STYLE = {
    "kubeproxy-nftables": ("tab:blue", "o"),
    "kubeproxy-nftables-chains": ("tab:purple", "v"),
    "kubeproxy-iptables-nft": ("tab:orange", "s"),
    "kubeproxy-iptables-legacy": ("tab:red", "D"),
    "upstream-nft": ("tab:gray", "^"),
}


def _plain(r: Record) -> bool:
    return not r.get("affinity") and not r.get("mix")


def _subjects(records: Sequence[Record]) -> list[str]:
    seen = {r["subject"] for r in records}
    return [s for s in SUBJECT_ORDER if s in seen] + sorted(seen - set(SUBJECT_ORDER))


def _style(subject: str) -> tuple[str, str]:
    return _STYLE.get(subject, ("tab:green", "x"))


def _label(subject: str) -> str:
    return SUBJECT_TITLES.get(subject, subject)


def _size_axis(ax: Axes, sizes: Sequence[int]) -> None:
    ax.set_xscale("log")
    ax.set_xticks(sorted(set(sizes)))
    ax.set_xticklabels([f"{n // 1000}k" if n % 1000 == 0 else str(n) for n in sorted(set(sizes))])
    ax.minorticks_off()
    ax.set_xlabel("Services (x 10 endpoints)")
    ax.grid(True, which="major", alpha=0.3)


def _sync_panel(ax: Axes, syncs: Sequence[Record], kind: str, title: str) -> None:
    for subject in _subjects(syncs):
        color, marker = _style(subject)
        points = sorted(
            (r["services"], r["seconds"], bool(r.get("timed_out")))
            for r in syncs
            if r["subject"] == subject and r["kind"] == kind and (r["ok"] or r["timed_out"])
        )
        done = [(n, t) for n, t, out in points if not out]
        if done:
            ax.plot(
                [n for n, _ in done],
                [t for _, t in done],
                "-",
                color=color,
                marker=marker,
                label=_label(subject),
            )
        killed = [(n, t) for n, t, out in points if out]
        if killed:
            ax.plot(
                [n for n, _ in killed],
                [t for _, t in killed],
                "^",
                color=color,
                markerfacecolor="none",
                markersize=10,
                label=f"{_label(subject)}: stopped there (lower bound)",
            )
    ax.set_yscale("log")
    _size_axis(ax, [r["services"] for r in syncs])
    ax.set_title(title)
    ax.legend(fontsize=8)


def _sync_plot(records: Sequence[Record], path: Path) -> bool:
    syncs = [r for r in records if r["kind"] in ("cold", "restart") and _plain(r)]
    if not syncs:
        return False
    fig, (cold, restart) = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    _sync_panel(cold, syncs, "cold", "Cold full sync (empty namespace)")
    _sync_panel(restart, syncs, "restart", "Restart (first sync over existing rules)")
    cold.set_ylabel("seconds, end to end (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _dataplane_plot(records: Sequence[Record], path: Path) -> bool:
    latencies = [r for r in records if r["kind"] == "dataplane"]
    sizes = [r["services"] for r in latencies if r["subject"] != NO_RULES]
    if not latencies:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for subject in _subjects(latencies):
        color, marker = _style(subject)
        points = sorted(
            (r["services"], r["p50_us"], r["p90_us"], r["p99_us"])
            for r in latencies
            if r["subject"] == subject and r["case"] == "service-10"
        )
        if not points:
            continue
        xs = [p[0] for p in points]
        ax.plot(
            xs,
            [p[1] for p in points],
            "-",
            color=color,
            marker=marker,
            label=f"{_label(subject)}: p50",
        )
        ax.fill_between(xs, [p[1] for p in points], [p[2] for p in points], color=color, alpha=0.15)
        ax.plot(
            xs,
            [p[3] for p in points],
            ":",
            color=color,
            marker=marker,
            markerfacecolor="none",
            label=f"{_label(subject)}: p99",
        )
    base = [r for r in latencies if r["subject"] == NO_RULES and r["case"] == "direct"]
    if base:
        ax.axhline(
            base[-1]["p50_us"],
            color="black",
            alpha=0.5,
            linestyle="--",
            label="no rules at all, straight to an endpoint: p50",
        )
    ax.set_ylabel("TCP connect time, microseconds (shaded: p50 to p90)")
    ax.set_ylim(bottom=0)
    _size_axis(ax, sizes)
    ax.set_xlabel("Services installed (x 10 endpoints)")
    ax.set_title("First connection through a ClusterIP (10 endpoints)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _incremental_plot(records: Sequence[Record], path: Path) -> bool:
    found = [r for r in records if r["kind"] == "incremental"]
    if not found:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    lines = {"endpoint": "-", "add": "--", "remove": ":"}
    for subject in _subjects(found):
        color, marker = _style(subject)
        for op, line in lines.items():
            points = sorted(
                (r["services"], r["median_ms"])
                for r in found
                if r["subject"] == subject and r["op"] == op
            )
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    line,
                    color=color,
                    marker=marker,
                    label=f"{_label(subject)}: {op}",
                )
    ax.set_yscale("log")
    ax.set_ylabel("median ms per sync")
    _size_axis(ax, [r["services"] for r in found])
    ax.set_title("Incremental sync: one endpoint changed / one Service added / one removed")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(run: dict[str, Any], directory: Path) -> list[Path]:
    """Draw the run's plots into ``directory``; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    records: list[Record] = run["records"]
    written = []
    sync = directory / "sync_time.png"
    if _sync_plot(records, sync):
        written.append(sync)
    first = directory / "first_connection.png"
    if _dataplane_plot(records, first):
        written.append(first)
    incremental = directory / "incremental.png"
    if _incremental_plot(records, incremental):
        written.append(incremental)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Redraw the plots of a results file."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m bench.plots RESULTS.json [OUTDIR]", file=sys.stderr)
        return 2
    source = Path(args[0])
    out = Path(args[1]) if len(args) > 1 else source.parent
    for path in write_plots(json.loads(source.read_text()), out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
