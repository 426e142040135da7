"""The soak's heap watch (``python -m bench.soak --heap-watch``; issue 31's RSS question).

Not part of the proxy: ``bench.soak`` puts this directory on the daemon's ``PYTHONPATH``
and sets ``KPXB_HEAPWATCH`` to a file; Python imports ``sitecustomize`` at start-up, and
this one starts a thread that appends, every ``KPXB_HEAPWATCH_EVERY`` seconds (default
10), one JSON line: the process's RSS, glibc malloc's bytes in use and free within its
arenas (``mallinfo2``), pymalloc's blocks in use (``sys.getallocatedblocks``), the
collector's counts and frozen objects, and, with ``KPXB_HEAPWATCH_FRAMES`` > 0
(``tracemalloc`` on, which slows the daemon and costs memory of its own), the bytes
Python has allocated and not freed.

Why: RSS alone cannot tell a leak (live memory growing) from an allocator keeping what it
once needed (free memory not handed back); the heap's figures beside it can. Measured in
the soak's daemon (2000 Services, churn, repeated relists; ``bench/results/soak-rss.md``):
RSS rose by steps while the traced bytes, the blocks in use and malloc's bytes in use
stayed level, and ``malloc_trim(0)`` returned 57 MB of 279 and 79 of 331.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from typing import Any

_FIELDS = [
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
]
"""``struct mallinfo2``'s fields, in order (glibc 2.33+)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _mallinfo() -> Any:
    """glibc's ``mallinfo2`` (None elsewhere: musl has none)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        call = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = _MallInfo2
    return call


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def sample(mallinfo: Any, started: float) -> dict[str, Any]:
    """One line's figures."""
    line: dict[str, Any] = {
        "t": round(time.monotonic() - started, 1),
        "rss_mb": round(_rss_mb(), 1),
        "pymalloc_blocks": sys.getallocatedblocks(),
        "gc_counts": list(gc.get_count()),
        "gc_frozen": gc.get_freeze_count(),
    }
    if mallinfo is not None:
        info = mallinfo()
        line["malloc_in_use_mb"] = round(info.uordblks / 2**20, 1)
        line["malloc_free_mb"] = round(info.fordblks / 2**20, 1)
        line["malloc_mmapped_mb"] = round(info.hblkhd / 2**20, 1)
    if tracemalloc.is_tracing():
        line["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
    return line


def _watch(path: str, every: float) -> None:
    started = time.monotonic()
    mallinfo = _mallinfo()
    while True:
        with open(path, "a") as out:
            out.write(json.dumps(sample(mallinfo, started)) + "\n")
        time.sleep(every)


def _start() -> None:
    path = os.environ.get("KPXB_HEAPWATCH")
    if not path:
        return
    frames = int(os.environ.get("KPXB_HEAPWATCH_FRAMES", "0"))
    if frames > 0:
        tracemalloc.start(frames)
    every = float(os.environ.get("KPXB_HEAPWATCH_EVERY", "10"))
    threading.Thread(target=_watch, args=(path, every), name="heapwatch", daemon=True).start()


_start()
