"""The shared affinity chains of ``bench/affinity_canonical.py`` keep upstream's meaning
with real connections.

Issue 32 item 3's study measures, beside the chains per port that ports with more
addresses than their cluster IP keep today, shared chains that turn a load-balancer
address into the port's cluster IP before reading or writing the entry (and put the
packet back after). This checks, on every kernel the matrix boots, that the kernel
accepts them and that they mean what upstream means: one entry per Service port and
client whichever address the client came through (keyed by the cluster-IP frontend, as
the ports on their cluster IP only are), its timeout counted again from each new
connection, and a connection whose entry the kernel refuses (its map full) still served,
its packet put back as it was.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from bench.affinity_canonical import one_port_table
from kubeproxy.testing.runner import default_timeout
from tests import kernelkit
from tests.kernelkit import NodeAndPod, node_and_pod_serving, run_in

pytestmark = pytest.mark.kernel

NODE_IP = "192.168.71.3"
EP1, EP2 = "10.244.0.41", "10.244.0.42"
CLUSTER_IP, LB_IP = "172.30.0.10", "172.30.5.10"
NODE_PORT = 30080
CLIENT = "10.244.0.1"  # the node's address towards the pods: its connections' source


@pytest.fixture
def namespaces() -> Iterator[NodeAndPod]:
    with node_and_pod_serving("kpxk", NODE_IP, (EP1, EP2)) as pair:
        yield pair


def answered_by(netns_fd: int, address: str, port: int = 80) -> str | None:
    """The endpoint that answered a connection from the node, from :data:`CLIENT`
    whichever address it goes to (to its own NodePort the node would pick the node IP:
    another client)."""
    return kernelkit.answered_by(netns_fd, address, port, source=CLIENT)


def entries(netns: str) -> list[tuple[str, str, float]]:
    """(key, endpoint, seconds left) of every entry of the affinity map."""
    listing = run_in(netns, "nft", "list", "map", "ip", "t", "affinity-frontends-0")
    found = []
    pattern = r"([\d.]+ \. tcp \. 80 \. [\d.]+)(?: timeout \S+)? expires (\S+) : ([\d.]+ \. \d+)"
    for key, expires, endpoint in re.findall(pattern, listing):
        found.append((key, endpoint.replace(" . ", ":"), _seconds(expires)))
    return found


def _seconds(text: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+)(ms|h|m|s|d)", text):
        total += int(number) * {"d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def load(netns: str, *, size: int | None = None) -> None:
    table = one_port_table(CLUSTER_IP, LB_IP, NODE_PORT, (EP1, EP2), size=size)
    run_in(netns, "nft", "-f", "-", stdin=table)


def test_one_entry_across_addresses(namespaces: NodeAndPod) -> None:
    load(namespaces.node)
    fd = namespaces.node_fd
    first = answered_by(fd, LB_IP)
    assert first in (f"{EP1}:8080", f"{EP2}:8080")
    # The entry is the cluster IP's, written through the load-balancer address.
    ((key, endpoint, _left),) = entries(namespaces.node)
    assert (key, endpoint) == (f"{CLUSTER_IP} . tcp . 80 . {CLIENT}", first)
    for _ in range(6):
        assert answered_by(fd, CLUSTER_IP) == first
        assert answered_by(fd, LB_IP) == first
        assert answered_by(fd, NODE_IP, NODE_PORT) == first
    assert len(entries(namespaces.node)) == 1

    # Through the cluster IP first: the other addresses read that entry.
    run_in(namespaces.node, "nft", "flush", "map", "ip", "t", "affinity-frontends-0")
    second = answered_by(fd, CLUSTER_IP)
    assert second is not None
    for _ in range(6):
        assert answered_by(fd, LB_IP) == second
        assert answered_by(fd, NODE_IP, NODE_PORT) == second

    # Through the NodePort first: written as the cluster IP's entry.
    run_in(namespaces.node, "nft", "flush", "map", "ip", "t", "affinity-frontends-0")
    third = answered_by(fd, NODE_IP, NODE_PORT)
    ((key, endpoint, _left),) = entries(namespaces.node)
    assert (key, endpoint) == (f"{CLUSTER_IP} . tcp . 80 . {CLIENT}", third)
    for _ in range(6):
        assert answered_by(fd, CLUSTER_IP) == third
        assert answered_by(fd, LB_IP) == third

    # Each new connection counts the timeout again, through either address. Without
    # that, the entry has lost the whole pause by the second listing; with it, only the
    # time from the connection to the listing, which must stay below the slack (a
    # connection and an nft run: milliseconds, but a loaded machine can stall a second).
    slack = 2.0 * default_timeout()
    before = entries(namespaces.node)[0][2]
    time.sleep(slack + 1.0)
    assert answered_by(fd, NODE_IP, NODE_PORT) == third
    assert entries(namespaces.node)[0][2] > before - slack


def test_refused_entry_still_served(namespaces: NodeAndPod) -> None:
    """A full map refuses the entry: the connection is served all the same (its packet put
    back after the refused update, or it would go to the cluster IP, which no one holds)."""
    load(namespaces.node, size=1)
    run_in(
        namespaces.node,
        "nft",
        "add element ip t affinity-frontends-0"
        " { 172.30.9.9 . tcp . 80 . 10.9.9.9 : 10.9.9.9 . 80 }",
    )
    for _ in range(6):
        for address, port in ((LB_IP, 80), (NODE_IP, NODE_PORT)):
            answer = answered_by(namespaces.node_fd, address, port)
            assert answer in (f"{EP1}:8080", f"{EP2}:8080")
    assert [key for key, _ep, _left in entries(namespaces.node)] == [
        "172.30.9.9 . tcp . 80 . 10.9.9.9"
    ]
