"""How much of a sync the kernel tools take: libnftables calls and tool subprocesses.

:func:`install` (in the proxy child, before any backend is imported) wraps the two ways a
backend reaches the kernel:

* libnftables, called in-process through ctypes by the nftables backend: every
  ``nft_run_cmd_from_filename`` call (nft's parsing, the netlink exchange and the
  kernel's commit, all inside that C call) is timed;
* the batches of our own netlink socket, which skip libnftables
  (``kubeproxy.backends.nftables.batchsocket``: the element batches, and with the owned
  table every write of it): every exchange on that socket (the send of the already
  encoded batch, the kernel's commit, reading the acks) is timed as ``netlink``, the
  encoding before it is not;
* tool processes (``iptables-restore``, ``iptables-save``, ``iptables``, ``nft``...):
  :class:`subprocess.Popen` is replaced by a subclass that times each process from its
  start to the moment it is reaped, whatever wrapper (``subprocess.run``, ``check_output``)
  started it, since those look ``Popen`` up in the ``subprocess`` module at call time.

The peak memory of the tool processes is sampled: a thread per tool process reads its
``VmHWM`` (peak resident size) from ``/proc/PID/status`` every few milliseconds until it
exits, counting only once the process runs the tool (not the forked Python). The
children's ``ru_maxrss`` cannot serve: a child forked from a big process inherits that
process's peak at exec. Tool runs shorter than the sampling interval may be missed; they
are the small ones.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolClock", "install", "tool_name"]

_LIBNFTABLES = "libnftables"
_NETLINK = "netlink"
_SAMPLE_S = 0.005


def tool_name(argv: Any) -> str:
    """The program an argument list runs (past ``ip netns exec NS`` and ``chrt``)."""
    if isinstance(argv, str | bytes | os.PathLike):
        words: list[str] = [os.fsdecode(argv)]
    else:
        words = [os.fsdecode(word) for word in argv]
    while words:
        base = os.path.basename(words[0])
        if base == "ip" and words[1:3] == ["netns", "exec"]:
            words = words[4:]
        elif base in ("nsenter", "chrt", "env"):
            # Their own options: skip to the first word that looks like a program.
            rest = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            words = rest[1:] if base == "chrt" else rest
        else:
            return base
    return "?"


@dataclass
class ToolClock:
    """Time spent in kernel tools, per tool name; cumulative, read as deltas."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    peak_kb: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset_peak(self) -> None:
        """Forget the peaks seen so far (the next measurement's alone count)."""
        with self._lock:
            self.peak_kb = 0

    def saw_peak(self, kb: int) -> None:
        """A tool process reached ``kb`` kilobytes resident."""
        with self._lock:
            self.peak_kb = max(self.peak_kb, kb)

    def add(self, tool: str, seconds: float) -> None:
        """Count one call of ``tool`` that took ``seconds``."""
        with self._lock:
            self.seconds[tool] = self.seconds.get(tool, 0.0) + seconds
            self.calls[tool] = self.calls.get(tool, 0) + 1

    def snapshot(self) -> tuple[float, int]:
        """Total seconds and calls so far, all tools together."""
        with self._lock:
            return sum(self.seconds.values()), sum(self.calls.values())

    def since(self, mark: tuple[float, int]) -> dict[str, Any]:
        """``tool_s`` and ``tool_calls`` since ``mark`` (a :meth:`snapshot`)."""
        seconds, calls = self.snapshot()
        return {"tool_s": seconds - mark[0], "tool_calls": calls - mark[1]}

    def names(self) -> list[str]:
        """The tools seen so far."""
        with self._lock:
            return sorted(self.calls)

    def by_tool(self, since: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
        """``{tool: [seconds, calls]}`` so far, or since an earlier :meth:`by_tool`."""
        before = since or {}
        with self._lock:
            now = {name: [self.seconds[name], self.calls[name]] for name in sorted(self.calls)}
        delta = {}
        for name, (seconds, calls) in now.items():
            was = before.get(name, [0.0, 0])
            if calls > was[1]:
                delta[name] = [seconds - was[0], calls - was[1]]
        return delta


def _timed_popen_class(clock: ToolClock) -> type[subprocess.Popen[Any]]:
    base = subprocess.Popen

    class TimedPopen(base):  # type: ignore[valid-type,misc]
        """``subprocess.Popen`` that reports each process's lifetime to the clock."""

        def __init__(self, args: Any, *rest: Any, **options: Any) -> None:
            self._kpxb_tool = tool_name(args)
            self._kpxb_start = time.perf_counter()
            self._kpxb_counted = False
            super().__init__(args, *rest, **options)
            self._kpxb_sampler = threading.Thread(
                target=_sample_peak, args=(self, clock), daemon=True
            )
            self._kpxb_sampler.start()

        def _kpxb_done(self) -> None:
            if not self._kpxb_counted and self.returncode is not None:
                self._kpxb_counted = True
                clock.add(self._kpxb_tool, time.perf_counter() - self._kpxb_start)
                # Its last sample is in the clock before the caller reads the peak.
                self._kpxb_sampler.join(timeout=1.0)

        def wait(self, timeout: float | None = None) -> int:
            code: int = super().wait(timeout)
            self._kpxb_done()
            return code

        def poll(self) -> int | None:
            code: int | None = super().poll()
            self._kpxb_done()
            return code

    return TimedPopen


def _status_peak_kb(pid: int) -> int | None:
    """The process's VmHWM once it runs a tool (not Python, not yet exec'd); else None."""
    try:
        with open(f"/proc/{pid}/status") as status:
            text = status.read()
    except OSError:
        return None
    name, peak = "", None
    for line in text.splitlines():
        if line.startswith("Name:"):
            name = line.split()[1] if len(line.split()) > 1 else ""
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1])
            break
    if name.startswith("python"):
        return None
    return peak


def _sample_peak(process: subprocess.Popen[Any], clock: ToolClock) -> None:
    while process.returncode is None:
        peak = _status_peak_kb(process.pid)
        if peak is None and not os.path.exists(f"/proc/{process.pid}"):
            break
        if peak:
            clock.saw_peak(peak)
        time.sleep(_SAMPLE_S)


def _timed(clock: ToolClock, tool: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            clock.add(tool, time.perf_counter() - start)

    return timed


def install() -> ToolClock:
    """Start timing kernel tools in this process; returns the clock to read."""
    clock = ToolClock()
    subprocess.Popen = _timed_popen_class(clock)  # type: ignore[misc,assignment]
    try:
        nft_exec = importlib.import_module("kubeproxy.backends.nftables.exec")
    except ImportError:
        return clock
    # The executor binds its library once per path (a cached ``_Lib``); wrapping the
    # cached object's function times every call any executor makes. Private on purpose:
    # a benchmark probe, not an API.
    try:
        lib = nft_exec._load(nft_exec.LIBNFTABLES)
    except Exception:  # no libnftables here: the nftables backend fails on its own
        return clock
    lib.run_file = _timed(clock, _LIBNFTABLES, lib.run_file)
    try:
        batches = importlib.import_module("kubeproxy.backends.nftables.batchsocket")
    except ImportError:  # a checkout whose backend sends everything through nft
        return clock
    # Every batch of our own socket (elements; with the owned table, every write).
    socket_class = batches.BatchSocket
    socket_class.exchange = _timed(clock, _NETLINK, socket_class.exchange)
    return clock
