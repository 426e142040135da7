"""Stand-ins for the garbage-collector calls the daemon makes (its ``GcOps``): tests must
not freeze, hold or retune the collector of the test process itself."""

from __future__ import annotations

from kubeproxy.daemon.gctuning import GcOps

__all__ = ["UNTOUCHED", "recording_gc"]


def _nothing() -> None:
    return None


UNTOUCHED = GcOps(
    collect=lambda: 0,
    freeze=_nothing,
    set_threshold=lambda *_: None,
    disable=_nothing,
    enable=_nothing,
)
"""The collector left alone."""


def recording_gc() -> tuple[GcOps, list[str]]:
    """Stand-ins that note each call (``collect``, ``freeze``, ``threshold A B C``,
    ``disable``, ``enable``) in the returned list instead."""
    calls: list[str] = []

    def collect() -> int:
        calls.append("collect")
        return 0

    ops = GcOps(
        collect=collect,
        freeze=lambda: calls.append("freeze"),
        set_threshold=lambda a, b, c: calls.append(f"threshold {a} {b} {c}"),
        disable=lambda: calls.append("disable"),
        enable=lambda: calls.append("enable"),
    )
    return ops, calls
