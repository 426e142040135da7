"""The performance targets the benchmarks check, and the record lookups they share.

Three sets, each evaluated on the shipped nftables backend (``kubeproxy-nftables``, the
map structure): issue 4's (:func:`backend_targets`: against upstream's structure, growth
close to linear, incremental syncs at 10k), issue 11's (:func:`scale_targets`:
per-change cost independent of the cluster, 100k Services, the whole process, churn),
where the per-Service-chain structure's figure of the same run is quoted next to ours,
and issue 20's (:func:`daemon_targets`: the daemon a node runs, started as a process,
against the in-process figures of the same run).
Records are the flat dicts :mod:`bench.report` documents.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AFF_MAPS",
    "AFF_PINNED",
    "CHAINS",
    "IPT_LEGACY",
    "IPT_NFT",
    "NO_RULES",
    "OURS",
    "PRECREATED",
    "RULES",
    "SUBJECT_ORDER",
    "SUBJECT_TITLES",
    "UPSTREAM",
    "Record",
    "TargetCheck",
    "backend_targets",
    "daemon_targets",
    "evaluate_targets",
    "find",
    "full_sync",
    "issue19_targets",
    "new_count_target",
    "one",
    "plain",
    "scale_targets",
    "size_label",
    "whole_process_ratio",
]

OURS = "kubeproxy-nftables"  # the map structure: the nftables backend as shipped
RULES = "kubeproxy-nftables-rules"  # the map structure's class dispatch before issue 19
PRECREATED = "kubeproxy-nftables-precreated"  # classes of counts 1-1024 precreated (issue 32)
AFF_MAPS = "kubeproxy-nftables-affinity-maps"  # affinity maps per Service port, before issue 32
AFF_PINNED = "kubeproxy-nftables-affinity-pinned"  # shared maps, chains per port (before)
CHAINS = "kubeproxy-nftables-chains"  # the per-Service-chain structure it replaced
IPT_NFT = "kubeproxy-iptables-nft"
IPT_LEGACY = "kubeproxy-iptables-legacy"
UPSTREAM = "upstream-nft"
NO_RULES = "no-rules"  # the data-plane baseline: the topology without any rules
SUBJECT_ORDER = (
    OURS,
    PRECREATED,
    RULES,
    AFF_PINNED,
    AFF_MAPS,
    CHAINS,
    IPT_NFT,
    IPT_LEGACY,
    UPSTREAM,
)
SUBJECT_TITLES = {
    OURS: "nftables (maps)",
    PRECREATED: "nftables (maps, classes of counts 1-1024 precreated)",
    RULES: "nftables (maps, class rules, before)",
    AFF_PINNED: "nftables (maps, affinity chains per port, before)",
    AFF_MAPS: "nftables (maps, an affinity map per port, before)",
    CHAINS: "nftables (chains, before)",
    IPT_NFT: "iptables-nft",
    IPT_LEGACY: "iptables-legacy",
    UPSTREAM: "upstream's nft structure",
    NO_RULES: "no rules",
}

Record = dict[str, Any]

# Criteria for the targets the issue states in words.
LINEAR_EXPONENT_MAX = 1.2  # time ~ services^k with k fitted on log-log, 1k..30k
INDEPENDENT_RATIO_MAX = 1.5  # incremental median at the largest size / at the smallest
FLAT_RATIO_MAX = 1.25  # first-connection p50, most Services / fewest; 1000 eps / 2 eps
FLAT_SLACK_US = 5.0  # ... or within this many microseconds (timer and scheduling noise)


def size_label(n: int) -> str:
    """``1k``, ``100k``, ``250``; ``none`` for 0."""
    if n == 0:
        return "none"
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One performance target: what was asked, what was measured, and whether it holds.

    ``holds`` is None when the run did not measure what the target needs; ``issue`` is
    the issue that set the target.
    """

    target: str
    measured: str
    holds: bool | None
    issue: int = 4


def find(records: Iterable[Record], **match: Any) -> list[Record]:
    """The records whose fields equal ``match``."""
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def one(records: Iterable[Record], **match: Any) -> Record | None:
    """The last record whose fields equal ``match`` (None: none)."""
    found = find(records, **match)
    return found[-1] if found else None


def plain(record: Record) -> bool:
    """A uniform N x 10 cluster without affinity (not the mix, not the affinity variant)."""
    return not record.get("affinity") and not record.get("mix") and record.get("endpoints") == 10


def full_sync(
    records: Sequence[Record],
    services: int,
    subject: str = OURS,
    *,
    kind: str = "cold",
    affinity: bool = False,
    mix: bool = False,
) -> Record | None:
    """The last full-sync record (``kind`` cold or restart) of ``subject`` at ``services``
    with that shape (affinity on every Service, the 250-endpoint mix, or neither)."""
    found = [
        r
        for r in records
        if r["kind"] == kind
        and r["subject"] == subject
        and r["services"] == services
        and bool(r.get("affinity")) == affinity
        and bool(r.get("mix")) == mix
    ]
    return found[-1] if found else None


def _cold(records: Sequence[Record], services: int, affinity: bool = False) -> Record | None:
    return full_sync(records, services, affinity=affinity)


def _fit_exponent(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of log(time) over log(size)."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def _cold_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    r10k = _cold(records, 10_000)
    checks.append(
        TargetCheck(
            "cold full sync 10k x 10 <= 10 s",
            f"{r10k['seconds']:.2f} s" if r10k else "not measured",
            (r10k["ok"] and r10k["seconds"] <= 10.0) if r10k else None,
        )
    )
    r30k = _cold(records, 30_000)
    if r30k:
        peak = _peak_mb(r30k)
        measured = f"{r30k['seconds']:.2f} s, peak {peak:.0f} MB"
        holds: bool | None = r30k["ok"] and r30k["seconds"] <= 45.0 and peak <= 1536
    else:
        measured, holds = "not measured", None
    checks.append(TargetCheck("cold full sync 30k x 10 <= 45 s, <= 1.5 GB peak", measured, holds))

    ours5k, theirs5k = (
        _cold(records, 5_000),
        full_sync(records, 5_000, UPSTREAM),
    )
    if ours5k and theirs5k and theirs5k["ok"]:
        ratio = theirs5k["seconds"] / ours5k["seconds"]
        checks.append(
            TargetCheck(
                "5k x 10: >= 10x faster than upstream's structure (same run)",
                f"{ours5k['seconds']:.2f} s vs {theirs5k['seconds']:.1f} s: {ratio:.1f}x",
                ours5k["ok"] and ratio >= 10.0,
            )
        )
    else:
        checks.append(
            TargetCheck("5k x 10: >= 10x faster than upstream's structure", "not measured", None)
        )

    sizes = sorted(
        (r["services"], r["seconds"])
        for r in find(records, kind="cold", subject=OURS)
        if r["ok"] and plain(r)
    )
    if len(sizes) >= 3 and sizes[0][0] <= 1_000 and sizes[-1][0] >= 30_000:
        k = _fit_exponent(sizes)
        per = ", ".join(f"{n // 1000}k {1e6 * t / n:.0f} us" for n, t in sizes)
        checks.append(
            TargetCheck(
                f"growth close to linear 1k..30k (fitted exponent <= {LINEAR_EXPONENT_MAX})",
                f"exponent {k:.2f}; per Service {per}",
                k <= LINEAR_EXPONENT_MAX,
            )
        )
    else:
        checks.append(TargetCheck("growth close to linear 1k..30k", "not measured", None))

    pairs = [
        (n, base, aff)
        for n in (1_000, 5_000, 10_000, 30_000)
        if (base := _cold(records, n)) and (aff := _cold(records, n, affinity=True))
    ]
    if pairs:
        ratios = [aff["seconds"] / base["seconds"] for _, base, aff in pairs]
        checks.append(
            TargetCheck(
                "cold sync with session affinity within 2x of without",
                ", ".join(
                    f"{n // 1000}k {aff['seconds']:.2f} s ({r:.2f}x)"
                    for (n, _, aff), r in zip(pairs, ratios, strict=True)
                ),
                all(aff["ok"] for _, _, aff in pairs) and max(ratios) <= 2.0,
            )
        )
    else:
        checks.append(TargetCheck("cold sync with affinity within 2x", "not measured", None))
    return checks


def _incremental_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    at10k = find(records, kind="incremental", subject=OURS, services=10_000)
    if at10k:
        worst = max(r["median_ms"] for r in at10k)
        checks.append(
            TargetCheck(
                "incremental sync at 10k <= 50 ms (median per operation)",
                ", ".join(f"{r['op']} {r['median_ms']:.1f} ms" for r in at10k),
                all(r["ok"] for r in at10k) and worst <= 50.0,
            )
        )
    else:
        checks.append(TargetCheck("incremental sync at 10k <= 50 ms", "not measured", None))
    sizes = sorted({r["services"] for r in find(records, kind="incremental", subject=OURS)})
    if len(sizes) >= 2:
        # The issue's comparison is 10k against 1k; the largest size when 10k is missing.
        low, high = sizes[0], 10_000 if 10_000 in sizes[1:] else sizes[-1]
        parts, ratios = [], []
        for op in ("endpoint", "add", "remove"):
            a = one(records, kind="incremental", subject=OURS, services=low, op=op)
            b = one(records, kind="incremental", subject=OURS, services=high, op=op)
            if a and b:
                ratios.append(b["median_ms"] / a["median_ms"])
                parts.append(f"{op} {ratios[-1]:.2f}x")
        checks.append(
            TargetCheck(
                f"incremental independent of total ({high // 1000}k vs {low // 1000}k, "
                f"<= {INDEPENDENT_RATIO_MAX}x)",
                ", ".join(parts),
                bool(ratios) and max(ratios) <= INDEPENDENT_RATIO_MAX,
            )
        )
    else:
        checks.append(TargetCheck("incremental independent of total", "not measured", None))
    return checks


def _flat(small: Record, big: Record) -> bool:
    """Whether ``big`` costs about what ``small`` does per new connection.

    Either p50 within ``FLAT_RATIO_MAX``, or the rules' overhead (p50 over the bare
    endpoint's p50, measured in the same topology) within ``FLAT_SLACK_US``: p50s of
    separate topologies differ by a few microseconds even with the same rules.
    """
    return bool(
        big["p50_us"] <= small["p50_us"] * FLAT_RATIO_MAX
        or big["overhead_us"] - small["overhead_us"] <= FLAT_SLACK_US
    )


def _dataplane_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    svc = sorted(
        find(records, kind="dataplane", subject=OURS, case="service-10"),
        key=lambda r: r["services"],
    )
    if len(svc) >= 2:
        checks.append(
            TargetCheck(
                "first-connection cost flat in the number of Services (p50; rules' overhead)",
                ", ".join(
                    f"{size_label(r['services'])} {r['p50_us']:.1f} us ({r['overhead_us']:+.1f})"
                    for r in svc
                ),
                all(_flat(svc[0], r) for r in svc[1:]),
            )
        )
    else:
        checks.append(TargetCheck("first-connection cost flat in Services", "not measured", None))
    widths = []
    for n in sorted({r["services"] for r in find(records, kind="dataplane", subject=OURS)}):
        two = one(records, kind="dataplane", subject=OURS, services=n, case="service-2")
        wide = one(records, kind="dataplane", subject=OURS, services=n, case="service-1000")
        if two and wide:
            widths.append((n, two, wide))
    if widths:
        checks.append(
            TargetCheck(
                "1000 endpoints cost about the same per new connection as 2 (p50)",
                ", ".join(
                    f"{size_label(n)}: {a['p50_us']:.1f} vs {b['p50_us']:.1f} us"
                    for n, a, b in widths
                ),
                all(_flat(a, b) for _, a, b in widths),
            )
        )
    else:
        checks.append(TargetCheck("1000 endpoints cost about the same as 2", "not measured", None))
    return checks


def backend_targets(records: Sequence[Record]) -> list[TargetCheck]:
    """Issue 4's targets: the nftables backend against upstream's structure, growth."""
    return _cold_targets(records) + _incremental_targets(records) + _dataplane_targets(records)


# Issue 11: nftables at 100k Services --------------------------------------------------------

ENDPOINT_CHANGE_MAX_MS = 5.0  # median, at 10k and at 30k
SERVICE_CHANGE_MAX_MS = 20.0  # median Service add / remove at 30k
COLD_10K_MAX_S = 4.0
COLD_100K_MAX_S = 90.0
PEAK_100K_MAX_MB = 1536.0
PEAK_10K_MAX_MB = 250.0
WHOLE_PROCESS_MIN_RATIO = 10.0  # upstream's nft -f / our binary, 5k x 10
AFFINITY_MAX_RATIO = 1.5  # issue 32 item 3 (issue 11 asked for 2x)
FIRST_CONNECTION_MAX_RATIO = 1.10  # p50 at N / p50 at 1k; 1000 endpoints / 2 endpoints
CHURN_CPU_MAX = 0.10  # share of one core
# Restart against cold: the same work on the same input in two processes (the map
# structure's restart writes a new generation, as a cold sync does, plus one listing of
# chain and set names); peak and resident sizes differ by a few MB run to run (allocator
# arenas) and times by 1-2 % (at 1k-30k in one run: restart 0.2-2 % faster or slower),
# so "no slower, no more memory" allows 2 % either way.
RESTART_MEMORY_SLACK = 1.02


def _issue11(target: str, measured: str, holds: bool | None) -> TargetCheck:
    return TargetCheck(target, measured, holds, issue=11)


def _ms(r: Record | None) -> str:
    return "-" if r is None else f"{r['median_ms']:.1f}"


def _peak_mb(r: Record) -> float:
    """The proxy's peak plus the largest tool process's (libnftables is in the proxy)."""
    return float((r.get("proxy_peak_mb") or 0) + (r.get("tool_peak_mb") or 0))


def _input_note(r: Record) -> str:
    value = r.get("input_mb")
    return "" if value is None else f" (synthetic input {value:.0f} MB of it)"


def _chains_note(text: str) -> str:
    return f"; chains: {text}" if text else ""


def _incremental_at(
    records: Sequence[Record], subject: str, services: int, op: str
) -> Record | None:
    return one(records, kind="incremental", subject=subject, services=services, op=op)


def _median_limit(
    records: Sequence[Record], target: str, cases: Sequence[tuple[str, int, str]], limit: float
) -> TargetCheck:
    """Every ``(label, Services, op)`` incremental median of ours within ``limit`` ms."""
    ours = [(label, _incremental_at(records, OURS, n, op)) for label, n, op in cases]
    theirs = [(label, _incremental_at(records, CHAINS, n, op)) for label, n, op in cases]
    measured = ", ".join(f"{label} {_ms(r)} ms" for label, r in ours)
    if any(r for _, r in theirs):
        measured += _chains_note(", ".join(f"{label} {_ms(r)}" for label, r in theirs))
    found = [r for _, r in ours if r is not None]
    return _issue11(
        target,
        measured if found else "not measured",
        None
        if len(found) < len(cases)
        else all(r["ok"] and r["median_ms"] <= limit for r in found),
    )


def _change_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    checks.append(
        _median_limit(
            records,
            f"endpoint change <= {ENDPOINT_CHANGE_MAX_MS:g} ms at 10k and at 30k (median)",
            [("10k", 10_000, "endpoint"), ("30k", 30_000, "endpoint")],
            ENDPOINT_CHANGE_MAX_MS,
        )
    )
    checks.append(
        _median_limit(
            records,
            f"Service add and remove <= {SERVICE_CHANGE_MAX_MS:g} ms at 30k (median)",
            [("add", 30_000, "add"), ("remove", 30_000, "remove")],
            SERVICE_CHANGE_MAX_MS,
        )
    )
    ratios: list[tuple[str, float]] = []
    chain_ratios: list[str] = []
    for op in ("endpoint", "add", "remove"):
        low = _incremental_at(records, OURS, 1_000, op)
        high = _incremental_at(records, OURS, 30_000, op)
        if low and high and low["median_ms"] > 0:
            ratios.append((op, high["median_ms"] / low["median_ms"]))
        c_low = _incremental_at(records, CHAINS, 1_000, op)
        c_high = _incremental_at(records, CHAINS, 30_000, op)
        if c_low and c_high and c_low["median_ms"] > 0:
            chain_ratios.append(f"{op} {c_high['median_ms'] / c_low['median_ms']:.1f}x")
    checks.append(
        _issue11(
            f"30k / 1k <= {INDEPENDENT_RATIO_MAX}x for each kind of change (medians)",
            (
                ", ".join(f"{op} {ratio:.2f}x" for op, ratio in ratios)
                + _chains_note(", ".join(chain_ratios))
            )
            if ratios
            else "not measured",
            None if len(ratios) < 3 else all(r <= INDEPENDENT_RATIO_MAX for _, r in ratios),
        )
    )
    return checks


def _scale_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    r10k, c10k = full_sync(records, 10_000), full_sync(records, 10_000, CHAINS)
    checks.append(
        _issue11(
            f"cold full sync 10k x 10 <= {COLD_10K_MAX_S:g} s",
            f"{r10k['seconds']:.2f} s" + _chains_note(f"{c10k['seconds']:.2f} s" if c10k else "")
            if r10k
            else "not measured",
            (r10k["ok"] and r10k["seconds"] <= COLD_10K_MAX_S) if r10k else None,
        )
    )
    r100k = full_sync(records, 100_000)
    if r100k and not r100k.get("timed_out"):
        peak = _peak_mb(r100k)
        checks.append(
            _issue11(
                f"cold full sync 100k x 10 <= {COLD_100K_MAX_S:g} s, proxy peak "
                f"<= {PEAK_100K_MAX_MB / 1024:g} GB",
                f"{r100k['seconds']:.1f} s, peak {peak:.0f} MB{_input_note(r100k)}",
                r100k["ok"] and r100k["seconds"] <= COLD_100K_MAX_S and peak <= PEAK_100K_MAX_MB,
            )
        )
    else:
        checks.append(
            _issue11(
                "cold full sync 100k x 10 <= 90 s, <= 1.5 GB",
                "timed out" if r100k else "not measured",
                False if r100k else None,
            )
        )
    restart = full_sync(records, 100_000, kind="restart")
    if r100k and restart and not r100k.get("timed_out") and not restart.get("timed_out"):
        pairs = (
            ("time", "seconds", "s"),
            ("peak", "proxy_peak_mb", "MB"),
            ("resident after", "rss_after_mb", "MB"),
        )
        parts, holds = [], restart["ok"] and r100k["ok"]
        for label, key, unit in pairs:
            cold_value, restart_value = r100k.get(key), restart.get(key)
            if cold_value is None or restart_value is None:
                holds = False
                continue
            digits = 1 if unit == "s" else 0
            parts.append(f"{label} {restart_value:.{digits}f} vs {cold_value:.{digits}f} {unit}")
            holds = holds and restart_value <= cold_value * RESTART_MEMORY_SLACK
        checks.append(
            _issue11(
                "restart over a 100k table no slower than cold, no more memory (restart vs "
                f"cold, within {RESTART_MEMORY_SLACK - 1:.0%}: two identical runs' spread)",
                ", ".join(parts),
                holds,
            )
        )
    else:
        checks.append(
            _issue11("restart at 100k no slower, no bigger than cold", "not measured", None)
        )
    peaks = [
        r
        for kind in ("cold", "restart")
        if (r := full_sync(records, 10_000, kind=kind)) is not None and not r.get("timed_out")
    ]
    chain_peaks = [
        f"{r['kind']} {_peak_mb(r):.0f} MB"
        for kind in ("cold", "restart")
        if (r := full_sync(records, 10_000, CHAINS, kind=kind)) is not None
        and not r.get("timed_out")
    ]
    checks.append(
        _issue11(
            f"proxy peak resident at 10k x 10 <= {PEAK_10K_MAX_MB:g} MB",
            (
                ", ".join(f"{r['kind']} {_peak_mb(r):.0f} MB{_input_note(r)}" for r in peaks)
                + _chains_note(", ".join(chain_peaks))
            )
            if peaks
            else "not measured",
            all(r["ok"] and _peak_mb(r) <= PEAK_10K_MAX_MB for r in peaks) if peaks else None,
        )
    )
    return checks


def whole_process_ratio(
    records: Sequence[Record], services: int, subject: str = OURS
) -> float | None:
    """Upstream's ``nft -f`` time over our binary's, both whole processes (None: missing)."""
    ours = one(records, kind="whole_process", subject=subject, services=services)
    theirs = one(records, kind="whole_process", subject=UPSTREAM, services=services)
    if not ours or not theirs or not ours["ok"] or not theirs["ok"] or ours["seconds"] <= 0:
        return None
    return float(theirs["seconds"] / ours["seconds"])


def _whole_process_target(records: Sequence[Record]) -> TargetCheck:
    ours = one(records, kind="whole_process", subject=OURS, services=5_000)
    theirs = one(records, kind="whole_process", subject=UPSTREAM, services=5_000)
    ratio = whole_process_ratio(records, 5_000)
    target = (
        f"5k x 10 whole process >= {WHOLE_PROCESS_MIN_RATIO:g}x faster than upstream's "
        "structure (kube-proxy-nftables --manifests DIR --once vs nft -f)"
    )
    if ours is None or theirs is None or ratio is None:
        return _issue11(target, "not measured", None)
    chains = one(records, kind="whole_process", subject=CHAINS, services=5_000)
    chain_ratio = whole_process_ratio(records, 5_000, CHAINS)
    note = (
        _chains_note(f"{chains['seconds']:.2f} s, {chain_ratio:.1f}x")
        if chains and chain_ratio
        else ""
    )
    return _issue11(
        target,
        f"{ours['seconds']:.2f} s vs {theirs['seconds']:.1f} s: {ratio:.1f}x{note}",
        ratio >= WHOLE_PROCESS_MIN_RATIO,
    )


def _affinity_target(records: Sequence[Record]) -> TargetCheck:
    parts, ratios, ok = [], [], True
    chain_parts = []
    for n in sorted({r["services"] for r in find(records, kind="cold", affinity=True)}):
        plain_r, aff = full_sync(records, n), full_sync(records, n, affinity=True)
        if plain_r and aff and plain_r["ok"] and plain_r["seconds"] > 0:
            ratios.append(aff["seconds"] / plain_r["seconds"])
            ok = ok and bool(aff["ok"]) and not aff.get("timed_out")
            parts.append(
                f"{size_label(n)} {aff['seconds']:.2f} vs {plain_r['seconds']:.2f} s "
                f"({ratios[-1]:.2f}x)"
            )
        for subject, label in (
            (AFF_PINNED, "chains per port"),
            (AFF_MAPS, "a map per port"),
            (CHAINS, "chains"),
        ):
            shipped = subject in (AFF_PINNED, AFF_MAPS)
            c_plain = full_sync(records, n, subject) or (plain_r if shipped else None)
            c_aff = full_sync(records, n, subject, affinity=True)
            if c_plain and c_aff and c_plain["ok"] and c_plain["seconds"] > 0:
                ratio = c_aff["seconds"] / c_plain["seconds"]
                chain_parts.append(f"{label} {size_label(n)} {ratio:.2f}x")
    return _issue11(
        f"session affinity on every Service: cold sync within {AFFINITY_MAX_RATIO:g}x of "
        "without, at each size",
        ", ".join(parts) + (f"; before: {', '.join(chain_parts)}" if chain_parts else "")
        if parts
        else "not measured",
        (ok and max(ratios) <= AFFINITY_MAX_RATIO) if ratios else None,
    )


def _first_connection_targets(records: Sequence[Record]) -> list[TargetCheck]:
    def p50(subject: str, n: int, case: str) -> Record | None:
        return one(records, kind="dataplane", subject=subject, services=n, case=case)

    checks = []
    sizes = sorted({r["services"] for r in find(records, kind="dataplane", subject=OURS)})
    base = p50(OURS, 1_000, "service-10")
    rows = [(n, r) for n in sizes if (r := p50(OURS, n, "service-10")) is not None]
    chain_rows = [
        f"{size_label(n)} {r['p50_us']:.1f}"
        for n in sorted({r["services"] for r in find(records, kind="dataplane", subject=CHAINS)})
        if (r := p50(CHAINS, n, "service-10")) is not None
    ]
    measured = ", ".join(
        f"{size_label(n)} {r['p50_us']:.1f} us"
        + (f" ({r['p50_us'] / base['p50_us']:.2f}x)" if base and n != 1_000 else "")
        for n, r in rows
    )
    checks.append(
        _issue11(
            "first connection (10-endpoint ClusterIP) flat from 1k to 100k Services: p50 "
            f"within {FIRST_CONNECTION_MAX_RATIO - 1:.0%} of 1k's",
            measured + _chains_note(", ".join(chain_rows)) if rows else "not measured",
            None
            if base is None or len(rows) < 2
            else all(r["p50_us"] <= base["p50_us"] * FIRST_CONNECTION_MAX_RATIO for _, r in rows),
        )
    )
    widths = [
        (n, two, wide)
        for n in sizes
        if (two := p50(OURS, n, "service-2")) and (wide := p50(OURS, n, "service-1000"))
    ]
    checks.append(
        _issue11(
            "a 1000-endpoint Service costs about the same per new connection as a "
            f"2-endpoint one: p50 within {FIRST_CONNECTION_MAX_RATIO - 1:.0%}",
            ", ".join(
                f"{size_label(n)} {wide['p50_us']:.1f} vs {two['p50_us']:.1f} us"
                for n, two, wide in widths
            )
            if widths
            else "not measured",
            all(w["p50_us"] <= t["p50_us"] * FIRST_CONNECTION_MAX_RATIO for _, t, w in widths)
            if widths
            else None,
        )
    )
    return checks


def _churn_cell(r: Record) -> str:
    return (
        f"{r['cpu_share']:.1%} of a core, {r['syncs_per_s']:.2f} syncs/s, "
        f"p50 {r['sync_p50_ms']:.1f} ms, p99 {r['sync_p99_ms']:.1f} ms"
    )


def _churn_target(records: Sequence[Record]) -> TargetCheck:
    ours = one(records, kind="churn", subject=OURS, services=30_000)
    chains = one(records, kind="churn", subject=CHAINS, services=30_000)
    target = (
        f"churn at 30k, 50 endpoint changes/s for 60 s: proxy CPU < {CHURN_CPU_MAX:.0%} of one core"
    )
    if ours is None:
        return _issue11(target, "not measured", None)
    return _issue11(
        target,
        _churn_cell(ours) + _chains_note(_churn_cell(chains) if chains else ""),
        bool(ours["ok"]) and ours["cpu_share"] < CHURN_CPU_MAX,
    )


def scale_targets(records: Sequence[Record]) -> list[TargetCheck]:
    """Issue 11's targets: per-change cost independent of the cluster, 100k Services."""
    return [
        *_change_targets(records),
        *_scale_targets(records),
        _whole_process_target(records),
        _affinity_target(records),
        *_first_connection_targets(records),
        _churn_target(records),
    ]


CLASS_DELTA_MAX_US = 3.0  # issue 19: 500 classes vs 5, per new connection (p50)
REALISTIC_CHANGE_MAX_MS = 1.0  # issue 19: per-change median on the realistic mix


def _issue19(target: str, measured: str, holds: bool | None) -> TargetCheck:
    return TargetCheck(target, measured, holds, issue=19)


def _class_targets(records: Sequence[Record]) -> list[TargetCheck]:
    def p50(subject: str, classes: int, case: str) -> float | None:
        r = one(records, kind="dataplane_classes", subject=subject, classes=classes, case=case)
        return None if r is None else float(r["p50_us"])

    checks = []
    for case, what in (("last-class", "the last class"), ("direct", "traffic to no Service")):
        few, many = p50(OURS, 5, case), p50(OURS, 500, case)
        before = (p50(RULES, 5, case), p50(RULES, 500, case))
        note = ""
        if before[0] is not None and before[1] is not None:
            note = f" (one rule per class, before: {before[0]:.1f} -> {before[1]:.1f} us)"
        if few is None or many is None:
            checks.append(_issue19(f"500 classes vs 5, {what}", "not measured", None))
            continue
        checks.append(
            _issue19(
                f"500 classes cost at most {CLASS_DELTA_MAX_US:.0f} us more per new connection "
                f"than 5, for {what} (p50)",
                f"{few:.1f} -> {many:.1f} us ({many - few:+.1f}){note}",
                many - few <= CLASS_DELTA_MAX_US,
            )
        )
    return checks


def _realistic_targets(records: Sequence[Record]) -> list[TargetCheck]:
    checks = []
    colds = find(records, kind="realistic_cold", subject=OURS)
    checks.append(
        _issue19(
            "the realistic mix syncs at every size (cold and restart)",
            ", ".join(
                f"{size_label(r['services'])} {r['seconds']:.1f} s, peak {_peak_mb(r):.0f} MB"
                for r in sorted(colds, key=lambda r: r["services"])
            )
            or "not measured",
            all(r["ok"] for r in [*colds, *find(records, kind="realistic_restart", subject=OURS)])
            if colds
            else None,
        )
    )
    cases = [(n, op) for n in (30_000, 100_000) for op in ("endpoint", "add", "remove")]
    found = [
        (n, op, one(records, kind="realistic_incremental", subject=OURS, services=n, op=op))
        for n, op in cases
    ]
    measured = [(n, op, r) for n, op, r in found if r is not None]
    checks.append(
        _issue19(
            f"realistic mix: endpoint change, Service add and remove <= "
            f"{REALISTIC_CHANGE_MAX_MS:.0f} ms median at 30k and 100k",
            ", ".join(f"{size_label(n)} {op} {r['median_ms']:.2f} ms" for n, op, r in measured)
            or "not measured",
            all(r["median_ms"] <= REALISTIC_CHANGE_MAX_MS for _, _, r in measured)
            if len(measured) == len(cases)
            else None,
        )
    )
    return checks


def issue19_targets(records: Sequence[Record]) -> list[TargetCheck]:
    """Issue 19's targets: the first packet flat in the number of classes, and the
    realistic mix syncing at every size with per-change costs as on the uniform one."""
    return [*_class_targets(records), *_realistic_targets(records)]


# Issue 20: the daemon a node runs, next to the in-process figures of the same run ----------

DAEMON_PARTIAL_MAX_RATIO = 2.0  # the daemon's partial-sync median / in-process endpoint median
DAEMON_FIRST_SYNC_MAX_RATIO = 2.0  # first sync from process start / in-process cold sync
DAEMON_PEAK_100K_MAX_MB = 1024.0
DAEMON_LISTEN_MAX_S = 1.0  # /livez and /healthz answering, from the process start
CHURN_DAEMON_CPU_MAX = 0.03
CHURN_DAEMON_PARTIAL_MAX_MS = 5.0
CHURN_PROGRAMMING_P99_MAX_S = 1.0
DAEMON_SOURCES = ("api", "manifests")  # judged; YAML manifests are reported beside


def _issue20(target: str, measured: str, holds: bool | None) -> TargetCheck:
    return TargetCheck(target, measured, holds, issue=20)


def _daemon(records: Sequence[Record], source: str, services: int) -> Record | None:
    return one(records, kind="daemon", subject=OURS, source=source, services=services)


def _ratio_target(
    records: Sequence[Record],
    target: str,
    cells: Sequence[tuple[str, int]],
    figures: Any,
    limit: float,
    unit: str,
) -> TargetCheck:
    """``figures(source, n) -> (daemon value, in-process value) | None`` for each cell;
    the target holds when every measured ratio is within ``limit``."""
    parts, ratios = [], []
    for source, n in cells:
        pair = figures(source, n)
        if pair is None:
            continue
        ours, base = pair
        ratio = ours / base if base else math.inf
        judged = source in DAEMON_SOURCES
        if judged:
            ratios.append(ratio)
        parts.append(
            f"{source} {size_label(n)} {ours:.{2 if unit == 'ms' else 1}f} vs "
            f"{base:.{2 if unit == 'ms' else 1}f} {unit} ({ratio:.1f}x)"
            + ("" if judged else ", not judged")
        )
    judged_cells = [c for c in cells if c[0] in DAEMON_SOURCES]
    return _issue20(
        target,
        "; ".join(parts) if parts else "not measured",
        None if len(ratios) < len(judged_cells) else all(r <= limit for r in ratios),
    )


def _partial_target(records: Sequence[Record]) -> TargetCheck:
    def figures(source: str, n: int) -> tuple[float, float] | None:
        daemon = _daemon(records, source, n)
        inproc = _incremental_at(records, OURS, n, "endpoint")
        if daemon is None or inproc is None or daemon.get("median_ms") is None:
            return None
        return float(daemon["median_ms"]), float(inproc["median_ms"])

    check = _ratio_target(
        records,
        f"the daemon's own partial-sync metric (median) within {DAEMON_PARTIAL_MAX_RATIO:g}x "
        "of the in-process incremental endpoint change, at 30k and 100k, API and manifests",
        [(s, n) for n in (30_000, 100_000) for s in DAEMON_SOURCES],
        figures,
        DAEMON_PARTIAL_MAX_RATIO,
        "ms",
    )
    cadence = [
        f"{size_label(r['services'])} {r['median_ms']:.2f} ms"
        for r in sorted(
            find(records, kind="incremental_cadence", subject=OURS), key=lambda r: r["services"]
        )
    ]
    if not cadence:
        return check
    note = f"; in-process at the daemon's cadence (a change a second): {', '.join(cadence)}"
    return _issue20(check.target, check.measured + note, check.holds)


def _first_sync_target(records: Sequence[Record]) -> TargetCheck:
    def figures(source: str, n: int) -> tuple[float, float] | None:
        daemon = _daemon(records, source, n)
        cold = full_sync(records, n)
        if daemon is None or cold is None or not cold["ok"]:
            return None
        return float(daemon["first_sync_s"]), float(cold["seconds"])

    return _ratio_target(
        records,
        f"whole process, first sync (from the process start) within "
        f"{DAEMON_FIRST_SYNC_MAX_RATIO:g}x of the in-process cold sync, 10k/30k/100k, API "
        "(pages of 500) and JSON manifests (YAML reported)",
        [
            (s, n)
            for n in (10_000, 30_000, 100_000)
            for s in ("api", "manifests", "manifests-yaml")
            if s != "manifests-yaml" or n < 100_000
        ],
        figures,
        DAEMON_FIRST_SYNC_MAX_RATIO,
        "s",
    )


def _split_cell(r: Record) -> str:
    if r.get("split_source_mb") is None:
        return ""
    return (
        f": source {r['split_source_mb']:.0f}, proxier {r['split_proxier_mb']:.0f}, "
        f"backend {r['split_backend_mb']:.0f} MB"
    )


def _daemon_memory_target(records: Sequence[Record]) -> TargetCheck:
    found = [(s, r) for s in DAEMON_SOURCES if (r := _daemon(records, s, 100_000)) is not None]
    return _issue20(
        f"peak memory of the whole process at 100k x 10 below {DAEMON_PEAK_100K_MAX_MB:g} MB, "
        "API and manifests (objects kept by the source, proxier state, backend model)",
        "; ".join(f"{s} peak {r['peak_mb']:.0f} MB{_split_cell(r)}" for s, r in found)
        if found
        else "not measured",
        None
        if len(found) < len(DAEMON_SOURCES)
        else all(r["peak_mb"] < DAEMON_PEAK_100K_MAX_MB for _, r in found),
    )


def _daemon_churn_target(records: Sequence[Record]) -> TargetCheck:
    r = one(records, kind="daemon_churn", subject=OURS, services=30_000)
    target = (
        "churn through the API at 30k (50 EndpointSlice updates/s, 60 s): daemon CPU < "
        f"{CHURN_DAEMON_CPU_MAX:.0%} of a core, mean partial sync < "
        f"{CHURN_DAEMON_PARTIAL_MAX_MS:g} ms, network programming p99 < "
        f"{CHURN_PROGRAMMING_P99_MAX_S:g} s"
    )
    if r is None:
        return _issue20(target, "not measured", None)
    mean, p99 = r.get("partial_mean_ms"), r.get("programming_p99_s")
    over = r.get("programming_over_1s")
    latency = r.get("programming_mean_s")
    measured = (
        f"{r['cpu_share']:.1%} of a core, {r['syncs_per_s']:.2f} syncs/s, mean partial "
        f"{'-' if mean is None else f'{mean:.2f}'} ms, programming p50 <= "
        f"{r.get('programming_p50_s')} s, p99 <= {p99} s (histogram buckets, "
        f"{r.get('programming_samples')} samples"
        + ("" if latency is None else f"; mean {latency:.2f} s")
        + ("" if over is None else f"; {over:.1%} over 1 s")
        + ")"
    )
    return _issue20(
        target,
        measured,
        bool(r["ok"])
        and r["cpu_share"] < CHURN_DAEMON_CPU_MAX
        and mean is not None
        and mean < CHURN_DAEMON_PARTIAL_MAX_MS
        and p99 is not None
        and p99 < CHURN_PROGRAMMING_P99_MAX_S,
    )


def _startup_target(records: Sequence[Record]) -> TargetCheck:
    found = sorted(
        find(records, kind="daemon", subject=OURS), key=lambda r: (r["services"], r["source"])
    )
    parts, holds = [], bool(found)
    for r in found:
        livez, healthz = r.get("livez_s"), r.get("healthz_s")
        before = r.get("healthz_before_sync") or []
        ok = (
            livez is not None
            and healthz is not None
            and max(livez, healthz) <= DAEMON_LISTEN_MAX_S
            and set(before) <= {503}
        )
        holds = holds and ok
        parts.append(
            f"{r['source']} {size_label(r['services'])} "
            + ("-" if livez is None else f"{livez:.2f}")
            + " s"
            + (f", 503 until {r['healthz_ok_s']:.1f} s" if 503 in before else "")
        )
    return _issue20(
        f"/livez and /healthz listen within {DAEMON_LISTEN_MAX_S:g} s of the process start at "
        "any size; /healthz 503 until the first sync",
        "; ".join(parts) if parts else "not measured",
        holds if found else None,
    )


def daemon_targets(records: Sequence[Record]) -> list[TargetCheck]:
    """Issue 20's targets: the daemon a node runs against the in-process figures."""
    return [
        _partial_target(records),
        _first_sync_target(records),
        _daemon_memory_target(records),
        _daemon_churn_target(records),
        _startup_target(records),
    ]


# Issue 32 item 4: every change data only, a never-seen endpoint count included ------------

EVERY_CHANGE_P99_MAX_MS = 2.0
NEW_COUNT_OPS = ("endpoint", "add", "remove", "newcount")


def new_count_target(records: Sequence[Record]) -> TargetCheck:
    """p99 of every kind of change on the realistic mix at 100k, a Service of an endpoint
    count no Service had included, within :data:`EVERY_CHANGE_P99_MAX_MS` (the shipped
    structure; ``test_new_count``)."""
    found = [
        (op, one(records, kind="new_count_incremental", subject=OURS, services=100_000, op=op))
        for op in NEW_COUNT_OPS
    ]
    measured = [(op, r) for op, r in found if r is not None and "p99_ms" in r]
    return TargetCheck(
        f"realistic mix at 100k: p99 of every kind of change (endpoint, add, remove, a "
        f"never-seen endpoint count) <= {EVERY_CHANGE_P99_MAX_MS:.0f} ms",
        ", ".join(f"{op} {r['p99_ms']:.2f} ms" for op, r in measured) or "not measured",
        all(r["p99_ms"] <= EVERY_CHANGE_P99_MAX_MS for _, r in measured)
        if len(measured) == len(NEW_COUNT_OPS)
        else None,
        issue=32,
    )


def evaluate_targets(records: Sequence[Record]) -> list[TargetCheck]:
    """Every target (issue 4's, 11's, 19's, 20's and 32's) against the records of one run."""
    return (
        backend_targets(records)
        + scale_targets(records)
        + issue19_targets(records)
        + daemon_targets(records)
        + [new_count_target(records)]
    )
