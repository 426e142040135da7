"""``kubeproxy trace --live`` with real packets: a client connects through the node to
the echo Service, and every hop of its packets through our (owned) table is printed in
our names; the trace table is gone afterwards, also after Ctrl-C and ``kill -9``.

client (10.0.0.2) -- node (our table, owned by this process's backend) -- server
(10.180.0.10:8080): ``tests.kernelkit.client_node_server``, namespaces ``kplt-<pid>-*``
deleted whatever happens.
"""

from __future__ import annotations

import io
import ipaddress
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubeproxy.backend import SyncChanges
from kubeproxy.backends.nftables import create_backend
from kubeproxy.backends.nftables.livetrace import TRACE_TABLE
from kubeproxy.backends.nftables.owner import probe_table_flags
from kubeproxy.cmd.kubeproxy import live_trace
from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPFamily
from kubeproxy.testing.runner import default_timeout
from tests.kernelkit import (
    ECHO_SERVER_IP,
    ECHO_VIP,
    Topology,
    client_node_server,
    echo_snapshot,
    run_in,
)

pytestmark = pytest.mark.kernel

PREFIX = "kplt"
SCRIPT = str(Path(sys.executable).parent / "kubeproxy")


@pytest.fixture(scope="module")
def topo() -> Iterator[Topology]:
    with client_node_server(PREFIX) as topology:
        backend = create_backend(
            IPFamily.IPV4, ProxierConfig(node_name=f"{PREFIX}-node"), netns=topology.node
        )
        backend.sync(echo_snapshot(PREFIX, 3), SyncChanges(full=True))
        try:
            yield topology
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def _connect(topo: Topology, count: int = 1) -> list[bytes]:
    """``count`` connections from the client to the echo Service, each echoing once."""

    def talk() -> list[bytes]:
        replies = []
        for _ in range(count):
            with socket.create_connection((ECHO_VIP, 80), timeout=5) as sock:
                sock.sendall(b"ping")
                replies.append(sock.recv(16))
        return replies

    return topo.in_namespace(topo.client, talk)


def _tables(topo: Topology) -> str:
    return run_in(topo.node, "nft", "list", "tables")


def _wait_for_trace_table(topo: Topology, present: bool) -> None:
    deadline = time.monotonic() + 10 * default_timeout()
    while (TRACE_TABLE in _tables(topo)) != present:
        assert time.monotonic() < deadline, f"trace table present={not present}: {_tables(topo)}"
        time.sleep(0.05)


def test_live_trace_prints_each_hop_of_real_packets_in_our_names(topo: Topology) -> None:
    owner, persist = probe_table_flags(topo.node)
    if owner and persist:
        # The proxy (this process's backend) owns its table: no one else may write there.
        assert "flags owner" in run_in(topo.node, "nft", "list", "table", "ip", "kube-proxy")
    out = io.StringIO()
    seen: list[int] = []
    vip, client = ipaddress.ip_address(ECHO_VIP), ipaddress.ip_address("10.0.0.2")

    def trace() -> None:
        seconds = 20 * default_timeout()
        seen.append(
            live_trace(vip, 80, "tcp", client, out, netns=topo.node, seconds=seconds, packets=1)
        )

    tracer = threading.Thread(target=trace)
    tracer.start()
    try:
        _wait_for_trace_table(topo, present=True)
        assert _connect(topo) == [b"ping"]  # tracing changes no verdict
    finally:
        tracer.join()
    assert seen == [1]
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"tracing packets to {ECHO_VIP}:80/tcp from 10.0.0.2")
    assert lines[1].startswith("#1 10.0.0.2:"), lines
    assert lines[1].endswith(f" -> {ECHO_VIP}:80/tcp arrives"), lines
    hops = "\n".join(lines[2:])
    # The first packet (the SYN), as it arrives, then through dispatch, class and pick.
    assert "#1 nat-prerouting rule" in hops and "[10.0.0.2:" in hops
    assert f"{ECHO_VIP} . tcp . 80 is {PREFIX}/echo:tcp" in hops, hops
    assert "(class: cluster IP: 1 endpoint(s)" in hops, hops
    assert "picks a slot at random" in hops and "DNAT): accept" in hops, hops
    # After the DNAT the same packet is seen going to the endpoint.
    assert f"-> {ECHO_SERVER_IP}:8080/tcp]" in hops, hops
    # Only the first packet, only our table's hops (and none of the trace table's).
    assert all(line.startswith("#1 ") for line in lines[1:]), hops
    assert TRACE_TABLE not in hops
    assert TRACE_TABLE not in _tables(topo)


_SIGNALS = {"interrupt": signal.SIGINT, "terminate": signal.SIGTERM, "kill": signal.SIGKILL}


@pytest.mark.parametrize("how", sorted(_SIGNALS))
def test_the_trace_table_goes_when_the_tracer_is_stopped(topo: Topology, how: str) -> None:
    tracer = subprocess.Popen(
        [SCRIPT, "--netns", topo.node, "trace", "--live", "--to", f"{ECHO_VIP}:80/tcp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background inherits SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _wait_for_trace_table(topo, present=True)
        assert _connect(topo, 2) == [b"ping", b"ping"]
        assert tracer.stdout is not None
        printed: list[str] = []
        while not any(line.startswith("#2 ") for line in printed):
            line = tracer.stdout.readline()  # each hop's line is flushed as it comes
            assert line, f"the tracer ended: {printed}"
            printed.append(line)
        tracer.send_signal(_SIGNALS[how])
        rest, stderr = tracer.communicate(timeout=30 * default_timeout())
        stdout = "".join(printed) + rest
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()
    # Ctrl-C, SIGTERM: deleted by the tracer; kill -9: by the kernel (its socket's table).
    _wait_for_trace_table(topo, present=False)
    assert "kube-proxy" in _tables(topo)
    if how != "kill":
        assert tracer.returncode == 0, stderr
        assert stdout.endswith("stopped; the trace table is removed\n"), stdout
