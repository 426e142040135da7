"""The kernel-floor benchmark's results: the document, its tables and the target (issue 32).

:mod:`bench.floor` writes one JSON document per run
(``bench/results/<date>-floor-<host>.json``) and ``bench/results/floor.md``;
``python -m bench.readme`` renders the newest document into ``bench/README.md``'s
``floor`` section. Both come from :func:`render`.

Target (issue 32, item 1): the in-process full sync within 2x of the floor at 100k
Services, judged on each mix measured at that size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from bench.report import newest_document as newest_of_kind
from bench.targets import size_label as _size

__all__ = ["KIND", "TARGET_RATIO", "TARGET_SIZE", "newest_document", "render", "targets"]

KIND: Final = "floor"
TARGET_RATIO: Final = 2.0
TARGET_SIZE: Final = 100_000


def newest_document(results: Path) -> tuple[Path, dict[str, Any]]:
    """The newest floor results document in ``results``."""
    return newest_of_kind(results, KIND)


def _ratio(record: Mapping[str, Any]) -> float:
    return float(record["ours"]["total_s"]) / float(record["floor"]["wall_s"])


def targets(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, held) at the target size, per mix."""
    checks: list[tuple[str, str, bool | None]] = []
    for record in records:
        if record["services"] != TARGET_SIZE:
            continue
        ratio = _ratio(record)
        checks.append(
            (
                f"{_size(TARGET_SIZE)} {record['mix']}: in-process full sync <= "
                f"{TARGET_RATIO:g}x the floor",
                f"{record['ours']['total_s']:.1f} s against {record['floor']['wall_s']:.1f} s:"
                f" {ratio:.1f}x",
                ratio <= TARGET_RATIO,
            )
        )
    return checks


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _row(record: Mapping[str, Any]) -> list[str]:
    ours, floor = record["ours"], record["floor"]
    kernel = ours["exchange_s"] + ours["read_s"]
    return [
        _size(record["services"]),
        record["mix"],
        f"{ours['total_s']:.2f} ({ours['feed_s']:.2f} + {ours['sync_s']:.2f})",
        f"{kernel:.2f}",
        f"{ours['gc_s']:.2f} ({ours['gc_passes']})",
        f"{floor['wall_s']:.2f} ({', '.join(f'{w:.2f}' for w in floor['walls_s'])})",
        f"{_ratio(record):.1f}x",
        f"{(ours['total_s'] - kernel) / floor['wall_s']:.1f}x",
        f"{ours['batches']} / {ours['messages']}",
        f"{ours['bytes'] / 1e6:.1f} ({ours['largest_batch_bytes'] / 1e6:.1f})",
    ]


def _profile_rows(records: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    names: list[str] = []
    for record in records:
        for name in record.get("profile", {}).get("categories", {}):
            if name not in names:
                names.append(name)
    rows = []
    for record in records:
        profile = record.get("profile")
        if not profile:
            continue
        categories = profile["categories"]
        total = sum(categories.values()) or 1.0
        row = [_size(record["services"]), record["mix"], f"{profile['profiled_s']:.1f}"]
        row += [f"{100 * categories.get(name, 0.0) / total:.0f} %" for name in names]
        rows.append(row)
    return ["size", "mix", "profiled s", *names], rows


def render(document: Mapping[str, Any], source: str) -> str:
    """The tables and the target check, as Markdown."""
    records = document["records"]
    machine = document["machine"]
    lines = [
        f"Run {document['when']} on commit {document['commit']} ({source}): "
        f"`{document['command']}`; {machine['nproc']} cores, kernel {machine['kernel']}, "
        f"load {document['load_before']:.1f} before and {document['load_after']:.1f} after "
        "(a shared machine: other work ran on the cores).",
        "",
        "Seconds. *ours*: the in-process full sync, dicts in memory to rules committed "
        "(feed + sync); *kernel wait*: its batch exchanges and reads on the socket; *floor*: "
        "the same batches replayed by the same writer into an empty namespace (median of "
        "the replays in parentheses); *Python / floor*: ours less its kernel wait, over the "
        "floor. "
        + (
            "The garbage collector is held during ours, as the daemon holds it until its first"
            " full sync; *gc* is what it took anyway."
            if all(r.get("gc_held") for r in records)
            else "The garbage collector runs during ours (as `bench/test_bench.py` leaves it);"
            " *gc* is its time."
        ),
        "",
    ]
    header = [
        "size",
        "mix",
        "ours (feed + sync)",
        "kernel wait",
        "gc (passes)",
        "floor (replays)",
        "ours / floor",
        "Python / floor",
        "batches / messages",
        "MB sent (largest batch)",
    ]
    lines += _table(header, [_row(r) for r in records])
    checks = targets(records)
    if checks:
        lines += [
            "",
            *_table(
                ["target", "measured", "verdict"],
                [
                    [name, measured, {True: "holds", False: "**missed**", None: "-"}[held]]
                    for name, measured, held in checks
                ],
            ),
        ]
    header, rows = _profile_rows(records)
    if rows:
        lines += [
            "",
            "Where ours goes: the same full sync under cProfile in another fresh process and "
            "namespace, own time by module grouped by what the module does "
            "(`bench/profile_modules.py`; cProfile inflates Python, not the kernel).",
            "",
            *_table(header, rows),
        ]
    return "\n".join(lines) + "\n"
