"""Run one command and report its own wall time and peak memory.

``python -m bench.peak OUT -- ARGV...`` forks, runs ARGV, waits for it and writes
``{"seconds": ..., "maxrss_kb": ..., "status": ...}`` to OUT; it exits with the
command's exit code.

Why a wrapper: the kernel carries a process's peak resident size across ``fork`` and
``execve`` (``ru_maxrss``), so a command started straight from the benchmark's own
process (250-300 MB of pytest by the end of a run) reported that size as its own peak
(268 MB for a proxy whose own peak was about 50 MB). Forked from this small process
instead, the command's ``ru_maxrss`` is its own, give or take this wrapper's 10 MB.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command after ``--``; the command's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m bench.peak OUT -- ARGV...", file=sys.stderr)
        return 2
    out, command = args[0], args[2:]
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child becomes the command
        try:
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.perf_counter() - start
    with open(out, "w") as handle:
        json.dump({"seconds": seconds, "maxrss_kb": usage.ru_maxrss, "status": status}, handle)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main())
