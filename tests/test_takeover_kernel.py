"""Taking a node over from upstream's kube-proxy, and handing it back, with live traffic.

``client -- node -- server`` (:func:`tests.kernelkit.client_node_server`, both families):
the node proxies a dual-stack echo Service (``ns0/svc-0``, 10.96.0.1 and fd00:96::1, port
80, to the echo server on 8080) and a few others whose endpoints do not exist, one with
ClientIP affinity. Before the switch the node holds what upstream's kube-proxy writes in
one mode: its nftables structure in both families, as its tests expect it (the
benchmark's generator, :mod:`bench.upstream_structure`, in the 1.33 and the 1.34+
layouts), or its iptables chains (iptables-nft or iptables-legacy) or ipvs state, as our
iptables and ipvs modes write them (upstream's names, chain for chain). During the switch
the client opens new connections to both families' Service addresses without pause and
holds one connection to each (:class:`tests.kernelkit.Traffic`): none may fail, and
afterwards nothing of the previous proxy may be left.

Handing back: our rules first, then what upstream's binary does when it starts (it cannot
run here: no Go build of it belongs in this repository), as its code and documentation
describe it: in nftables mode, its first sync over the table it finds (the same
generator's transaction: every base chain added and deleted once, its chains and maps
written); in iptables and ipvs modes, its ``platformCleanup`` deletes the nftables tables
*before* its first sync, so the documented way back is our own binary of that mode first
(a switch between our modes, as gapless as the takeover), then upstream's, whose first
sync writes over chains of its own names (simulated by our binary of that mode, which
writes upstream's chains: ``kube-proxy-iptables`` without a service CIDR writes exactly
upstream's rules).
"""

from __future__ import annotations

import ipaddress
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.synthetic import SyntheticService
from bench.upstream_structure import UpstreamOptions, upstream_ruleset
from kubeproxy.testing.runner import default_timeout
from tests.kernelkit import (
    ECHO_SERVER_IP,
    ECHO_SERVER_IP6,
    Topology,
    Traffic,
    client_node_server,
    lone_namespace,
    run_in,
)

pytestmark = pytest.mark.kernel

PREFIX = "kpxt"
NODE = "kpxt-node"
BIN = Path(sys.executable).parent
SERVICES = 6  # the echo Service and five others; Service 2 has ClientIP affinity
AFFINITY = 2
VIP4, VIP6 = "10.96.0.1", "fd00:96::1"
TARGETS = [(VIP4, 80), (VIP6, 80)]
POD_CIDRS = "10.128.0.0/9,fd00:128::/56"
SERVICE_CIDRS = "10.96.0.0/12,fd00:96::/108"
UPSTREAM_MAPS = frozenset(
    {
        "service-ips",
        "service-nodeports",
        "firewall-ips",
        "no-endpoint-services",
        "no-endpoint-nodeports",
    }
)
# iptables chains kube-proxy shares with kubelet and leaves in place, as upstream's cleanup.
SHARED_WITH_KUBELET = frozenset({"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"})
SAVE_TOOLS = ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save")
_GEN = re.compile(r"\.g[0-9]+$")


def scaled(seconds: float) -> float:
    """``seconds`` times the flow kit's timeout scale (emulated VMs are slower)."""
    return seconds * default_timeout()


# --- the cluster: our manifests and upstream's view of the same Services -----------------


def _endpoints(index: int, family: str) -> tuple[Any, ...]:
    if index == 0:
        return (ipaddress.ip_address(ECHO_SERVER_IP if family == "ip" else ECHO_SERVER_IP6),)
    base = "10.181.0.0" if family == "ip" else "fd00:181::"
    first = ipaddress.ip_address(base) + 4 * index
    return tuple(first + k for k in range(3))


def synthetic(family: str) -> list[SyntheticService]:
    """The cluster's Services as the upstream-structure generator takes them."""
    return [
        SyntheticService(
            index,
            len(_endpoints(index, family)),
            affinity_seconds=600 if index == AFFINITY else 0,
            explicit_endpoints=_endpoints(index, family),
            family="IPv4" if family == "ip" else "IPv6",
        )
        for index in range(SERVICES)
    ]


def upstream_text(layout: str) -> str:
    """Upstream's first full sync of the cluster, both families, as ``nft -f`` input."""
    v4 = UpstreamOptions(
        layout=layout,
        cluster_cidr=ipaddress.ip_network("10.128.0.0/9"),
        service_cidrs=(ipaddress.ip_network("10.96.0.0/12"),),
        node_ips=(ipaddress.ip_address("10.0.0.1"),),
    )
    v6 = UpstreamOptions(
        family="ip6",
        layout=layout,
        cluster_cidr=ipaddress.ip_network("fd00:128::/56"),
        service_cidrs=(ipaddress.ip_network("fd00:96::/108"),),
        node_ips=(ipaddress.ip_address("fd00::1"),),
    )
    lines = [*upstream_ruleset(synthetic("ip"), v4), *upstream_ruleset(synthetic("ip6"), v6)]
    return "\n".join(lines) + "\n"


def write_manifests(directory: Path) -> Path:
    """The Node and the dual-stack Services with their EndpointSlices."""
    v4, v6 = synthetic("ip"), synthetic("ip6")
    items: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "10.0.0.1"},
                    {"type": "InternalIP", "address": "fd00::1"},
                ]
            },
        }
    ]
    for four, six in zip(v4, v6, strict=True):
        service = four.service_dict()
        spec = service["spec"]
        spec["clusterIPs"] = [str(four.cluster_ip), str(six.cluster_ip)]
        spec["ipFamilies"] = ["IPv4", "IPv6"]
        spec["ipFamilyPolicy"] = "RequireDualStack"
        items.append(service)
        items += four.slice_dicts()
        for slice_ in six.slice_dicts():
            slice_["metadata"]["name"] += "-v6"
            items.append(slice_)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cluster.json").write_text(json.dumps({"kind": "List", "items": items}))
    return directory


# --- the node ---------------------------------------------------------------------------


@dataclass
class Scene:
    topology: Topology
    manifests: Path

    @property
    def node(self) -> str:
        return self.topology.node

    def run(self, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` in the node namespace."""
        return subprocess.run(
            ["ip", "netns", "exec", self.node, *argv],
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=scaled(120),
        )

    def ok(self, *argv: str, stdin: str | None = None) -> str:
        result = self.run(*argv, stdin=stdin)
        assert result.returncode == 0, f"{argv[0]}: {result.stderr[-3000:]}"
        return result.stdout

    def binary(self, prog: str, *argv: str, cidrs: bool = True) -> list[str]:
        """Our ``prog`` over the cluster as this node (argv after the manifests)."""
        return [
            str(BIN / prog),
            "--manifests",
            str(self.manifests),
            "--hostname-override",
            NODE,
            f"--cluster-cidr={POD_CIDRS}",
            *([f"--service-cluster-ip-range={SERVICE_CIDRS}"] if cidrs else []),
            "--healthz-bind-address=",
            "--metrics-bind-address=",
            *argv,
        ]

    def once(self, prog: str, *argv: str, cidrs: bool = True) -> str:
        """``prog --once``; its log."""
        result = self.run(*self.binary(prog, "--once", *argv, cidrs=cidrs))
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    def serves(self) -> bool:
        """Whether both Service addresses answer from the client."""
        try:
            with Traffic(self.topology.client, TARGETS):
                pass
        except (OSError, AssertionError):
            return False
        return True


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    with client_node_server(PREFIX, ipv6=True) as topology:
        yield Scene(topology, write_manifests(tmp_path / "manifests"))


def switch(scene: Scene, step: Any) -> None:
    """Run ``step`` while traffic flows; no connection may fail."""
    with Traffic(scene.topology.client, TARGETS, timeout=scaled(1.0)) as traffic:
        time.sleep(0.2)
        step()
        time.sleep(0.3)
    traffic.assert_unbroken()


class Daemon:
    """Our binary running as a node's daemon, its log read as it comes."""

    def __init__(self, scene: Scene, prog: str) -> None:
        argv = ["ip", "netns", "exec", scene.node, *scene.binary(prog, "-v", "2")]
        self.process = subprocess.Popen(
            argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines if text in line]
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the log:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=scaled(30))
        self._reader.join(timeout=5)


# --- what the node holds ------------------------------------------------------------------


def nft_names(scene: Scene | str, family: str) -> set[str]:
    """The chains and sets/maps of ``table <family> kube-proxy`` (empty: no table)."""
    netns = scene if isinstance(scene, str) else scene.node
    result = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-j", "list", "table", family, "kube-proxy"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return set()
    names = set()
    for item in json.loads(result.stdout)["nftables"]:
        for kind in ("chain", "set", "map"):
            if kind in item:
                names.add(f"{'chain' if kind == 'chain' else 'set'} {item[kind]['name']}")
    return names


def normalized(names: set[str]) -> set[str]:
    """Names with our generation number dropped (``pick-3.g2`` -> ``pick-3``)."""
    return {_GEN.sub("", name) for name in names}


def ours_fresh(scene: Scene) -> dict[str, set[str]]:
    """What our binary writes for the cluster into an empty namespace, by family."""
    with lone_namespace(PREFIX) as lone:
        for address in ("10.0.0.1/24", "fd00::1/64"):
            run_in(lone.name, "ip", "addr", "add", address, "dev", "lo")
        result = subprocess.run(
            ["ip", "netns", "exec", lone.name, *scene.binary("kube-proxy-nftables", "--once")],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return {family: normalized(nft_names(lone.name, family)) for family in ("ip", "ip6")}


def upstream_fresh(layout: str) -> dict[str, set[str]]:
    """What upstream's first sync writes for the cluster into an empty namespace."""
    with lone_namespace(PREFIX) as lone:
        loaded = subprocess.run(
            ["ip", "netns", "exec", lone.name, "nft", "-f", "-"],
            input=upstream_text(layout),
            capture_output=True,
            text=True,
            check=False,
        )
        assert loaded.returncode == 0, loaded.stderr
        return {family: nft_names(lone.name, family) for family in ("ip", "ip6")}


def kube_chains(scene: Scene) -> dict[str, list[str]]:
    """The proxy's KUBE- chains per iptables-save tool (kubelet's excepted)."""
    found = {}
    for tool in SAVE_TOOLS:
        saved = scene.ok(tool)
        found[tool] = [
            name
            for line in saved.splitlines()
            if line.startswith(":KUBE-")
            and (name := line[1:].split(" ", 1)[0]) not in SHARED_WITH_KUBELET
        ]
    return found


def no_kube_chains(scene: Scene) -> bool:
    return all(not chains for chains in kube_chains(scene).values())


def legacy_hint(scene: Scene) -> None:
    """Kubelet's hint chain in iptables-legacy: iptables mode picks the legacy variant."""
    scene.ok(
        "iptables-legacy-restore",
        "--noflush",
        stdin="*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n",
    )


def assert_only_ours(scene: Scene) -> None:
    """Both families' tables hold exactly what our proxy writes for this cluster."""
    fresh = ours_fresh(scene)
    for family in ("ip", "ip6"):
        held = nft_names(scene, family)
        assert normalized(held) == fresh[family], (
            f"{family}: left {sorted(normalized(held) - fresh[family])[:10]}, "
            f"missing {sorted(fresh[family] - normalized(held))[:10]}"
        )


# --- from upstream's modes to ours -------------------------------------------------------


@pytest.mark.parametrize("layout", ["1.34", "1.33"])
def test_a_daemon_takes_over_upstreams_nftables_table(scene: Scene, layout: str) -> None:
    scene.ok("nft", "-f", "-", stdin=upstream_text(layout))
    assert scene.serves()
    assert any("/" in name for name in nft_names(scene, "ip"))

    daemon = Daemon(scene, "kube-proxy-nftables")
    try:

        def take_over() -> None:
            daemon.wait_for("Took the node over", scaled(60))

        switch(scene, take_over)
    finally:
        daemon.stop()
    assert daemon.process.returncode == 0, "".join(daemon.lines)[-3000:]
    # Nothing of upstream's: every chain, set and map is one ours writes.
    assert_only_ours(scene)
    assert scene.serves()


def test_once_takes_over_upstreams_nftables_table(scene: Scene) -> None:
    scene.ok("nft", "-f", "-", stdin=upstream_text("1.34"))
    switch(scene, lambda: scene.once("kube-proxy-nftables"))
    assert_only_ours(scene)


@pytest.mark.parametrize("variant", ["nft", "legacy"])
def test_nftables_mode_takes_over_upstreams_iptables_chains(scene: Scene, variant: str) -> None:
    if variant == "legacy":
        legacy_hint(scene)
    # Upstream's iptables mode: its chains, hash for hash (ours write exactly those).
    scene.once("kube-proxy-iptables", cidrs=False)
    assert not no_kube_chains(scene)
    written = kube_chains(scene)
    used = "iptables-legacy-save" if variant == "legacy" else "iptables-nft-save"
    assert written[used], written
    assert nft_names(scene, "ip") == set()
    assert scene.serves()

    switch(scene, lambda: scene.once("kube-proxy-nftables"))
    assert no_kube_chains(scene), kube_chains(scene)
    assert_only_ours(scene)


def has_ipvs() -> bool:
    return Path("/proc/net/ip_vs").exists() or (
        subprocess.run(["modprobe", "-q", "ip_vs"], check=False).returncode == 0
        and Path("/proc/net/ip_vs").exists()
    )


def test_a_daemon_takes_over_upstreams_ipvs_state(scene: Scene) -> None:
    if not has_ipvs():
        pytest.skip("kernel lacks IP_VS: ipvs mode cannot run here (make test-kernels runs it)")
    scene.once("kube-proxy-ipvs", cidrs=False)
    assert "kube-ipvs0" in scene.ok("ip", "-o", "link", "show")
    assert scene.serves()

    daemon = Daemon(scene, "kube-proxy-nftables")
    try:
        # The long-lived connections go through IPVS: their virtual servers stay until
        # they end, the rest of ipvs mode goes at once.
        with Traffic(scene.topology.client, TARGETS, timeout=scaled(1.0)) as traffic:
            time.sleep(0.2)
            daemon.wait_for("Keeping 2 IPVS virtual servers", scaled(60))
            time.sleep(0.5)
            assert no_kube_chains(scene), kube_chains(scene)
        traffic.assert_unbroken()
        daemon.wait_for("Took the node over", scaled(60))
    finally:
        daemon.stop()
    assert "kube-ipvs0" not in scene.ok("ip", "-o", "link", "show")
    assert scene.ok("ipset", "list", "-n").split() == []
    assert VIP4 not in scene.ok("cat", "/proc/net/ip_vs")
    assert scene.ok("sysctl", "-n", "net.ipv4.vs.conntrack").strip() == "0"
    assert_only_ours(scene)
    assert scene.serves()


# --- and back: from ours to upstream's modes ---------------------------------------------


def our_slash_chains(scene: Scene, family: str) -> list[str]:
    """Our chains whose names hold a "/": upstream deletes such chains when it does not
    use them, and cannot while our maps still name them."""
    return sorted(
        name.split(" ", 1)[1]
        for name in nft_names(scene, family)
        if name.startswith("chain affinity-") and "/" in name
    )


def flagged(scene: Scene) -> bool:
    """Whether our IPv4 table carries flags (owner, persist: the owned table)."""
    listing = scene.ok("nft", "list", "table", "ip", "kube-proxy")
    return any(line.startswith("\tflags") for line in listing.splitlines())


def test_handing_back_to_upstreams_nftables_mode(scene: Scene) -> None:
    scene.once("kube-proxy-nftables")
    if flagged(scene):
        # The owned table (Linux 6.9+), orphaned when our proxy ended: the kernel will
        # not take "persist" off a table, which knftables' "add table" asks for, so
        # upstream's every sync is refused whole and our last rules serve on, stale.
        refused = scene.run("nft", "-f", "-", stdin=upstream_text("1.34"))
        assert refused.returncode != 0 and "Operation not supported" in refused.stderr
        # --cleanup-leftovers makes it unowned first, in one transaction and without a
        # failed connection, then refuses the rest while our rules are in use (the
        # cleanup DaemonSet's init container is retried until upstream has synced).
        results: list[subprocess.CompletedProcess[str]] = []
        switch(
            scene,
            lambda: results.append(
                scene.run(*scene.binary("kube-proxy-nftables", "--cleanup-leftovers"))
            ),
        )
        assert results[0].returncode == 1 and "still in use" in results[0].stderr
        assert not flagged(scene)
    # Upstream's first sync over our table: its base chains re-created, its rules live
    # in the same commit.
    switch(scene, lambda: scene.ok("nft", "-f", "-", stdin=upstream_text("1.34")))
    upstream = upstream_fresh("1.34")
    for family in ("ip", "ip6"):
        assert upstream[family] <= nft_names(scene, family)
    # What it cannot cope with: a second later it deletes the chains with a "/" that it
    # does not use, and the kernel refuses those our affinity maps still name. The
    # sticky cluster-IP-only port keys its entries by its frontend in both families,
    # with chains shared per map: none of the port's own, none with a "/" (a port that
    # keeps its pins, under a Local traffic policy, still has such chains).
    assert our_slash_chains(scene, "ip") == our_slash_chains(scene, "ip6") == []

    def remove_leftovers() -> None:
        scene.ok(*scene.binary("kube-proxy-nftables", "--cleanup-leftovers"))

    switch(scene, remove_leftovers)
    for family in ("ip", "ip6"):
        assert nft_names(scene, family) == upstream[family]
        assert our_slash_chains(scene, family) == []
    assert scene.serves()


def test_cleanup_leftovers_changes_nothing_while_our_rules_are_in_use(scene: Scene) -> None:
    scene.once("kube-proxy-nftables")
    before = {family: nft_names(scene, family) for family in ("ip", "ip6")}
    result = scene.run(*scene.binary("kube-proxy-nftables", "--cleanup-leftovers"))
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("E")]
    assert len(errors) == 1 and "still in use" in errors[0], result.stderr
    assert {family: nft_names(scene, family) for family in ("ip", "ip6")} == before
    assert scene.serves()


@pytest.mark.parametrize("variant", ["nft", "legacy"])
def test_handing_back_to_upstreams_iptables_mode(scene: Scene, variant: str) -> None:
    if variant == "legacy":
        legacy_hint(scene)
    scene.once("kube-proxy-nftables")
    # Upstream's iptables mode deletes our tables before its first sync: go through our
    # own iptables mode first (it writes upstream's chains; our tables go after them).
    switch(scene, lambda: scene.once("kube-proxy-iptables"))
    assert nft_names(scene, "ip") == nft_names(scene, "ip6") == set()
    tool = "iptables-legacy-save" if variant == "legacy" else "iptables-nft-save"
    assert ":KUBE-SERVICE-IPS " in scene.ok(tool, "-t", "filter")
    # Upstream's first sync: its chains, over ours of the same names (our binary without
    # a service CIDR writes exactly upstream's rules).
    switch(scene, lambda: scene.once("kube-proxy-iptables", cidrs=False))
    # What upstream leaves of ours: the chain no rule jumps to any more.
    saved = scene.ok(tool, "-t", "filter")
    assert ":KUBE-SERVICE-IPS " in saved and "-j KUBE-SERVICE-IPS" not in saved
    upstreams = kube_chains(scene)
    switch(scene, lambda: scene.ok(*scene.binary("kube-proxy-nftables", "--cleanup-leftovers")))
    assert ":KUBE-SERVICE-IPS " not in scene.ok(tool, "-t", "filter")
    left = kube_chains(scene)
    assert left == {
        t: [c for c in chains if c != "KUBE-SERVICE-IPS"] for t, chains in upstreams.items()
    }
    assert scene.serves()


def test_handing_back_to_upstreams_ipvs_mode(scene: Scene) -> None:
    if not has_ipvs():
        pytest.skip("kernel lacks IP_VS: ipvs mode cannot run here (make test-kernels runs it)")
    scene.once("kube-proxy-nftables")
    # As for iptables mode: through our own ipvs mode (upstream's deletes our tables
    # before its first sync), then upstream's first sync over state of its own names.
    switch(scene, lambda: scene.once("kube-proxy-ipvs"))
    assert nft_names(scene, "ip") == nft_names(scene, "ip6") == set()
    switch(scene, lambda: scene.once("kube-proxy-ipvs", cidrs=False))
    assert VIP4 in scene.ok("ip", "-o", "addr", "show", "dev", "kube-ipvs0")
    scene.ok(*scene.binary("kube-proxy-ipvs", "--cleanup-leftovers"))
    assert scene.serves()


IPTABLES_NFT = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KPXT-FOREIGN - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -p tcp --dport 9 -j KPXT-FOREIGN
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SEP-BBBBBBBBBBBBBBBB -s 10.180.0.10/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-BBBBBBBBBBBBBBBB -p tcp -j DNAT --to-destination 10.180.0.10:8080
-A KPXT-FOREIGN -j RETURN
COMMIT
*filter
:KUBE-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -j KUBE-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -j KUBE-SERVICES
COMMIT
"""


def test_iptables_nft_chains_go_in_one_batch_and_nobody_elses() -> None:
    from kubeproxy.backends.iptables.nftchains import remove_ours
    from kubeproxy.backends.iptables.proxier import owns_chain
    from kubeproxy.objects import IPFamily

    with lone_namespace(PREFIX) as lone:
        loaded = subprocess.run(
            ["ip", "netns", "exec", lone.name, "iptables-nft-restore", "--noflush"],
            input=IPTABLES_NFT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert loaded.returncode == 0, loaded.stderr
        # Two chains a batch: the callers' chains must go in batches before their targets'.
        removed = remove_ours(
            IPFamily.IPV4, ("nat", "filter", "mangle"), owns_chain, lone.name, per_batch=2, pause=0
        )
        assert removed == 5  # nat: SERVICES, SVC, SEP, MARK-MASQ; filter: SERVICES
        saved = run_in(lone.name, "iptables-nft-save")
    assert "KUBE-SERVICES" not in saved and "KUBE-SVC" not in saved and "KUBE-SEP" not in saved
    # Someone else's chain and rules stay, and kubelet's chain with its jump.
    assert "-A PREROUTING -p tcp -m tcp --dport 9 -j KPXT-FOREIGN" in saved
    assert "-A KPXT-FOREIGN -j RETURN" in saved
    assert "-A INPUT -j KUBE-FIREWALL" in saved
