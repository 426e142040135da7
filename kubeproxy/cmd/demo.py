"""``make run``: program a throw-away network namespace from the example cluster and show traffic.

Builds a tiny node in network namespaces (a node with a pod bridge, three pods, an outside
client), runs ``kube-proxy-nftables --manifests examples/cluster --once`` inside the node
namespace, then sends real connections through the ClusterIP, the NodePort and the UDP
Service, and removes everything it made. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

__all__ = ["main"]

PREFIX = "kpxd-"
NODE = PREFIX + "node"
CLIENT = PREFIX + "client"
PODS = {
    PREFIX + "pod1": "10.244.0.11",
    PREFIX + "pod2": "10.244.0.12",
    PREFIX + "pod3": "10.244.0.13",
}
NODE_IP = "192.168.50.2"
CLIENT_IP = "192.168.50.100"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def _netns_exec(ns: str, *argv: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], check=False, text=True, capture_output=capture
    )


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, text=True, capture_output=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _teardown() -> None:
    for ns in _namespaces():
        if ns.startswith(PREFIX):
            subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True)
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], check=False, text=True, capture_output=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], check=False)


def _build() -> None:
    for ns in [NODE, CLIENT, *PODS]:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
    _netns_exec(NODE, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    _ip("-n", NODE, "link", "add", "kpxd-br", "type", "bridge")
    _ip("-n", NODE, "addr", "add", "10.244.0.1/24", "dev", "kpxd-br")
    _ip("-n", NODE, "link", "set", "kpxd-br", "up")
    # Pods talking to a Service whose endpoint sits on the same bridge need the bridge to
    # hand frames to netfilter (per namespace), as on a real node with br_netfilter.
    _netns_exec(NODE, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
    for i, (ns, ip) in enumerate(PODS.items(), start=1):
        veth = f"kpxd-veth{i}"
        _ip("-n", NODE, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", NODE, "link", "set", veth, "master", "kpxd-br", "up")
        _ip("-n", NODE, "link", "set", veth, "type", "bridge_slave", "hairpin", "on")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", "10.244.0.1")
    _ip(
        "-n",
        NODE,
        "link",
        "add",
        "kpxd-ext",
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        CLIENT,
    )
    _ip("-n", NODE, "addr", "add", f"{NODE_IP}/24", "dev", "kpxd-ext")
    _ip("-n", NODE, "link", "set", "kpxd-ext", "up")
    _ip("-n", CLIENT, "addr", "add", f"{CLIENT_IP}/24", "dev", "eth0")
    _ip("-n", CLIENT, "link", "set", "eth0", "up")
    _ip("-n", CLIENT, "route", "add", "default", "via", NODE_IP)


def _start_servers() -> list[subprocess.Popen[bytes]]:
    procs = []
    for ns, ip in PODS.items():
        mode = "udp" if ip.endswith(".13") else "http"
        port = "5353" if mode == "udp" else "8080"
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "kubeproxy.cmd.demo",
                    f"serve-{mode}",
                    ns.removeprefix(PREFIX),
                    ip,
                    port,
                ],
            )
        )
    time.sleep(0.7)
    return procs


def _serve_http(name: str, ip: str, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello from {name} ({ip}); you are {self.client_address[0]}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    HTTPServer((ip, port), Handler).serve_forever()


def _serve_udp(name: str, ip: str, port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((ip, port))
    while True:
        _, peer = sock.recvfrom(2048)
        sock.sendto(f"dns answer from {name} ({ip}); you are {peer[0]}\n".encode(), peer)


def _udp_query(ns: str, ip: str, port: int) -> str:
    code = (
        "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.settimeout(2);"
        f"s.sendto(b'q',('{ip}',{port}));print(s.recv(2048).decode(),end='')"
    )
    return _netns_exec(ns, sys.executable, "-c", code, capture=True).stdout


def _curl(ns: str, url: str) -> str:
    result = _netns_exec(ns, "curl", "-s", "--max-time", "3", url, capture=True)
    return result.stdout if result.returncode == 0 else f"(curl failed: exit {result.returncode})\n"


def _live_trace(tool: str) -> bool:
    """``kubeproxy trace --live`` on the node while the client opens one connection."""
    command = [tool, "trace", "--live", "--to", "172.30.0.10:80/tcp", "--count", "1"]
    print(f"\n$ ip netns exec {NODE} {' '.join(command)}   # while the client connects")
    tracer = subprocess.Popen(
        ["ip", "netns", "exec", NODE, *command, "--seconds", "20"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert tracer.stdout is not None
    first = tracer.stdout.readline()  # printed once the trace table is in place
    print(first, end="")
    _curl(CLIENT, "http://172.30.0.10/")
    rest, _ = tracer.communicate(timeout=30)
    print(rest, end="")
    return tracer.returncode == 0


def _proxy_binary() -> str:
    found = shutil.which("kube-proxy-nftables")
    if found is None:
        raise SystemExit("kube-proxy-nftables is not installed (run `make setup`)")
    return found


def run_demo(manifests: Path) -> int:
    """Build the scene, program it with kube-proxy-nftables, show traffic, clean up."""
    if os.geteuid() != 0:
        print("make run needs root (it creates network namespaces)", file=sys.stderr)
        return 1
    _teardown()
    procs: list[subprocess.Popen[bytes]] = []
    ok = True
    try:
        _build()
        procs = _start_servers()
        binary = _proxy_binary()
        argv = [
            binary,
            "--manifests",
            str(manifests),
            "--hostname-override",
            "demo-node",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--service-cluster-ip-range",
            "172.30.0.0/16",
            "--once",
        ]
        print(f"$ ip netns exec {NODE} {' '.join(argv[0:1] + argv[1:])}", flush=True)
        if _netns_exec(NODE, *argv).returncode != 0:
            print("kube-proxy-nftables failed", file=sys.stderr)
            return 1
        # What the kernel now holds, in Service terms (kubeproxy explain and verify read
        # the kernel, not the proxy, which has exited).
        tool = str(Path(binary).parent / "kubeproxy")
        flags = argv[3:-1]  # the proxy's own flags, but --manifests and --once
        for command in (
            [tool, "explain", "demo/web"],
            [tool, "explain", "demo/shop", "--family", "ipv4"],
            [tool, "explain", "172.30.0.53:53/udp"],
            [tool, "verify", "--manifests", str(manifests), "--", *flags],
        ):
            print(f"\n$ ip netns exec {NODE} {' '.join(command)}")
            shown = _netns_exec(NODE, *command, capture=True)
            print(shown.stdout, end="")
            ok &= shown.returncode == 0
        ok &= _live_trace(tool)
        print("\nReal connections from an outside client through the rules:")
        for url in ["http://172.30.0.10/"] * 4 + [f"http://{NODE_IP}:30080/"]:
            reply = _curl(CLIENT, url)
            ok &= reply.startswith("hello")
            print(f"  GET {url:<28} -> {reply}", end="")
        pod_reply = _curl(next(iter(PODS)), "http://172.30.0.10/")
        ok &= pod_reply.startswith("hello")
        print(f"  GET from pod1 to the ClusterIP   -> {pod_reply}", end="")
        dns = _udp_query(CLIENT, "172.30.0.53", 53)
        ok &= dns.startswith("dns answer")
        print(f"  UDP 172.30.0.53:53               -> {dns or '(no answer)'}")
        print(f"\n$ ip netns exec {NODE} {binary} --cleanup")
        _netns_exec(NODE, binary, "--cleanup")
        left = _netns_exec(NODE, "nft", "list", "tables", capture=True).stdout.strip()
        print(f"  tables left in the node namespace: {left or '(none)'}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        _teardown()
    print("\ndemo " + ("succeeded" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kubeproxy.cmd.demo MANIFESTS`` (or an internal ``serve-*`` helper)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("serve-http", "serve-udp"):
        name, ip, port = args[1], args[2], int(args[3])
        (_serve_http if args[0] == "serve-http" else _serve_udp)(name, ip, port)
        return 0
    manifests = Path(args[0]) if args else Path("examples/cluster")
    return run_demo(manifests)


if __name__ == "__main__":
    sys.exit(main())
