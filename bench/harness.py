"""Driving the measured subjects: our proxy in a child process, and ``nft -f`` of a file.

Both run inside a benchmark namespace (``ip netns exec``), so whatever they do, they do
it there and never in the host namespace.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from bench.netns import in_netns

if TYPE_CHECKING:
    from pytest_benchmark.fixture import BenchmarkFixture

__all__ = [
    "REPO",
    "UPSTREAM_BACKEND",
    "ApplyResult",
    "ProxyProcess",
    "ProxyProcessError",
    "ProxyTimeout",
    "apply_nft_file",
    "child_process",
    "module_in_netns",
    "percentile",
    "proxy_process",
    "python_module",
    "run_measured",
    "time_once",
]

REPO = Path(__file__).resolve().parents[1]
_KB_PER_MB = 1024


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def time_once(benchmark: BenchmarkFixture, target: Callable[[], object]) -> None:
    """Time ``target`` once with pytest-benchmark (whose ``pedantic`` is untyped)."""
    benchmark.pedantic(target, rounds=1, iterations=1)  # type: ignore[no-untyped-call]


def python_module(module: str, *args: str) -> list[str]:
    """The argument list that runs ``python -m module args`` with ``bench`` importable.

    The child may start in any directory (``ip netns exec`` keeps ours, a test may not),
    so the repository root is put on its ``sys.path`` first.
    """
    bootstrap = (
        f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", bootstrap, *args]


def module_in_netns(netns: str, module: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m module args`` in ``netns`` and return the JSON object its last
    line of output holds; raise :class:`RuntimeError` with its error output if it fails."""
    done = subprocess.run(
        in_netns(netns, python_module(module, *args)),
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)}: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


class ProxyProcessError(RuntimeError):
    """The proxy child failed, answered garbage, or took too long."""


class ProxyTimeout(ProxyProcessError):
    """The proxy child did not answer in time (it is killed when its context ends)."""


class ProxyProcess:
    """A running ``bench.proxyproc`` child (see that module for the protocol)."""

    def __init__(self, process: subprocess.Popen[str], stderr_path: Path) -> None:
        self._process = process
        self._stderr_path = stderr_path
        self.ready: dict[str, Any] = {}

    def _stdout(self) -> IO[str]:
        stream = self._process.stdout
        if stream is None:
            raise ProxyProcessError("proxy child has no stdout")
        return stream

    def _read(self, timeout_s: float) -> dict[str, Any]:
        stream = self._stdout()
        readable, _, _ = select.select([stream], [], [], timeout_s)
        if not readable:
            raise ProxyTimeout(f"proxy child silent for {timeout_s:.0f} s{self._stderr()}")
        line = stream.readline()
        if not line:
            raise ProxyProcessError(f"proxy child exited{self._stderr()}")
        message: dict[str, Any] = json.loads(line)
        if message.get("event") == "error":
            raise ProxyProcessError(f"proxy child: {message.get('error')}")
        return message

    def _stderr(self) -> str:
        try:
            tail = self._stderr_path.read_text()[-3000:]
        except OSError:
            return ""
        return f"; its stderr ends with:\n{tail}" if tail else ""

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Wait for the child's ready line (it builds the synthetic cluster first)."""
        self.ready = self._read(timeout_s)
        return self.ready

    def request(self, op: str, timeout_s: float = 900.0, **args: Any) -> dict[str, Any]:
        """Send one command (``op`` and its ``args``) and return the child's answer."""
        stdin = self._process.stdin
        if stdin is None:
            raise ProxyProcessError("proxy child has no stdin")
        stdin.write(json.dumps({"op": op, **args}) + "\n")
        stdin.flush()
        answer = self._read(timeout_s)
        if answer.get("ok") is False:
            raise ProxyProcessError(f"proxy child: {op} sync failed{self._stderr()}")
        return answer

    def stderr_tail(self) -> str:
        """The last lines the child logged (for failure messages)."""
        return self._stderr()

    def kill(self) -> None:
        """Kill the child and every process it started (its own session)."""
        if self._process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


UPSTREAM_BACKEND = "upstream"
"""The ``backend`` name that drives upstream's structure (:mod:`bench.upstreamproc`)."""


@contextmanager
def proxy_process(
    netns: str,
    services: int,
    endpoints: int = 10,
    *,
    affinity_seconds: int = 0,
    extras: Sequence[tuple[int, int]] = (),
    backend: str = "nftables",
    wide_every: int = 0,
    node_ip: str | None = None,
    min_sync_period: float | None = 0.0,
    ready_timeout_s: float = 600.0,
    mix: str = "uniform",
    class_ladder: bool = False,
) -> Iterator[ProxyProcess]:
    """Start our proxy in ``netns`` with a synthetic cluster; stop it on exit.

    ``extras`` adds Services ``(index, endpoint count)`` on top of the ``services`` ones;
    ``wide_every`` K gives every K-th Service 250 endpoints (the mix); ``mix`` is
    ``uniform``, ``realistic`` (:func:`bench.synthetic.realistic_services`, ``endpoints``
    unused) or ``exposed`` (:func:`bench.synthetic.exposed_services`); ``class_ladder``
    gives Service i i+1 endpoints;
    ``min_sync_period`` is the proxier's (only its own sync loop, the churn, heeds it;
    None: paced by each sync's cost, nftables mode's default).
    ``backend``
    :data:`UPSTREAM_BACKEND` starts :mod:`bench.upstreamproc` instead, which answers
    the same commands by applying upstream's structure with ``nft``.
    """
    module = "bench.upstreamproc" if backend == UPSTREAM_BACKEND else "bench.proxyproc"
    argv = ["--netns", netns, "--backend", backend]
    argv += ["--services", str(services), "--endpoints", str(endpoints)]
    argv += ["--affinity-seconds", str(affinity_seconds)]
    for index, count in extras:
        argv += ["--extra", f"{index}:{count}"]
    if wide_every:
        argv += ["--wide-every", str(wide_every)]
    if node_ip:
        argv += ["--node-ip", node_ip]
    if min_sync_period is None or min_sync_period:
        argv += ["--min-sync-period", "paced" if min_sync_period is None else str(min_sync_period)]
    if mix != "uniform":
        argv += ["--mix", mix]
    if class_ladder:
        argv += ["--class-ladder"]
    with child_process(netns, module, argv, ready_timeout_s=ready_timeout_s) as child:
        yield child


@contextmanager
def child_process(
    netns: str,
    module: str,
    argv: Sequence[str],
    *,
    ready_timeout_s: float = 600.0,
    niceness: int = 0,
) -> Iterator[ProxyProcess]:
    """Run ``python -m module argv`` in ``netns`` (under ``nice -n niceness`` when not
    0), speaking the proxy child's line protocol; wait for its ready line, and on exit
    send ``quit`` (killed after 30 s)."""
    stderr_path = Path(
        f"/tmp/kpxb-{module.rpartition('.')[2]}-{os.getpid()}-{time.monotonic_ns()}.log"
    )
    with stderr_path.open("w") as stderr:
        niced = ["nice", "-n", str(niceness)] if niceness else []
        process = subprocess.Popen(
            in_netns(netns, [*niced, *python_module(module, *argv)]),
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            # Its own session: a timed-out child is killed with the tools it started.
            start_new_session=True,
        )
    child = ProxyProcess(process, stderr_path)
    try:
        child.wait_ready(ready_timeout_s)
        yield child
    finally:
        if process.stdin is not None and process.poll() is None:
            try:
                process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                process.stdin.close()
            except OSError:
                pass
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
        if process.stdout is not None:
            process.stdout.close()
        stderr_path.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """One measured process (``nft -f``, a proxy binary): wall time, peak memory, outcome."""

    seconds: float
    peak_rss_mb: float
    ok: bool
    timed_out: bool
    stderr: str


def run_measured(
    netns: str, argv: Sequence[str], *, timeout_s: float = 1800.0, cwd: Path | None = None
) -> ApplyResult:
    """Run ``argv`` in ``netns``; measure its wall time, from start to exit, and its peak
    RSS (``wait4``: ``ip netns exec`` execs the command in place, so the child's rusage
    is the command's, and the largest of the processes it waited for).

    After ``timeout_s`` the process is killed and the result says so.
    """
    with tempfile.TemporaryFile("w+") as errors, tempfile.NamedTemporaryFile() as report:
        start = time.perf_counter()
        process = subprocess.Popen(
            python_module("bench.peak", report.name, "--", *in_netns(netns, list(argv))),
            stdout=subprocess.DEVNULL,
            stderr=errors,
            cwd=cwd,
            # Its own session: a timed-out command is killed with the wrapper.
            start_new_session=True,
        )
        seconds, status, timed_out = _wait_for(process, start, timeout_s)
        errors.seek(0)
        stderr = errors.read()
        measured = json.loads(Path(report.name).read_text() or "{}")
    process.returncode = os.waitstatus_to_exitcode(status)
    return ApplyResult(
        # The wrapper's own figures when it got to write them (not after a kill).
        seconds=measured.get("seconds", seconds),
        peak_rss_mb=measured.get("maxrss_kb", 0) / _KB_PER_MB,
        ok=process.returncode == 0 and not timed_out,
        timed_out=timed_out,
        stderr=stderr[-2000:],
    )


def apply_nft_file(netns: str, path: Path, *, timeout_s: float = 1800.0) -> ApplyResult:
    """Run ``nft -f path`` in ``netns`` (:func:`run_measured`)."""
    return run_measured(netns, ["nft", "-f", str(path)], timeout_s=timeout_s)


def _wait_for(
    process: subprocess.Popen[bytes], start: float, timeout_s: float
) -> tuple[float, int, bool]:
    deadline = start + timeout_s
    timed_out = False
    while True:
        pid, status = os.waitpid(process.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            timed_out = True
            pid, status = os.waitpid(process.pid, 0)
            break
        time.sleep(0.005)
    return time.perf_counter() - start, status, timed_out
