"""Upstream's nftables structure driven like our proxy: the same commands, ``nft`` doing it.

Run inside the namespace it programs (``ip netns exec NS python -m bench.upstreamproc
--services N ...``); speaks :mod:`bench.proxyproc`'s protocol, so a benchmark drives
either the same way:

* ``cold``: the first full sync's ``nft -f`` input (written to a file before the clock
  starts) applied with ``nft -f``; if the table already exists (a restart), upstream's
  restart sync instead: its listings (chains, sets, the six element containers) and the
  transaction of :func:`bench.upstream_structure.restart_ruleset`;
* ``endpoint`` / ``add`` / ``remove``: the listings of every sync (chains, sets), the
  stale-chain deletion when one is due, and the sync's transaction
  (:class:`bench.upstream_structure.UpstreamModel`), fed to ``nft -f -`` as knftables
  does.

Every ``nft`` is a process of its own, as upstream runs it, so the whole time is the
tool's: ``tool_s`` equals the sync time (upstream's own Go work is not modelled), and the
peak memory is nft's (``wait4``). What it does not model: upstream's computing of the
transaction (Go), its metrics and health updates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import toolclock
from bench.synthetic import SyntheticService, build_services, mixed_services, synthetic_service
from bench.upstream_structure import (
    LIST_EVERY_SYNC,
    LIST_FULL_SYNC,
    TABLE,
    UpstreamModel,
    list_argv,
    restart_ruleset,
    upstream_ruleset,
)

__all__ = ["UpstreamProcess", "main"]

_ADDED_INDEX_BASE = 100_000
_KB = 1024


class NftRunError(RuntimeError):
    """An ``nft`` run failed."""


class UpstreamProcess:
    """The state of upstream's table in this namespace and the nft runs that change it."""

    def __init__(
        self, services: Sequence[SyntheticService], workdir: Path, clock: toolclock.ToolClock
    ) -> None:
        self.services = list(services)
        self.workdir = workdir
        self.model = UpstreamModel(self.services)
        self.clock = clock
        self.cleanup_failures = 0
        self._affinity = self.services[0].affinity_seconds if self.services else 0
        self._width = len(self.services[0].endpoints) if self.services else 1
        self._added = 0

    def _nft(self, argv: list[str], stdin: str | None = None) -> str:
        """Run one nft (the tool clock times it and samples its memory); raise on failure."""
        process = subprocess.run(
            argv,
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        if process.returncode != 0:
            raise NftRunError(f"{' '.join(argv)}: {process.stderr.strip()[-2000:]}")
        return process.stdout

    def _table_exists(self) -> bool:
        result = subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, check=False
        )
        return f"table {TABLE}\n" in result.stdout + "\n"

    def _measured(self, work: Callable[[], None]) -> dict[str, Any]:
        mark, tools = self.clock.snapshot(), self.clock.by_tool()
        start = time.perf_counter()
        ok = True
        try:
            work()
        except NftRunError as err:
            print(err, file=sys.stderr, flush=True)
            ok = False
        seconds = time.perf_counter() - start
        return {
            "ok": ok,
            "seconds": seconds,
            **self.clock.since(mark),
            "tools": self.clock.by_tool(since=tools),
            "cleanup_failures": self.cleanup_failures,
        }

    def cold(self) -> dict[str, Any]:
        """A first full sync: cold into an empty namespace, or a restart over the table."""
        restart = self._table_exists()
        lines = restart_ruleset(self.services) if restart else upstream_ruleset(self.services)
        path = self.workdir / "sync.nft"
        with path.open("w") as out:
            for line in lines:
                out.write(line)
                out.write("\n")

        # The probe above is not upstream's work: its nft's memory does not count.
        self.clock.reset_peak()

        def work() -> None:
            if restart:
                for what in (*LIST_EVERY_SYNC, *LIST_FULL_SYNC):
                    self._nft(list_argv(what))
            self._nft(["nft", "-f", str(path)])

        result = self._measured(work)
        path.unlink()
        return {
            **result,
            "feed_s": 0.0,
            "sync_s": result["seconds"],
            "total_s": result["seconds"],
            "restart": restart,
            **_peaks(),
            "tool_peak_kb": self.clock.peak_kb,
        }

    def _sync(self, lines: list[str]) -> None:
        for what in LIST_EVERY_SYNC:
            self._nft(list_argv(what))
        now = time.monotonic()
        stale = self.model.stale_deletion(now)
        if stale:
            try:
                self._nft(["nft", "-f", "-"], "\n".join(stale) + "\n")
            except NftRunError as err:
                # As upstream: a failed stale-chain cleanup is logged and counted, and the
                # sync goes on (upstream also forces its next sync to be a full one, which
                # this model does not); the chains stay stale for a later attempt.
                print(f"stale-chain cleanup failed: {err}", file=sys.stderr, flush=True)
                self.cleanup_failures += 1
                self.model.restale(stale, now)
        if lines:
            self._nft(["nft", "-f", "-"], "\n".join(lines) + "\n")

    def change_endpoint(self) -> dict[str, Any]:
        """One endpoint of the next Service replaced, then a sync."""
        return self._measured(lambda: self._sync(self.model.change_endpoint(time.monotonic())))

    def add_service(self) -> dict[str, Any]:
        """One new Service, then a sync."""
        service = synthetic_service(
            _ADDED_INDEX_BASE + self._added, self._width, affinity_seconds=self._affinity
        )
        self._added += 1
        return self._measured(lambda: self._sync(self.model.add_service(service)))

    def remove_service(self) -> dict[str, Any]:
        """One original Service deleted, then a sync."""
        return self._measured(lambda: self._sync(self.model.remove_service(time.monotonic())))


def _peaks() -> dict[str, int]:
    # This driver is not upstream's proxy: its own memory says nothing, so none is given.
    return {"maxrss_self_kb": 0, "maxrss_children_kb": 0, "rss_now_kb": 0}


def _parse_extra(text: str) -> tuple[int, int]:
    index, _, count = text.partition(":")
    return int(index), int(count)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: build, report ready, answer commands until ``quit``."""
    parser = argparse.ArgumentParser(prog="python -m bench.upstreamproc")
    parser.add_argument("--netns", default=None, help="(informational: run inside it)")
    parser.add_argument("--backend", default="upstream", help="(ignored)")
    parser.add_argument("--services", type=int, required=True)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--affinity-seconds", type=int, default=0)
    parser.add_argument("--extra", action="append", default=[], help="INDEX:ENDPOINTS")
    parser.add_argument("--wide-every", type=int, default=0)
    parser.add_argument("--wide-endpoints", type=int, default=250)
    parser.add_argument("--node-ip", default=None, help="(ignored: the structure's default)")
    args = parser.parse_args(argv)
    if args.wide_every:
        services = mixed_services(
            args.services,
            args.endpoints,
            wide_every=args.wide_every,
            wide_endpoints=args.wide_endpoints,
            affinity_seconds=args.affinity_seconds,
        )
    else:
        services = build_services(
            args.services, args.endpoints, affinity_seconds=args.affinity_seconds
        )
    for index, count in map(_parse_extra, args.extra):
        services.append(synthetic_service(index, count, affinity_seconds=args.affinity_seconds))
    clock = toolclock.install()
    with tempfile.TemporaryDirectory(prefix="kpxb-upstream-") as workdir:
        upstream = UpstreamProcess(services, Path(workdir), clock)
        ops: dict[str, Callable[[], dict[str, Any]]] = {
            "cold": upstream.cold,
            "endpoint": upstream.change_endpoint,
            "add": upstream.add_service,
            "remove": upstream.remove_service,
            "rss": lambda: {**_peaks(), "tool_peak_kb": clock.peak_kb},
        }
        _emit({"event": "ready", **_peaks()})
        for line in sys.stdin:
            command = json.loads(line)
            op = command.get("op")
            if op == "quit":
                _emit({"event": "bye"})
                return 0
            handler = ops.get(op) if isinstance(op, str) else None
            if handler is None:
                _emit({"event": "error", "error": f"unknown op {op!r}"})
                continue
            _emit({"event": op, **handler()})
    return 0


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    sys.exit(main())
