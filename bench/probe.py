"""Real TCP connections for the data-plane benchmark: a server and a timing client.

``python -m bench.probe serve --port P`` accepts and closes connections as fast as it can
(run it in the endpoint namespace). ``python -m bench.probe connect --target IP:PORT
--sources A,B,... --count N`` opens N connections one after another (run it in the client
namespace) and prints one JSON object: the connect() latency of each connection in
microseconds and the failures.

Why connect() time: it spans the SYN and the SYN-ACK, and only the first packet of a
connection walks the NAT chains (later packets follow conntrack), so the difference
between a Service and the bare endpoint is the per-connection cost of the rules. Each
connection binds a rotating source address and closes with SO_LINGER 0 (an RST, no
TIME_WAIT), and the loop pauses every few hundred connections: tight loops otherwise meet
port exhaustion and stale conntrack entries whose 3-6 ms retransmissions have nothing to
do with the rules.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from collections.abc import Sequence

__all__ = ["connect_latencies", "interleaved_latencies", "main", "serve"]

_LINGER_RST = struct.pack("ii", 1, 0)
# Bind the address only and let connect() pick the port: it then walks the ephemeral
# range per destination instead of reusing a just-freed port, so no 4-tuple comes back
# while the previous connection's last packets or conntrack entry may still be around.
_IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)


def serve(port: int, *, address: str = "0.0.0.0") -> None:
    """Accept connections on ``address:port`` forever, closing each at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(4096)
        print("listening", flush=True)
        while True:
            conn, _peer = listener.accept()
            conn.close()


def connect_latencies(
    target: tuple[str, int],
    sources: Sequence[str],
    count: int,
    *,
    warmup: int = 50,
    pause_every: int = 200,
    pause_s: float = 0.02,
    timeout_s: float = 2.0,
) -> tuple[list[float], int]:
    """Connect ``warmup + count`` times; the latencies (us) of the last ``count`` and failures."""
    latencies: list[float] = []
    failures = 0
    errors: dict[int, int] = {}
    for attempt in range(warmup + count):
        if attempt and attempt % pause_every == 0:
            time.sleep(pause_s)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
            sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
            sock.settimeout(timeout_s)
            sock.bind((sources[attempt % len(sources)], 0))
            start = time.perf_counter_ns()
            sock.connect(target)
            elapsed = time.perf_counter_ns() - start
        except OSError as error:
            failures += 1
            errors[error.errno or 0] = errors.get(error.errno or 0, 0) + 1
            continue
        finally:
            sock.close()
        if attempt >= warmup:
            latencies.append(elapsed / 1000.0)
    if errors:
        print(f"connect errors by errno: {errors}", file=sys.stderr)
    return latencies, failures


def interleaved_latencies(
    targets: dict[str, tuple[str, int]],
    sources: Sequence[str],
    count: int,
    *,
    rounds: int = 8,
    warmup: int = 20,
) -> dict[str, tuple[list[float], int]]:
    """``count`` connections per target, in ``rounds`` interleaved blocks.

    Alternating the targets in short blocks spreads any background load evenly over
    them, so their difference is the rules' and not the machine's.
    """
    results: dict[str, tuple[list[float], int]] = {name: ([], 0) for name in targets}
    block = max(1, count // rounds)
    for round_number in range(rounds):
        size = block if round_number < rounds - 1 else count - block * (rounds - 1)
        for name, target in targets.items():
            latencies, failures = connect_latencies(target, sources, size, warmup=warmup)
            previous, previous_failures = results[name]
            results[name] = (previous + latencies, previous_failures + failures)
    return results


def _target(text: str) -> tuple[str, tuple[str, int]]:
    name, _, address = text.partition("=")
    host, _, port = address.rpartition(":")
    return name, (host, int(port))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``serve`` or ``connect``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.probe")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve")
    serve_cmd.add_argument("--port", type=int, required=True)
    connect_cmd = sub.add_parser("connect")
    connect_cmd.add_argument(
        "--target", action="append", required=True, help="NAME=IP:PORT (repeatable)"
    )
    connect_cmd.add_argument("--sources", required=True, help="comma-separated source IPs")
    connect_cmd.add_argument("--count", type=int, default=2000, help="connections per target")
    connect_cmd.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port)
        return 0
    targets = dict(_target(t) for t in args.target)
    results = interleaved_latencies(
        targets, args.sources.split(","), args.count, rounds=args.rounds
    )
    json.dump(
        {name: {"latencies_us": lat, "failures": fail} for name, (lat, fail) in results.items()},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
