"""A node's months, compressed into tens of minutes: the soak (issue 31).

    make soak                                   # 2000 Services, 22 rounds: 45-90 minutes
    make soak SOAK_ARGS="--services 500 --rounds 11"
    python -m bench.soak --short                # the short version `make test` runs

As root, in namespaces of its own (``kpxb-soak*``, :mod:`bench.soaknet`; never the
host's). ``kube-proxy-nftables``, the binary a node runs (both families, localhost
NodePorts on, NodePorts on the node's link, ``10.99.2.0/24`` and ``localhost``), is fed
by the fake API server (in the node's namespace) holding the bench's realistic mix
(:mod:`bench.soakcluster`), changed all along: endpoints, Services added and removed,
slices relabelled, policies and affinity flipped, about ``--rate`` changes a second;
session affinity clients connect to a few ClientIP Services throughout. Round after round
one fault is injected (``--faults``, in turn; ``--rounds``, by default every fault twice;
each round lasts ``--round-seconds`` at least; ``--minutes`` starts no round after):

``none``, ``kill9`` (SIGKILL, restart), ``kill9-mid-sync`` (a Node change starts a full
sync, the daemon runs in 20 ms slices and gets SIGKILL as soon as the kernel holds part
of the new generation, before the switch; restart),
``sigterm`` (stop, restart), ``flush-ruleset`` (``nft flush ruleset`` in the node's
namespace), ``delete-table`` (``nft delete table ip kube-proxy``, ``ip6`` the next time;
an owned table, issue 29, is neither flushed nor deleted by another process: the round
records that the kernel kept it),
``api-restart`` (the API server down for 3 s), ``api-410`` (its history compacted and
every watch expired: relists), ``address-change`` (an address in ``nodePortAddresses``
appears or goes on the node, and the Node's zone changes), ``hung-backends`` (600
clients of a localhost NodePort whose backends never answer nor close; the other
localhost NodePorts must stay served, and every connection must be gone in about two
minutes), ``conntrack-full`` (the node's connection-tracking table filled for 15 s).

After a restart the cluster stays quiet until the checkpoint (no change, so no sync:
what the restart left must go by itself). At the end of every round, churn paused, a
checkpoint: the kernel's tables must mean
what a fresh ``--once`` run writes for the same API state in a namespace of its own
(:mod:`bench.soakstate`: frontends and their classes, endpoint sets, firewall, affinity
and every other set, the rules a packet can reach; no leftover generation), within
``--settle`` seconds; every frontend must answer real connections from the client
namespace, by an endpoint it may use, or not answer if it must not (a sample of the
localhost NodePorts from the node itself too); and the daemon's file descriptors,
threads and resident memory and the kernel's objects are sampled, their slopes reported
(per daemon lifetime; kernel objects over the run). Writes ``bench/results/<date>-soak-
<host>.json`` and ``bench/results/soak.md`` (``--results DIR`` elsewhere) and exits 1
when a checkpoint failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.daemonbench import HEALTHZ_PORT, METRICS_PORT, NodeProcess, stop_process
from bench.harness import REPO, python_module
from bench.netns import clean_up_on_sigterm, in_netns
from bench.report import machine_info
from bench.soakcluster import (
    HUNG_NODE_PORT,
    SoakCluster,
    Target,
    expectations,
    localhost_targets,
    node_object,
)
from bench.soaknet import (
    CLIENT_SOURCES,
    EXTRA_NODE_PORT_CIDR,
    SoakNet,
    node_addresses,
    scratch,
    soak_net,
)
from bench.soakstate import TableState, compare, counts, table_state
from bench.synthetic import (
    NODE_IP,
    NODE_IP6,
    POD_CIDR,
    POD_CIDR6,
    SERVICE_CIDR,
    SERVICE_CIDR6,
)
from bench.wholeproc import binary_path, settings_flags
from kubeproxy.backends.nftables.exec import LibNftables
from kubeproxy.backends.nftables.layout import generation_of
from kubeproxy.backends.nftables.objects import Family, NftError
from kubeproxy.host.netns import run_in_netns
from kubeproxy.testing.fakeapi import FakeAPIServer

__all__ = ["FAULTS", "RESTARTS", "SHORT_FAULTS", "affinity_verdict", "main", "slopes"]

FAULTS = (
    "none",
    "flush-ruleset",
    "delete-table",
    "api-restart",
    "api-410",
    "address-change",
    "hung-backends",
    "conntrack-full",
    "kill9",
    "kill9-mid-sync",
    "sigterm",
)
"""Every fault, in the order of a cycle: the ones the daemon survives in place first, so
one lifetime of the daemon spans most of a cycle (its resource slopes need that)."""
SHORT_FAULTS = ("none", "kill9-mid-sync", "flush-ruleset", "api-410", "sigterm")
RESTARTS = frozenset({"kill9", "kill9-mid-sync", "sigterm"})
"""Faults after which the cluster stays quiet until the checkpoint: what a restart leaves
must go without a sync to do it (issue 31's old generations)."""
"""The short version's faults (``--short``, what ``make test`` runs)."""
_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
_STALE = "kubeproxy_sync_proxy_rules_nftables_stale_objects"
_LOCALHOST_CONNECTIONS = "kubeproxy_nftables_localhost_nodeport_connections"
_LISTENERS = "kubeproxy_nftables_localhost_nodeport_listeners"
_FULL = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
_HUNG_CLIENTS = 600
_SLICE = 0.02
"""Seconds the daemon runs at a time while a kill in the middle of its full sync is due."""


def daemon_flags() -> list[str]:
    """The node's settings (both families, localhost NodePorts, an extra NodePort CIDR)."""
    return [
        *settings_flags(
            cluster_cidr=f"{POD_CIDR},{POD_CIDR6}",
            service_range=f"{SERVICE_CIDR},{SERVICE_CIDR6}",
            node_port_addresses=f"{NODE_IP}/24,{EXTRA_NODE_PORT_CIDR},{NODE_IP6}/64,localhost",
        ),
        "--feature-gates",
        "KubeProxyNFTablesLocalhostNodePorts=true",
    ]


# --- the daemon -----------------------------------------------------------------------------


class Daemon:
    """``kube-proxy-nftables`` in the node's namespace, started again and again."""

    def __init__(
        self, net: SoakNet, api_port: int, log: Path, heap_watch: HeapWatch | None = None
    ) -> None:
        self.net = net
        self.heap_watch = heap_watch
        self.argv = [
            str(binary_path()),
            "--master",
            f"http://127.0.0.1:{api_port}",
            *daemon_flags(),
            "--healthz-bind-address",
            f"0.0.0.0:{HEALTHZ_PORT}",
            "--metrics-bind-address",
            f"127.0.0.1:{METRICS_PORT}",
        ]
        self.log = log
        self.node: NodeProcess | None = None
        self.lifetime = 0

    def start(self) -> float:
        """Start it; seconds until its first full sync."""
        with self.log.open("a") as out:
            out.write(f"=== start {self.lifetime + 1} at {datetime.now(UTC).isoformat()}\n")
            out.flush()
            process = subprocess.Popen(
                in_netns(self.net.node, self.argv),
                stdout=subprocess.DEVNULL,
                stderr=out,
                cwd=REPO,
                start_new_session=True,
                env=self.heap_watch.env(self.lifetime + 1) if self.heap_watch else None,
            )
        self.lifetime += 1
        self.node = NodeProcess(self.net.node, process, time.perf_counter(), self.log)
        return self.node.wait_for(
            lambda: self.metric(_FULL) >= 1, "the first full sync", timeout=300
        )

    @property
    def pid(self) -> int:
        assert self.node is not None
        return self.node.pid

    def metric(self, name: str) -> float:
        """The sum of one metric's samples now."""
        assert self.node is not None
        return sum(v for (n, _), v in self.node.metrics().items() if n == name)

    def stop(self, how: int) -> float:
        """Send ``how`` (SIGTERM or SIGKILL); seconds until it exited."""
        assert self.node is not None
        return stop_process(self.node.process, how, timeout=60)

    def resources(self) -> dict[str, float]:
        """Its file descriptors (all, and those beyond the localhost NodePort listeners:
        one per NodePort with endpoints, so they follow the cluster), threads and
        resident memory (MB)."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        fds = float(len(os.listdir(f"/proc/{self.pid}/fd")))
        listeners = self.metric(_LISTENERS)
        found = {
            "fds": fds,
            "listeners": listeners,
            "fds_other": fds - listeners,
            "threads": float(fields["Threads"].strip()),
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        }
        if self.heap_watch is not None:
            found.update(self.heap_watch.latest(self.lifetime))
        return found


_HEAP_WATCH = REPO / "bench" / "heapwatch"
_HEAP_FIGURES = ("malloc_in_use_mb", "malloc_free_mb", "traced_mb")


@dataclass(frozen=True)
class HeapWatch:
    """``--heap-watch``: the daemon imports ``bench/heapwatch/sitecustomize.py``, which
    writes its heap's figures to a file every few seconds; a checkpoint reads the last.
    With ``frames`` > 0 the daemon runs with ``tracemalloc`` (slower, more memory)."""

    work: Path
    frames: int = 0
    every: float = 5.0

    def path(self, lifetime: int) -> Path:
        return self.work / f"heap-{lifetime}.jsonl"

    def env(self, lifetime: int) -> dict[str, str]:
        """The daemon's environment: ours, the watch on."""
        path = os.environ.get("PYTHONPATH")
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(_HEAP_WATCH), *([path] if path else [])]),
            "KPXB_HEAPWATCH": str(self.path(lifetime)),
            "KPXB_HEAPWATCH_FRAMES": str(self.frames),
            "KPXB_HEAPWATCH_EVERY": str(self.every),
        }

    def latest(self, lifetime: int) -> dict[str, float]:
        """The last line's heap figures (none before the first)."""
        try:
            lines = self.path(lifetime).read_text().splitlines()
        except FileNotFoundError:
            return {}
        if not lines:
            return {}
        line = json.loads(lines[-1])
        found = {key: float(line[key]) for key in _HEAP_FIGURES if key in line}
        found["pymalloc_blocks_k"] = line["pymalloc_blocks"] / 1000
        return found


class API:
    """The fake API server, listening on the node namespace's loopback."""

    def __init__(self, net: SoakNet) -> None:
        self.net = net
        self.fake = FakeAPIServer(bookmark_interval=30.0)

    def start(self) -> int:
        run_in_netns(self.net.node, self.fake.start)
        return self.fake.port

    def stop(self) -> None:
        self.fake.stop()


class Churn:
    """The cluster's changes, ``rate`` a second, in a thread; paused at checkpoints."""

    def __init__(self, cluster: SoakCluster, rate: float) -> None:
        self.cluster = cluster
        self.rate = rate
        self.running = threading.Event()
        self.idle = threading.Event()
        self.stop = threading.Event()
        self.changes = 0
        self.thread = threading.Thread(target=self._run, name="soak-churn", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.running.is_set():
                self.idle.set()
                self.running.wait(0.2)
                continue
            self.idle.clear()
            self.cluster.change()
            self.changes += 1
            self.stop.wait(1.0 / self.rate)

    def pause(self) -> None:
        self.running.clear()
        self.idle.wait(5)

    def resume(self) -> None:
        self.running.set()


class AffinityClients:
    """Clients of the pinned ClientIP Services: every answer of a pinned Service must
    come from the endpoint the first one came from (until a fault removes the rules,
    affinity maps included: ``flush-ruleset``, ``delete-table``)."""

    def __init__(self, net: SoakNet, cluster: SoakCluster) -> None:
        self.targets = {f"pin-{s.index}": str(s.cluster_ip) for s in cluster.pinned}
        argv = ["affinity", "--source", CLIENT_SOURCES[-1]]
        for name, address in self.targets.items():
            argv += ["--target", f"{name}={address}:80"]
        self.process = subprocess.Popen(
            in_netns(net.client, python_module("bench.soakprobe", *argv)),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.answers: list[tuple[float, str, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            moment, name, answer = line.rstrip("\n").split(" ", 2)
            self.answers.append((float(moment), name, answer))

    def close(self) -> None:
        self.process.kill()
        self.process.wait()

    def verdict(self, resets: Sequence[float]) -> dict[str, Any]:
        """:func:`affinity_verdict` of every answer so far."""
        return {"services": len(self.targets), **affinity_verdict(list(self.answers), resets)}


def affinity_verdict(
    answers: Sequence[tuple[float, str, str]], resets: Sequence[float]
) -> dict[str, Any]:
    """Connections (time, Service, answer), the failed ones, and the answers from
    another endpoint than the Service's pin (its first answer since the last reset of
    the rules at one of ``resets``, unix times)."""
    pinned: dict[str, str] = {}
    pinned_at: dict[str, float] = {}
    moved: list[str] = []
    failed = 0
    marks = sorted(resets)
    for moment, name, answer in answers:
        if answer.startswith("!"):
            failed += 1
            continue
        reset = max((r for r in marks if r <= moment), default=0.0)
        if pinned_at.get(name) != reset:
            pinned_at[name], pinned[name] = reset, answer  # a new pin after a wipe
        elif pinned[name] != answer:
            moved.append(f"{name}: {pinned[name]} -> {answer} at {moment:.1f}")
            pinned[name] = answer
    return {
        "connections": len(answers),
        "failed": failed,
        "moved": len(moved),
        "moved_examples": moved[:5],
    }


# --- checkpoints ------------------------------------------------------------------------------


def tables(net: SoakNet, netns: str) -> list[TableState]:
    """Both families' tables of ``netns``, reduced (:func:`bench.soakstate.table_state`)."""
    states = []
    for family, table in _TABLES:
        try:
            listing = json.loads(net.run(netns, "nft", "-j", "list", "table", family, table))
        except RuntimeError:
            listing = {}
        states.append(table_state(listing))
    return states


def reference(net: SoakNet, fake: FakeAPIServer, work: Path) -> tuple[list[TableState], float]:
    """What a fresh ``--once`` run writes for the API's objects now, in a namespace with
    the node's addresses; and how long that run took."""
    manifests = work / "reference"
    manifests.mkdir(exist_ok=True)
    for kind in ("Service", "EndpointSlice", "Node"):
        items = fake.objects(kind)
        document = {"apiVersion": "v1", "kind": "List", "items": items}
        (manifests / f"{kind.lower()}.json").write_text(json.dumps(document))
    argv = [str(binary_path()), "--manifests", str(manifests), "--once", *daemon_flags()]
    with scratch(node_addresses(net)) as name:
        started = time.monotonic()
        done = subprocess.run(
            in_netns(name, argv), capture_output=True, text=True, timeout=600, check=False
        )
        took = time.monotonic() - started
        if done.returncode != 0:
            raise RuntimeError(f"the reference run failed: {done.stderr[-1500:]}")
        return tables(net, name), took


def connections(net: SoakNet, netns: str, targets: Sequence[Target]) -> dict[str, Any]:
    """Try every target from ``netns``; what answered as it must and what did not."""
    probe = [t.probe() for t in targets]
    answered = json.loads(
        net.run(netns, *python_module("bench.soakprobe", "connect"), stdin=json.dumps(probe),
                timeout=300)
    )  # fmt: skip
    wrong: list[str] = []
    ok = 0
    for target in targets:
        answer = answered.get(target.id, "!missing")
        good = answer in target.endpoints if target.endpoints else answer.startswith("!")
        if good:
            ok += 1
        else:
            wanted = "no answer" if not target.endpoints else f"one of {len(target.endpoints)}"
            wrong.append(f"{target.id} ({target.source}): {answer}, wanted {wanted}")
    return {
        "targets": len(targets),
        "ok": ok,
        "answering": sum(1 for t in targets if t.endpoints),
        "wrong": len(wrong),
        "wrong_examples": wrong[:10],
    }


@dataclass
class Checkpoint:
    """What one round ends with."""

    round: int
    fault: str
    fault_details: dict[str, Any]
    lifetime: int
    elapsed_s: float
    services: int
    changes: int
    converged_s: float | None
    differences: list[str]
    reference_s: float
    connections: dict[str, Any]
    localhost: dict[str, Any]
    resources: dict[str, float]
    kernel: dict[str, int]
    kernel_fresh: dict[str, int]
    stale_objects: float
    first_differences: int
    ok: bool = False


@dataclass
class Soak:
    """One run's state (see the module)."""

    net: SoakNet
    api: API
    cluster: SoakCluster
    daemon: Daemon
    churn: Churn
    work: Path
    settle: float
    started: float = field(default_factory=time.monotonic)
    resets: list[float] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    delete_family: int = 0
    zone: int = 0
    extra_address: bool = False
    nft: LibNftables = field(init=False)

    def __post_init__(self) -> None:
        self.nft = LibNftables(netns=self.net.node)

    # Faults ------------------------------------------------------------------------------

    def fault(self, name: str) -> dict[str, Any]:
        handler: Callable[[], dict[str, Any]] = getattr(self, "_" + name.replace("-", "_"))
        return handler()

    def _none(self) -> dict[str, Any]:
        return {}

    def _kill9(self) -> dict[str, Any]:
        self.daemon.stop(signal.SIGKILL)
        return {"first_sync_s": round(self.daemon.start(), 2)}

    def _kill9_mid_sync(self) -> dict[str, Any]:
        """A Node change makes the daemon write a new generation; the daemon is killed
        once one of its sets is in the kernel and before the switch (checked: the fixed
        chains still read the old one). A full sync of a small cluster takes less than a
        listing of the kernel here, so the daemon runs in slices of :data:`_SLICE` seconds
        (SIGSTOP, SIGCONT) and the kernel is looked at between them. Tried again (a kill
        and a restart each time) until a kill lands there."""
        held: list[int] = []
        process = self.daemon.node.process if self.daemon.node is not None else None
        assert process is not None
        for attempt in range(1, 6):
            self._wait_one_generation()
            live = self._live_generation() or 0
            process.send_signal(signal.SIGSTOP)
            self._zone_change()  # a full sync: a new generation is written
            seen = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not seen:
                process.send_signal(signal.SIGCONT)
                time.sleep(_SLICE)
                process.send_signal(signal.SIGSTOP)
                seen = live + 1 in self._generations()
            switched = self._live_generation() != live
            self.daemon.stop(signal.SIGKILL)
            held = sorted(self._generations())
            first_sync = self.daemon.start()
            process = self.daemon.node.process if self.daemon.node is not None else process
            if seen and not switched:
                return {
                    "attempts": attempt,
                    "generations_at_kill": held,
                    "first_sync_s": round(first_sync, 2),
                }
        return {"attempts": 5, "caught": False, "generations_at_kill": held}

    def _wait_one_generation(self, bound: float = 15.0) -> None:
        """Wait (at most ``bound`` seconds) until the live generation is the only one: what
        an earlier attempt's kill left is deleted a second after the restarted daemon's
        switch, and a new attempt stopping the daemon sooner would keep it."""
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline and len(self._generations()) > 1:
            time.sleep(0.2)

    def _live_generation(self) -> int | None:
        """The generation the fixed chains read (table ``ip kube-proxy``'s ``services``)."""
        try:
            listing = self.net.run(
                self.net.node, "nft", "-j", "list", "chain", "ip", "kube-proxy", "services"
            )
        except RuntimeError:
            return None
        found = {int(g) for g in re.findall(r"\.g([0-9]+)", listing)}
        return max(found) if found else None

    def _sigterm(self) -> dict[str, Any]:
        exited = self.daemon.stop(signal.SIGTERM)
        return {"exit_s": round(exited, 2), "first_sync_s": round(self.daemon.start(), 2)}

    def _kept_tables(self) -> list[str]:
        """Our tables still in the node's namespace."""
        return [
            f"{family} {name}"
            for family, name in _TABLES
            if self.nft.table_exists(Family(family), name)
        ]

    def _flush_ruleset(self) -> dict[str, Any]:
        # An owned table (issue 29: owner flag, on kernels that have it) is not another
        # process's to flush: the kernel skips it, and nothing is wiped.
        self.net.run(self.net.node, "nft", "flush", "ruleset")
        kept = self._kept_tables()
        if not kept:
            self.resets.append(time.time())
        return {"tables_kept": kept}

    def _delete_table(self) -> dict[str, Any]:
        family = ("ip", "ip6")[self.delete_family % 2]
        self.delete_family += 1
        try:
            self.net.run(self.net.node, "nft", "delete", "table", family, "kube-proxy")
        except RuntimeError as err:
            # An owned table: the kernel refuses another process (EPERM); it must stay.
            if "Operation not permitted" not in str(err):
                raise
            return {
                "family": family,
                "refused": True,
                "kept": f"{family} kube-proxy" in self._kept_tables(),
            }
        self.resets.append(time.time())
        return {"family": family}

    def _api_restart(self) -> dict[str, Any]:
        self.api.stop()
        time.sleep(3)
        self.api.start()
        return {"down_s": 3}

    def _api_410(self) -> dict[str, Any]:
        revision = self.api.fake.compact()
        return {"compacted_at": revision, "watches_expired": self.api.fake.expire_watches()}

    def _address_change(self) -> dict[str, Any]:
        self.extra_address = not self.extra_address
        self.net.extra_address(self.extra_address)
        self._zone_change()
        return {"extra_address": self.extra_address}

    def _zone_change(self) -> None:
        self.zone += 1
        self.api.fake.apply(node_object(f"zone-{'ab'[self.zone % 2]}"))

    def _hung_backends(self) -> dict[str, Any]:
        before = self.daemon.resources()["fds"]
        hold = subprocess.Popen(
            in_netns(
                self.net.node,
                python_module("bench.soakprobe", "hold", "--target",
                              f"127.0.0.1:{HUNG_NODE_PORT}", "--count", str(_HUNG_CLIENTS)),
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        out, _ = hold.communicate(timeout=600)
        held = json.loads(out.strip().splitlines()[-1])["held"]
        peak_fds = self.daemon.resources()["fds"]
        proxied = self.daemon.metric(_LOCALHOST_CONNECTIONS)
        others = connections(self.net, self.net.node, self._localhost_sample())
        started = time.monotonic()
        drained = None
        while time.monotonic() - started < 200:
            if self.daemon.metric(_LOCALHOST_CONNECTIONS) == 0:
                drained = time.monotonic() - started
                break
            time.sleep(2)
        return {
            "clients": held,
            "proxied_at_once": proxied,
            "fds_before": before,
            "fds_peak": peak_fds,
            "others_while_stuck": others,
            "drained_s": None if drained is None else round(drained, 1),
            "fds_after": self.daemon.resources()["fds"],
        }

    def _conntrack_full(self) -> dict[str, Any]:
        node, client, endpoints = self.net.node, self.net.client, self.net.endpoints
        limit = int(self.net.run(node, "cat", "/proc/sys/net/netfilter/nf_conntrack_max"))
        notrack = "table inet kpxb-notrack {\n chain c {\n type filter hook %s priority raw\n"
        notrack += " notrack\n }\n}\n"
        self.net.run(client, "nft", "-f", "-", stdin=notrack % "output")
        self.net.run(endpoints, "nft", "-f", "-", stdin=notrack % "prerouting")
        time_wait = "net.netfilter.nf_conntrack_tcp_timeout_time_wait"
        self.net.run(node, "sysctl", "-qw", f"{time_wait}=600")
        try:
            flood = self.net.run(
                client, *python_module("bench.soakprobe", "flood", "--count",
                                       str(limit + 5000)), timeout=900,
            )  # fmt: skip
            count = int(self.net.run(node, "cat", "/proc/sys/net/netfilter/nf_conntrack_count"))
            while_full = connections(self.net, client, self._targets()[:50])
            time.sleep(15)
            alive = self.daemon.node is not None and self.daemon.node.process.poll() is None
        finally:
            self.net.run(node, "sysctl", "-qw", f"{time_wait}=120")
            self.net.run(node, "conntrack", "-F")
            self.net.run(client, "nft", "delete", "table", "inet", "kpxb-notrack")
            self.net.run(endpoints, "nft", "delete", "table", "inet", "kpxb-notrack")
        return {
            "max": limit,
            "entries": count,
            "flood": json.loads(flood),
            "new_connections_while_full": while_full,
            "daemon_alive": alive,
        }

    # Helpers --------------------------------------------------------------------------------

    def _generations(self) -> set[int]:
        """The generations table ``ip kube-proxy`` holds sets of (a terse listing)."""
        try:
            names = self.nft.list_sets(Family.IP, "kube-proxy")
        except NftError:
            return set()
        return {g for n in names if (g := generation_of(n)) is not None}

    def _targets(self) -> list[Target]:
        services = self.api.fake.objects("Service")
        slices = self.api.fake.objects("EndpointSlice")
        return expectations(services, slices, extra_node_ip=self.extra_address)

    def _localhost_sample(self) -> list[Target]:
        services = self.api.fake.objects("Service")
        slices = self.api.fake.objects("EndpointSlice")
        return localhost_targets(services, slices, 20)

    # Checkpoints ------------------------------------------------------------------------------

    def checkpoint(self, number: int, fault: str, details: dict[str, Any]) -> Checkpoint:
        self.churn.pause()
        try:
            fresh, took = reference(self.net, self.api.fake, self.work)
            started = time.monotonic()
            converged: float | None = None
            differences: list[str] = []
            first: int | None = None
            while True:
                live = tables(self.net, self.net.node)
                differences = [
                    f"{family}: {d}"
                    for (family, _), ours, theirs in zip(_TABLES, live, fresh, strict=True)
                    for d in compare(ours, theirs)
                ]
                if first is None:
                    first = len(differences)
                if not differences:
                    converged = time.monotonic() - started
                    break
                if time.monotonic() - started > self.settle:
                    break
                time.sleep(1.0)
            targets = self._targets()
            reached = connections(self.net, self.net.client, targets)
            local = connections(self.net, self.net.node, self._localhost_sample())
            kernel = dict(counts(live))
            record = Checkpoint(
                round=number,
                fault=fault,
                fault_details=details,
                lifetime=self.daemon.lifetime,
                elapsed_s=round(time.monotonic() - self.started, 1),
                services=len(self.cluster.services),
                changes=self.churn.changes,
                converged_s=None if converged is None else round(converged, 2),
                differences=differences[:12],
                reference_s=round(took, 2),
                connections=reached,
                localhost=local,
                resources=self.daemon.resources(),
                kernel=kernel,
                kernel_fresh=dict(counts(fresh)),
                stale_objects=self.daemon.metric(_STALE),
                first_differences=first or 0,
            )
            record.ok = converged is not None and reached["wrong"] == 0 and local["wrong"] == 0
            self.checkpoints.append(record)
            return record
        finally:
            self.churn.resume()


# --- slopes and the report ------------------------------------------------------------------


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, value) points, per hour; None under 3 points."""
    if len(points) < 3:
        return None
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return None
    return 3600 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


_FLAT = {"fds_other": 4.0, "threads": 1.0, "rss_mb": 16.0}
"""How much a resource may grow over one daemon lifetime (the fitted line, first to last
checkpoint) and still count as flat (or 5 % of its level, if that is more). RSS is judged
over the second half of the lifetime (:func:`_second_half`)."""
_HEAP_FLAT = {"malloc_in_use_mb": 8.0, "pymalloc_blocks_k": 50.0, "traced_mb": 8.0}
"""The same for the live heap (``--heap-watch``), judged over the whole lifetime: what the
process holds, not what its allocators keep."""


def _second_half(points: Sequence[tuple[float, float]]) -> Sequence[tuple[float, float]]:
    """The checkpoints from the middle of a lifetime on (all of them under 6).

    A lifetime's RSS rises while the allocators reach their high water: glibc malloc's
    arenas keep what a relist or a full resync once needed, free but not handed back, and
    each kind of fault needs its own peak the first time it comes. Measured
    (``bench/results/soak-rss.md``): the steps come with no growth of the heap in use,
    and ``malloc_trim(0)`` gives them back. So the first half's steps say little; a rise
    that goes on is judged against the heap in use (:func:`_memory_verdict`).
    """
    return points[len(points) // 2 :] if len(points) >= 6 else points


def _series(points: Sequence[tuple[float, float]], allowance: float) -> dict[str, Any]:
    per_hour = slope_per_hour(points)
    level = statistics.fmean(v for _, v in points) if points else 0.0
    span = points[-1][0] - points[0][0] if points else 0.0
    growth = None if per_hour is None else per_hour * span / 3600
    return {
        "first": round(points[0][1], 3) if points else None,
        "last": round(points[-1][1], 3) if points else None,
        "slope_per_hour": None if per_hour is None else round(per_hour, 3),
        "growth": None if growth is None else round(growth, 3),
        # What a long run must not do is grow: a fall (the kernel's objects coming down
        # to a fresh sync's after the first rounds' leftovers went) is not a leak.
        "flat": growth is not None and growth <= max(allowance, 0.05 * level),
    }


def slopes(checkpoints: Sequence[Checkpoint]) -> dict[str, Any]:
    """Per daemon lifetime of 3+ checkpoints: each resource's slope (per hour) and its
    growth over the lifetime, flat within :data:`_FLAT`; over the run, the kernel's
    objects against what a fresh sync of the same state holds (1.0: nothing more)."""
    lifetimes: dict[int, list[Checkpoint]] = {}
    for point in checkpoints:
        lifetimes.setdefault(point.lifetime, []).append(point)
    found: dict[str, Any] = {"lifetimes": []}
    for lifetime, points in sorted(lifetimes.items()):
        if len(points) < 3:
            continue
        entry: dict[str, Any] = {
            "lifetime": lifetime,
            "checkpoints": len(points),
            "span_s": round(points[-1].elapsed_s - points[0].elapsed_s, 1),
        }
        for resource, allowance in _FLAT.items():
            series = [(p.elapsed_s, p.resources[resource]) for p in points]
            entry[resource] = _series(series, allowance)
        rss = [(p.elapsed_s, p.resources["rss_mb"]) for p in points]
        entry["rss_mb_second_half"] = _series(_second_half(rss), _FLAT["rss_mb"])
        for resource, allowance in _HEAP_FLAT.items():
            if all(resource in p.resources for p in points):
                series = [(p.elapsed_s, p.resources[resource]) for p in points]
                entry[resource] = _series(series, allowance)
        entry["memory"] = _memory_verdict(entry)
        found["lifetimes"].append(entry)
    for key in ("chains", "sets", "elements"):
        series = [
            (p.elapsed_s, p.kernel.get(key, 0) / max(1, p.kernel_fresh.get(key, 0)))
            for p in checkpoints
        ]
        found[f"kernel_{key}_vs_fresh"] = _series(series, 0.0)
    return found


def _memory_verdict(entry: dict[str, Any]) -> str:
    """``flat`` (RSS over the second half of the lifetime, and the live heap if watched),
    ``high water`` (RSS still rising there, the heap in use flat: the allocators keep
    what they once needed) or ``NOT flat``."""
    heap = [entry[name]["flat"] for name in _HEAP_FLAT if name in entry]
    if heap and not all(heap):
        return "NOT flat"
    if entry["rss_mb_second_half"]["flat"]:
        return "flat"
    return "high water (the heap in use flat)" if heap else "NOT flat"


def _flat(item: dict[str, Any]) -> str:
    return "flat" if item["flat"] else "NOT flat"


def _heap_cell(resources: dict[str, float]) -> str:
    if "malloc_in_use_mb" not in resources:
        return "-"
    return (
        f"{resources['malloc_in_use_mb']:.0f} ({resources['malloc_free_mb']:.0f}), "
        f"{resources['pymalloc_blocks_k']:.0f}"
    )


def render(run: dict[str, Any]) -> str:
    """The run as ``soak.md``."""
    heap = any("pymalloc_blocks_k" in p["resources"] for p in run["checkpoints"])
    lines = [
        "# Soak (latest run)",
        "",
        f"{run['when']}, commit {run['commit']}, `{run['command']}`, "
        f"{run['machine']['nproc']} cores (shared with other work), kernel "
        f"{run['machine']['kernel']}. {run['services']} Services of the realistic mix "
        f"through the fake API server, {run['rate']} changes/s for {run['minutes']} min "
        f"({run['changes']} changes: {run['change_mix']}), one fault per round, the cluster "
        "quiet from a restart to its checkpoint. At each checkpoint: the kernel against a "
        "fresh `--once` run of the same objects (differences at the first look / at the "
        "last; converged: seconds until none), every frontend tried from a client, a sample "
        "of localhost NodePorts from the node, the daemon's resources, the kernel's "
        "elements (a fresh sync's), the stale-objects gauge.",
        "",
        "| round | fault | daemon | services | differences | converged s | frontends ok "
        "| localhost ok | fds (listeners) | threads | RSS MB | kernel elements (fresh) "
        "| stale |" + (" heap: malloc in use (free) MB, pymalloc blocks k |" if heap else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if heap else ""),
    ]
    for p in run["checkpoints"]:
        c, local, r = p["connections"], p["localhost"], p["resources"]
        converged = p["converged_s"] if p["converged_s"] is not None else "no"
        lines.append(
            f"| {p['round']} | {p['fault']} | {p['lifetime']} | {p['services']} "
            f"| {p['first_differences']} / {len(p['differences'])} | {converged} "
            f"| {c['ok']}/{c['targets']} | {local['ok']}/{local['targets']} "
            f"| {r['fds']:.0f} ({r['listeners']:.0f}) | {r['threads']:.0f} | {r['rss_mb']:.0f} "
            f"| {p['kernel'].get('elements', 0)} ({p['kernel_fresh'].get('elements', 0)}) "
            f"| {p['stale_objects']:.0f} |" + (f" {_heap_cell(r)} |" if heap else "")
        )
    lines += ["", "Faults:", ""]
    for p in run["checkpoints"]:
        if p["fault_details"]:
            lines.append(f"* round {p['round']}, {p['fault']}: {json.dumps(p['fault_details'])}")
    lines += [
        "",
        "Slopes, per daemon lifetime of 3 checkpoints or more (least squares over its"
        " checkpoints; fds_other: the file descriptors beyond the localhost NodePort"
        " listeners, which follow the cluster; flat: the fitted growth within 4 fds,"
        " 1 thread, 16 MB, or 5 % of the level). Memory: RSS over the second half of the"
        " lifetime (from its middle on, with 6 checkpoints or more), and the heap in use"
        " (the heap watch: glibc malloc's bytes in use within 8 MB, pymalloc's blocks"
        " within 50k) over the whole lifetime; high water: RSS still rising with the heap"
        " in use flat, the allocators keeping free memory they once needed (see"
        " bench/README.md). The kernel's objects over the run:",
        "",
    ]
    for entry in run["slopes"]["lifetimes"]:
        parts = [
            f"{name} {entry[name]['first']:.0f} -> {entry[name]['last']:.0f}, "
            f"{entry[name]['slope_per_hour']}/h ({_flat(entry[name])})"
            for name in ("fds_other", "threads")
        ]
        rss, half = entry["rss_mb"], entry["rss_mb_second_half"]
        parts.append(
            f"rss_mb {rss['first']:.0f} -> {rss['last']:.0f}, {rss['slope_per_hour']}/h,"
            f" its second half {half['first']:.0f} -> {half['last']:.0f},"
            f" {half['slope_per_hour']}/h ({_flat(half)})"
        )
        parts += [
            f"{name} {entry[name]['first']:.1f} -> {entry[name]['last']:.1f}, "
            f"{entry[name]['slope_per_hour']}/h ({_flat(entry[name])})"
            for name in _HEAP_FLAT
            if name in entry
        ]
        lines.append(
            f"* daemon lifetime {entry['lifetime']} ({entry['checkpoints']} checkpoints over "
            f"{entry['span_s']:.0f} s): " + "; ".join(parts) + f"; memory: {entry['memory']}"
        )
    for key in ("chains", "sets", "elements"):
        item = run["slopes"][f"kernel_{key}_vs_fresh"]
        lines.append(
            f"* kernel {key}, live / a fresh sync's: {item['first']} -> {item['last']}, "
            f"{item['slope_per_hour']}/h ({_flat(item)})"
        )
    affinity = run["affinity"]
    passed = sum(1 for p in run["checkpoints"] if p["ok"])
    lines += [
        "",
        f"Session affinity clients: {affinity['connections']} connections to "
        f"{affinity['services']} ClientIP Services, {affinity['failed']} failed, "
        f"{affinity['moved']} met another endpoint than their pin outside a rules wipe.",
        "",
        f"Verdict: {'every checkpoint passed' if run['ok'] else 'FAILED'} "
        f"({passed}/{len(run['checkpoints'])}).",
    ]
    return "\n".join(lines) + "\n"


# --- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The soak (see the module); the run's record."""
    faults: list[str] = args.faults
    deadline = time.monotonic() + args.minutes * 60
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kpxb-soak-")))
        net = stack.enter_context(soak_net())
        api = API(net)
        cluster = SoakCluster(api.fake, args.services, seed=args.seed)
        api.start()
        stack.callback(api.stop)
        log = Path(args.log) if args.log else work / "daemon.log"
        watch = HeapWatch(work, args.heap_frames) if args.heap_watch else None
        daemon = Daemon(net, api.fake.port, log, watch)
        first_sync = daemon.start()
        stack.callback(lambda: daemon.stop(signal.SIGTERM))
        churn = Churn(cluster, args.rate)
        churn.thread.start()
        stack.callback(churn.stop.set)
        affinity = AffinityClients(net, cluster)
        stack.callback(affinity.close)
        soak = Soak(net, api, cluster, daemon, churn, work, args.settle)
        churn.resume()
        number = 0
        while number < args.rounds and (not args.minutes or time.monotonic() < deadline):
            fault = faults[number % len(faults)]
            round_started = time.monotonic()
            if fault in RESTARTS:
                churn.pause()
            details = soak.fault(fault)
            time.sleep(max(0.0, args.round_seconds - (time.monotonic() - round_started)))
            point = soak.checkpoint(number, fault, details)
            print(
                f"round {number} {fault}: {'ok' if point.ok else 'FAILED'}, converged "
                f"{point.converged_s} s, {point.connections['ok']}/{point.connections['targets']}"
                f" frontends, fds {point.resources['fds']:.0f}, {point.differences[:2]},"
                f" {json.dumps(details)[:600]}",
                flush=True,
            )
            number += 1
        churn.pause()
        checkpoints = [asdict(p) for p in soak.checkpoints]
        machine = machine_info()
        record = {
            "when": machine["date"],
            "commit": machine["commit"],
            "command": args.command,
            "machine": machine,
            "services": args.services,
            "rate": args.rate,
            "minutes": round((time.monotonic() - soak.started) / 60, 1),
            "faults": faults,
            "first_sync_s": round(first_sync, 2),
            "changes": churn.changes,
            "change_mix": dict(sorted(cluster.counts.items())),
            "checkpoints": checkpoints,
            "slopes": slopes(soak.checkpoints),
            "affinity": affinity.verdict(soak.resets),
            "daemon_lifetimes": daemon.lifetime,
        }
        record["ok"] = bool(checkpoints) and all(p["ok"] for p in checkpoints)
        return record


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module)."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--services", type=int, default=2000)
    parser.add_argument(
        "--rounds", type=int, default=2 * len(FAULTS), help="rounds (default: two cycles)"
    )
    parser.add_argument("--minutes", type=float, default=0.0, help="start no round after")
    parser.add_argument("--round-seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=10.0, help="changes a second")
    parser.add_argument("--settle", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--faults", type=lambda t: t.split(","), default=list(FAULTS))
    parser.add_argument("--short", action="store_true", help="the version make test runs")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--no-results", action="store_true", help="write no results files")
    parser.add_argument("--json", type=Path, help="also write the record there")
    parser.add_argument("--log", help="the daemon's log (default: a temporary file)")
    parser.add_argument(
        "--heap-watch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the daemon's heap in use beside its RSS (bench/heapwatch: one thread more)",
    )
    parser.add_argument(
        "--heap-frames",
        type=int,
        default=0,
        help="with --heap-watch: tracemalloc on with this many frames (slow; more memory)",
    )
    args = parser.parse_args(argv)
    clean_up_on_sigterm()  # namespaces, the daemon, the clients
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    if args.short:
        args.services, args.faults, args.rounds = 120, list(SHORT_FAULTS), len(SHORT_FAULTS)
        args.round_seconds, args.rate, args.settle = 5.0, 10.0, 30.0
    args.command = "python -m bench.soak " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    record = run(args)
    text = render(record)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if not args.no_results:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        host = record["machine"]["host"]
        (args.results / f"{stamp}-soak-{host}.json").write_text(json.dumps(record, indent=1))
        (args.results / "soak.md").write_text(text)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
