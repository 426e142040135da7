"""The soak's network: a node, a client and the endpoints, both families, never the host.

::

    client ns                     node ns (the daemon, the fake API server)     endpoint ns
    eth0 10.99.0.2-9          <-> kpxb-cli 10.99.0.1                             serve :8080,
         203.0.113.2 (a LB        203.0.113.1                                      hung :9090
         source range)            fd00:99::1
         fd00:99::2               kpxb-pod 10.99.1.1 (NODE_IP)    <-> eth0 10.99.1.2
                                  fd00:99:1::1 (NODE_IP6)             fd00:99:1::2
                                  kpxb-np (veth) 10.99.2.1 while       local 10.128.0.0/9,
                                  an address change is on              fd00:128::/56 on lo

The endpoint namespace owns both pod CIDRs as local addresses, so every endpoint of every
Service answers (with the address it was reached at) without a namespace per pod; the
client reaches cluster IPs, external and load-balancer IPs and NodePorts through the node,
whose rules are the ones under test. :func:`scratch` is a namespace with the node's
addresses (on an interface of its own) for the fresh sync a checkpoint compares with.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.harness import REPO, python_module
from bench.netns import in_netns, ip, namespace, namespaces, sysctl
from bench.synthetic import NODE_IP, NODE_IP6, POD_CIDR, POD_CIDR6

__all__ = [
    "CLIENT_SOURCES",
    "EXTRA_NODE_IP",
    "EXTRA_NODE_PORT_CIDR",
    "HUNG_PORT",
    "RANGE_SOURCE",
    "SERVE_PORT",
    "SoakNet",
    "node_addresses",
    "scratch",
    "soak_net",
]

SERVE_PORT = 8080
HUNG_PORT = 9090
CLIENT_SOURCES = tuple(f"10.99.0.{k}" for k in range(2, 10))
CLIENT_SOURCE6 = "fd00:99::2"
RANGE_SOURCE = "203.0.113.2"
"""A client address inside the realistic mix's loadBalancerSourceRanges."""
EXTRA_NODE_PORT_CIDR = "10.99.2.0/24"
"""Named in ``nodePortAddresses``: NodePorts are served on its addresses while one is up."""
EXTRA_NODE_IP = "10.99.2.1"
_DUMMY = "kpxb-np"


@dataclass(frozen=True, slots=True)
class SoakNet:
    """The three namespaces and the endpoint server's process."""

    node: str
    client: str
    endpoints: str
    server: subprocess.Popen[str]

    def run(self, netns: str, *argv: str, stdin: str | None = None, timeout: float = 60) -> str:
        """Run ``argv`` in ``netns``; its output (raises when it fails)."""
        done = subprocess.run(
            in_netns(netns, list(argv)),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {netns}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def extra_address(self, present: bool) -> None:
        """Add (or remove) :data:`EXTRA_NODE_IP` on the node: a host address change."""
        ip("-n", self.node, "addr", "add" if present else "del", f"{EXTRA_NODE_IP}/24",
           "dev", _DUMMY)  # fmt: skip


def _pair(node: str, other: str, name: str) -> None:
    ip("-n", node, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", other)
    ip("-n", node, "link", "set", name, "up")
    ip("-n", other, "link", "set", "eth0", "up")


def _spare_link(netns: str) -> None:
    """An interface of its own for addresses (a veth pair within ``netns``: this
    kernel has no ``dummy`` driver)."""
    ip("-n", netns, "link", "add", _DUMMY, "type", "veth", "peer", "name", f"{_DUMMY}-peer")
    ip("-n", netns, "link", "set", _DUMMY, "up")
    ip("-n", netns, "link", "set", f"{_DUMMY}-peer", "up")


def _address(netns: str, device: str, cidr: str) -> None:
    extra = ("nodad",) if ":" in cidr else ()
    ip("-n", netns, "addr", "add", cidr, "dev", device, *extra)


@contextmanager
def soak_net() -> Iterator[SoakNet]:
    """Build the namespaces (see the module), start the endpoint server; remove it all."""
    with namespaces("soaknode", "soakcli", "soakep") as (node, client, endpoints):
        for key, value in (
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ):
            sysctl(node, key, value)
        _pair(node, client, "kpxb-cli")
        for cidr in ("10.99.0.1/24", "203.0.113.1/24", "fd00:99::1/64"):
            _address(node, "kpxb-cli", cidr)
        for source in CLIENT_SOURCES:
            _address(client, "eth0", f"{source}/24")
        _address(client, "eth0", f"{RANGE_SOURCE}/24")
        _address(client, "eth0", f"{CLIENT_SOURCE6}/64")
        ip("-n", client, "route", "add", "default", "via", "10.99.0.1")
        ip("-n", client, "-6", "route", "add", "default", "via", "fd00:99::1")
        _pair(node, endpoints, "kpxb-pod")
        _address(node, "kpxb-pod", f"{NODE_IP}/24")
        _address(node, "kpxb-pod", f"{NODE_IP6}/64")
        _address(endpoints, "eth0", "10.99.1.2/24")
        _address(endpoints, "eth0", "fd00:99:1::2/64")
        ip("-n", endpoints, "route", "add", "default", "via", str(NODE_IP))
        ip("-n", endpoints, "-6", "route", "add", "default", "via", str(NODE_IP6))
        ip("-n", endpoints, "route", "add", "local", str(POD_CIDR), "dev", "lo")
        ip("-n", endpoints, "-6", "route", "add", "local", "fd00:128::/56", "dev", "lo")
        ip("-n", node, "route", "add", str(POD_CIDR), "via", "10.99.1.2")
        ip("-n", node, "-6", "route", "add", str(POD_CIDR6), "via", "fd00:99:1::2")
        _spare_link(node)
        server = subprocess.Popen(
            in_netns(
                endpoints,
                python_module(
                    "bench.soakprobe", "serve", "--port", str(SERVE_PORT),
                    "--hung-port", str(HUNG_PORT),
                ),
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "listening":
                raise RuntimeError("the endpoint server did not start")
            yield SoakNet(node, client, endpoints, server)
        finally:
            server.kill()
            server.wait()


def node_addresses(net: SoakNet) -> list[str]:
    """The node's global addresses (``ip/prefix``), as the daemon sees them."""
    listing = json.loads(net.run(net.node, "ip", "-j", "addr", "show"))
    return sorted(
        f"{a['local']}/{a['prefixlen']}"
        for link in listing
        if link.get("ifname") != "lo"
        for a in link.get("addr_info", ())
        if a.get("scope") == "global"
    )


@contextmanager
def scratch(addresses: list[str]) -> Iterator[str]:
    """A fresh namespace holding ``addresses`` (on an interface of its own), deleted after."""
    with namespace("soakref") as name:
        _spare_link(name)
        for cidr in addresses:
            _address(name, _DUMMY, cidr)
        yield name
