"""The out-of-tree example proxy (``examples/nft_clusterip``): its packets, and its daemon.

The flow-case kit proves its backend with real packets (``examples/nft_clusterip/
flows.yaml``, both families). Then the program itself runs as a node's daemon, in a node
namespace, against the fake API server listening in that namespace: the ClusterIP
reaches both endpoints, ``/healthz``, ``/metrics`` and ``/proxyMode`` answer as
upstream's do, the ``Starting`` Event reaches the API server under the proxy's own name,
an endpoint change on the server reaches the rules, and SIGTERM stops it with exit
status 0 and the rules left in place. The example imports nothing of
``kubeproxy.backends`` or ``kubeproxy.cmd``.
"""

from __future__ import annotations

import ast
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubeproxy.objects import Protocol
from kubeproxy.testing.fakeapi import FakeAPIServer, endpoint_slice, node, service
from kubeproxy.testing.netns import entered
from kubeproxy.testing.pytest import flow_test
from kubeproxy.testing.runner import default_timeout
from kubeproxy.testing.traffic import ListenerServer, make_listener
from tests.kernelkit import NodeAndPod, answered_by, node_and_pod, run_in

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "nft_clusterip"
SCRIPT = EXAMPLE / "nft_clusterip.py"
# The example is its own package, outside ours: its folder goes on the path.
sys.path.append(str(EXAMPLE))

NODE = "kpxo-node"
NODE_IP = "192.168.70.2"
EP1, EP2 = "10.244.0.21", "10.244.0.22"
HEALTHZ, METRICS = 10256, 10249

pytestmark = pytest.mark.kernel

test_example_flows = flow_test(
    [EXAMPLE / "flows.yaml"], backend="nft_clusterip:ClusterIPBackend", marks=[pytest.mark.kernel]
)


def test_the_example_is_a_library_user_only() -> None:
    tree = ast.parse(SCRIPT.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {name for name in imported if name and name.startswith("kubeproxy")}
    assert ours == {"kubeproxy"}, "only the public names of kubeproxy"


# --- the daemon ---------------------------------------------------------------------------


@pytest.fixture
def namespaces() -> Iterator[NodeAndPod]:
    with node_and_pod("kpxo", NODE_IP, (EP1, EP2)) as pair:
        yield pair


@pytest.fixture
def fake(namespaces: NodeAndPod) -> Iterator[FakeAPIServer]:
    """The fake API server on 127.0.0.1 of the node namespace (where the proxy runs)."""
    server = FakeAPIServer(bookmark_interval=0.2)
    with entered(namespaces.node_fd):
        server.start()
    try:
        yield server
    finally:
        server.stop()


def http_get(netns_fd: int, port: int, path: str) -> tuple[int, str]:
    """GET ``path`` from 127.0.0.1:``port`` in the namespace; (status, body); (0, why)."""
    try:
        with entered(netns_fd):
            sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        with sock:
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError as err:
        return 0, str(err)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    # Waits grow with the flow kit's timeout scale: under CPU emulation (make
    # test-kernels) starting the daemon takes tens of seconds.
    timeout *= default_timeout()
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def answers(netns_fd: int, attempts: int = 64) -> set[str | None]:
    # Each connection picks one of two endpoints at random: 64 miss one with a chance of
    # 2**-63 (20 missed one once in 500,000 runs).
    return {answered_by(netns_fd, "172.30.0.10") for _ in range(attempts)}


def slice_with(*addresses: str) -> dict[str, object]:
    return endpoint_slice("web-1", "web", addresses=addresses, node_name=NODE)


def test_the_example_runs_as_a_node_daemon(
    namespaces: NodeAndPod, fake: FakeAPIServer, tmp_path: Path
) -> None:
    fake.apply(node(NODE, addresses=[NODE_IP]))
    fake.apply(service("web", cluster_ip="172.30.0.10"))
    fake.apply(slice_with(EP1, EP2))
    listeners = ListenerServer("kpxo-listeners")
    for ip in (EP1, EP2):
        address = ipaddress.ip_address(ip)
        listeners.add(make_listener(namespaces.pod_fd, address, 8080, Protocol.TCP))
    listeners.start()
    config = tmp_path / "config.yaml"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"
        "kind: KubeProxyConfiguration\n"
        f"hostnameOverride: {NODE}\n"
        "clientConnection: {contentType: application/json}\n"
        "clusterCIDR: 10.244.0.0/16\n"
        f"healthzBindAddress: 127.0.0.1:{HEALTHZ}\n"
        f"metricsBindAddress: 127.0.0.1:{METRICS}\n"
        # 0: leave nf_conntrack_max (a host-wide setting) as it is.
        "conntrack: {maxPerCore: 0}\n"
    )
    command = ["ip", "netns", "exec", namespaces.node, sys.executable, str(SCRIPT)]
    command += ["--config", str(config), "--master", fake.url]
    log = tmp_path / "proxy.log"
    with log.open("w") as out:  # a file, not a pipe nobody reads while it runs
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        wait_for(lambda: http_get(namespaces.node_fd, HEALTHZ, "/healthz")[0] == 200, "/healthz")
        # One connection at a time until the rules are there (each try without them waits
        # for its timeout), then both endpoints must answer.
        wait_for(lambda: answered_by(namespaces.node_fd, "172.30.0.10") is not None, "rules")
        assert answers(namespaces.node_fd) == {f"{EP1}:8080", f"{EP2}:8080"}

        code, body = http_get(namespaces.node_fd, HEALTHZ, "/healthz")
        assert code == 200, body
        health = json.loads(body)
        assert health["healthy"] is True and health["nodeEligible"] is True
        # The rules are in the kernel a moment before the sync that wrote them is counted.
        synced = 'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} '
        wait_for(lambda: synced in http_get(namespaces.node_fd, METRICS, "/metrics")[1], synced)
        code, metrics = http_get(namespaces.node_fd, METRICS, "/metrics")
        assert code == 200
        assert 'kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family="IPv4"} ' in (
            metrics
        )
        assert "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{" not in metrics
        assert http_get(namespaces.node_fd, METRICS, "/proxyMode") == (200, "nftables")
        wait_for(lambda: bool(fake.posted_events), "the Starting event")
        starting = [e for e in fake.posted_events if e["reason"] == "Starting"]
        assert len(starting) == 1
        assert starting[0]["reportingController"] == "nft-clusterip-proxy"
        assert starting[0]["regarding"]["name"] == NODE

        # A change on the server reaches the rules.
        fake.apply(slice_with(EP2))
        wait_for(lambda: answers(namespaces.node_fd) == {f"{EP2}:8080"}, "the new endpoints")

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15 * default_timeout()) == 0, log.read_text()
        output = log.read_text()
        assert "nft-clusterip-proxy started for node kpxo-node" in output
        assert "nft-clusterip-proxy stopped; the rules stay in place" in output
        table = run_in(namespaces.node, "nft", "list", "table", "ip", "nft-clusterip")
        assert "172.30.0.10 tcp dport 80" in table
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        listeners.close()
