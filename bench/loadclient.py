"""A load client for the serving benchmarks: N concurrent clients, a new TCP connection
per HTTP request, for a fixed time; prints one JSON line of results.

Run in the namespace of the server (loopback or the node address only)::

    ip netns exec NS python -m bench.loadclient --host 127.0.0.1 --port 10256 \\
        --path /healthz --clients 200 --seconds 8

Each client loops: connect, send ``GET path`` with ``Connection: close``, read the whole
answer, close. A request fails when it is not answered in full within ``--timeout``
seconds (as a load balancer's probe with that timeout would) or the connection breaks;
an answer with another status than ``--expect`` counts apart. Latency is from the
connect call to the last byte, for answered requests. With several ``--port`` values
the requests go round the ports (one listener per Service). The run is bounded: no new
request starts after ``--seconds``, and none lasts beyond its timeout.

asyncio in one process: on this 2-core machine a client process per connection (or
threads) would take the cores the server needs; one event loop opens a few thousand
connections a second, more than the servers answer.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness import percentile

__all__ = ["LoadResult", "main", "run_load"]


@dataclass(slots=True)
class LoadResult:
    """What one load run saw."""

    clients: int
    seconds: float
    ok: int = 0
    failed: int = 0
    unexpected: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Counts, requests per second and latency percentiles (milliseconds)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 2)

        return {
            "clients": self.clients,
            "seconds": round(self.seconds, 3),
            "ok": self.ok,
            "failed": self.failed,
            "unexpected_status": self.unexpected,
            "requests_per_s": round(self.ok / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": ms(percentile(self.latencies, 0.50)),
            "p99_ms": ms(percentile(self.latencies, 0.99)),
            "max_ms": ms(max(self.latencies, default=None)),
            "errors": dict(sorted(self.errors.items())),
        }


async def _request(host: str, port: int, request: bytes) -> int:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        answer = await reader.read()  # to the end: the server closes after answering
    finally:
        writer.close()
    status_line = answer.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2:
        raise ConnectionError("no status line")
    return int(status_line[1])


async def _client(
    host: str,
    ports: Iterator[int],
    path: str,
    expect: int,
    timeout: float,
    deadline: float,
    result: LoadResult,
) -> None:
    while time.monotonic() < deadline:
        port = next(ports)
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        ).encode()
        started = time.monotonic()
        try:
            status = await asyncio.wait_for(_request(host, port, request), timeout)
        except (TimeoutError, OSError, ValueError) as err:
            result.failed += 1
            name = type(err).__name__
            result.errors[name] = result.errors.get(name, 0) + 1
            continue
        if status != expect:
            result.unexpected += 1
            continue
        result.ok += 1
        result.latencies.append(time.monotonic() - started)


async def run_load(
    host: str,
    ports: Sequence[int],
    path: str,
    *,
    clients: int,
    seconds: float,
    timeout: float = 3.0,
    expect: int = 200,
) -> LoadResult:
    """Run ``clients`` concurrent clients for ``seconds`` and collect what they saw."""
    result = LoadResult(clients, seconds)
    cycle = itertools.cycle(ports)
    started = time.monotonic()
    deadline = started + seconds
    await asyncio.gather(
        *(_client(host, cycle, path, expect, timeout, deadline, result) for _ in range(clients))
    )
    result.seconds = time.monotonic() - started
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run, print the summary as one JSON line."""
    parser = argparse.ArgumentParser(prog="bench.loadclient")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--path", default="/healthz")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--expect", type=int, default=200)
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 5000 or not 0 < args.seconds <= 120:
        parser.error("--clients 1..5000 and --seconds up to 120")
    result = asyncio.run(
        run_load(
            args.host,
            args.port,
            args.path,
            clients=args.clients,
            seconds=args.seconds,
            timeout=args.timeout,
            expect=args.expect,
        )
    )
    sys.stdout.write(json.dumps(result.summary()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
