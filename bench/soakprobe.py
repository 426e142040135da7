"""The soak's real connections: the endpoints' servers and the clients (``bench.soak``).

Run inside the soak's namespaces (``ip netns exec NS python -m bench.soakprobe ...``):

* ``serve --port P --hung-port H`` (the endpoint namespace, which owns the pod CIDRs of
  both families as local addresses): on ``P`` answer every connection with the address
  it reached (the endpoint a Service picked) and close; on ``H`` accept and never read
  nor close (a hung backend). Prints ``listening`` once both listen.
* ``connect`` (the client namespace, or the node's for localhost NodePorts): reads a JSON
  list of targets ``{"id", "ip", "port", "source"}`` on stdin, opens one connection to
  each (many at once, a 1.5 s timeout each) and prints a JSON object: id -> the address
  that answered, or ``"!"`` plus the error.
* ``affinity --source S --target ID=IP:PORT ...``: connects to each target in turn,
  forever, from source ``S``, printing ``time id answer`` per connection (the session
  affinity clients: a pinned client must meet the same endpoint every time).
* ``hold --target IP:PORT --count N``: opens ``N`` connections, sends a request on each
  and closes it (the client is done, the hung backend never is), prints ``held``.
* ``flood --count N``: ``N`` short connections, each to another address of
  ``10.200.0.0/14`` (inside the pod CIDR, so through the node) on the server's port; each
  leaves a ``TIME_WAIT`` entry in the node's connection tracking (assured: the kernel
  cannot drop it early for a new connection), which is how a busy node's table fills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import selectors
import socket
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "normal"]

_TIMEOUT = 1.5


def normal(address: str) -> str:
    """An address as the server saw it, IPv4-mapped IPv6 back to IPv4."""
    return address[7:] if address.startswith("::ffff:") else address


def _listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))  # every address of the namespace's local routes, both families
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def serve(port: int, hung_port: int) -> None:
    """Answer on ``port`` with the address reached; hold every connection on ``hung_port``."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    answer, hung = _listener(port), _listener(hung_port)
    held: list[socket.socket] = []
    selector = selectors.DefaultSelector()
    selector.register(answer, selectors.EVENT_READ, "answer")
    selector.register(hung, selectors.EVENT_READ, "hung")
    print("listening", flush=True)
    while True:
        for key, _ in selector.select():
            listener = answer if key.data == "answer" else hung
            for _ in range(256):
                try:
                    conn, _peer = listener.accept()
                except (BlockingIOError, ConnectionAbortedError):
                    break
                except OSError:
                    time.sleep(0.05)  # out of descriptors: a moment, then on
                    break
                if key.data == "hung":
                    held.append(conn)  # never read, never closed
                    continue
                try:
                    conn.setblocking(False)
                    conn.send((normal(conn.getsockname()[0]) + "\n").encode())
                except OSError:
                    pass
                conn.close()


async def _one(target: dict[str, object], gate: asyncio.Semaphore) -> tuple[str, str]:
    ip, port, source = str(target["ip"]), int(str(target["port"])), target.get("source")
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    async with gate:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if source:
                sock.bind((str(source), 0))
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), _TIMEOUT)
            data = await asyncio.wait_for(loop.sock_recv(sock, 128), _TIMEOUT)
            answer = data.decode().strip() or "!closed"
        except TimeoutError:
            answer = "!timeout"
        except OSError as err:
            answer = f"!{err.strerror or err}"
        finally:
            sock.close()
    return str(target["id"]), normal(answer)


async def _connect_all(targets: list[dict[str, object]]) -> dict[str, str]:
    gate = asyncio.Semaphore(256)
    results = await asyncio.gather(*(_one(t, gate) for t in targets))
    return dict(results)


def affinity(source: str, targets: Sequence[tuple[str, str, int]], pause: float) -> None:
    """Connect to each target in turn until killed; one line per connection."""
    while True:
        for name, ip, port in targets:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(_TIMEOUT)
                try:
                    sock.bind((source, 0))
                    sock.connect((ip, port))
                    answer = normal(sock.recv(128).decode().strip()) or "!closed"
                except OSError as err:
                    answer = f"!{err.strerror or err}"
            print(f"{time.time():.3f} {name} {answer}", flush=True)
            time.sleep(pause)


def hold(ip: str, port: int, count: int) -> None:
    """Open ``count`` connections, send a request on each, close each (see the module)."""
    done = 0
    for _ in range(count):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(_TIMEOUT)
        try:
            sock.connect((ip, port))
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            done += 1
        except OSError:
            pass
        finally:
            sock.close()
    print(json.dumps({"held": done}), flush=True)


async def _flood(count: int, port: int) -> dict[str, int]:
    base = int.from_bytes(socket.inet_aton("10.200.0.0"), "big")
    gate = asyncio.Semaphore(256)
    done = {"sent": 0, "failed": 0}

    async def one(k: int) -> None:
        address = socket.inet_ntoa((base + k % (1 << 18)).to_bytes(4, "big"))
        async with gate:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, port), _TIMEOUT
                )
                await asyncio.wait_for(reader.read(128), _TIMEOUT)
                writer.close()
                done["sent"] += 1
            except (OSError, TimeoutError):
                done["failed"] += 1

    await asyncio.gather(*(one(k) for k in range(count)))
    return done


def _target(text: str) -> tuple[str, str, int]:
    name, _, address = text.partition("=")
    host, _, port = address.rpartition(":")
    return name, host.strip("[]"), int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module)."""
    parser = argparse.ArgumentParser(prog="python -m bench.soakprobe")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd = sub.add_parser("serve")
    serve_cmd.add_argument("--port", type=int, required=True)
    serve_cmd.add_argument("--hung-port", type=int, required=True)
    sub.add_parser("connect")
    affinity_cmd = sub.add_parser("affinity")
    affinity_cmd.add_argument("--source", required=True)
    affinity_cmd.add_argument("--target", action="append", required=True)
    affinity_cmd.add_argument("--pause", type=float, default=0.05)
    hold_cmd = sub.add_parser("hold")
    hold_cmd.add_argument("--target", required=True)
    hold_cmd.add_argument("--count", type=int, required=True)
    flood_cmd = sub.add_parser("flood")
    flood_cmd.add_argument("--count", type=int, required=True)
    flood_cmd.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port, args.hung_port)
    elif args.command == "connect":
        targets = json.load(sys.stdin)
        json.dump(asyncio.run(_connect_all(targets)), sys.stdout)
    elif args.command == "flood":
        json.dump(asyncio.run(_flood(args.count, args.port)), sys.stdout)
    elif args.command == "affinity":
        affinity(args.source, [_target(t) for t in args.target], args.pause)
    else:
        _, host, port = _target("x=" + args.target)
        hold(host, port, args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
