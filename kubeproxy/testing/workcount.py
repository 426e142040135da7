"""Counting the work a piece of code does, not its time: :func:`count_work`.

A sync that costs 0.3 ms at 1k Services and 0.3 ms at 30k on an idle machine can still
hide a loop over every Service that a loaded machine, or 100k Services, brings out; and a
timed test on a shared CI machine is noise. What is counted instead, in the calling
thread while the code runs:

* ``opcodes``: Python bytecode instructions executed (:func:`sys.settrace` with opcode
  events): a loop over every Service in Python shows up in proportion;
* ``calls``: function calls, Python and C (:func:`sys.setprofile`);
* ``peak_bytes``: the most memory held at once above the starting point
  (:mod:`tracemalloc`): a loop written in C (a ``dict(...)`` copy of every port,
  ``sorted`` over every Service) allocates in proportion, where it runs no bytecode.

Together they catch what grows with the data. They miss a C loop that allocates nothing
(``x in some_list``); keep such code out of per-change paths. Counting slows the code
down by two orders of magnitude: measure one change, not a start-up.
"""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

__all__ = ["Work", "count_work"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Work:
    """What one call of :func:`count_work` counted."""

    opcodes: int
    calls: int
    peak_bytes: int

    def within(self, other: Work, ratio: float, slack: int = 0) -> bool:
        """Whether every count is at most ``ratio`` times ``other``'s plus ``slack``
        (``slack`` in opcodes and calls, and ``slack`` x 64 in bytes)."""
        return (
            self.opcodes <= other.opcodes * ratio + slack
            and self.calls <= other.calls * ratio + slack
            and self.peak_bytes <= other.peak_bytes * ratio + 64 * slack
        )

    def __str__(self) -> str:
        return f"{self.opcodes} opcodes, {self.calls} calls, {self.peak_bytes} bytes at peak"


def count_work(fn: Callable[[], T]) -> tuple[T, Work]:
    """Run ``fn()`` in this thread, counting its work; its result and the :class:`Work`.

    Other threads are not counted: run the code to measure synchronously. Any tracer or
    profiler already installed in this thread is put back afterwards.
    """
    counts = [0, 0]

    def on_opcode(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[0] += 1
        return on_opcode

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return on_opcode

    def on_profile(frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counts[1] += 1

    previous_trace, previous_profile = sys.gettrace(), sys.getprofile()
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    start_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    sys.setprofile(on_profile)
    sys.settrace(on_call)
    try:
        result = fn()
    finally:
        sys.settrace(previous_trace)
        sys.setprofile(previous_profile)
        peak = tracemalloc.get_traced_memory()[1]
        if not tracing:
            tracemalloc.stop()
    return result, Work(counts[0], counts[1], max(0, peak - start_bytes))
