"""The binaries and their wiring: flags, --help/--version/--write-config-to, --dry-run,
--once, --cleanup, the `make run` demo, and the pieces of the library daemon (kubeproxy.daemon).

The option parsing itself is tested in test_commandline.py; the daemon end to end in
test_daemon.py.
"""

from __future__ import annotations

import io
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubeproxy.backends import nftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.cmd import nftables as nft_binary
from kubeproxy.cmd.binary import run as binary_run
from kubeproxy.cmd.commandline import parse_options
from kubeproxy.config import ProxierConfig
from kubeproxy.configfile.codec import parse_config
from kubeproxy.daemon import DaemonSeams, LoggingEventSink
from kubeproxy.daemon.gate import HandlerGate
from kubeproxy.daemon.gctuning import ONE_SHOT_GC_OPS, GcTuner
from kubeproxy.daemon.nodeips import (
    LOOPBACK_MESSAGE,
    FamilyNotSupported,
    NodeIPs,
    detect_families,
    detect_node_ips,
    expand_primary,
    host_ips,
    kernel_supports_ipv6,
)
from kubeproxy.daemon.privileged import apply_oom_score_adj, conntrack_sysctls, privileged_setup
from kubeproxy.events import ObjectReference
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.host.sysctl import ConntrackSysctls
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPAddress, IPFamily
from kubeproxy.sources.kubernetes import IN_CLUSTER_MESSAGE
from kubeproxy.testing.runner import default_timeout
from tests.gcops import UNTOUCHED, recording_gc
from tests.kernelkit import without_owner

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "cluster"
BIN = Path(sys.executable).parent / "kube-proxy-nftables"


def ips(*texts: str) -> list[IPAddress]:
    return [ipaddress.ip_address(t) for t in texts]


# --- the binary: flags and early exits ----------------------------------------------------


def test_bad_flag_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [str(BIN), "--manifests", str(EXAMPLES), "--cluster-cidr", "bogus"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kube-proxy-nftables: --cluster-cidr: clusterCIDR: 'bogus' is not a CIDR"
        " (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)"
    ]


def test_bad_config_file_field_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.conf"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "conntrack:\n  maxPerCor: 5\n"
    )
    assert nft_binary.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kube-proxy-nftables: --config {config}: ")
    assert "conntrack.maxPerCor" in err[0]


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert nft_binary.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kube-proxy-nftables") and "--init-only" in out
    assert nft_binary.main(["--version"]) == 0
    assert capsys.readouterr().out == f"kube-proxy-nftables {nft_binary.version()}\n"
    assert nft_binary.main(["--version=raw"]) == 0
    assert "Python 3." in capsys.readouterr().out


def test_write_config_to(tmp_path: Path) -> None:
    out = tmp_path / "written.yaml"
    assert nft_binary.main(["--write-config-to", str(out), "--conntrack-min=7"]) == 0
    written = parse_config(out.read_text())
    assert written.mode == "nftables" and written.conntrack.min == 7
    assert nft_binary.main(["--write-config-to", str(tmp_path / "no" / "dir.yaml")]) == 1


def run_binary(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kube-proxy-nftables ARGV`` in this namespace (for runs that touch no kernel)."""
    return subprocess.run(
        [str(BIN), *argv], capture_output=True, text=True, check=False, env=env, timeout=60
    )


def test_without_manifests_or_cluster_credentials_exits_1() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    result = run_binary("--hostname-override=kpxe-x", env=env)
    assert result.returncode == 1, result.stderr
    assert IN_CLUSTER_MESSAGE in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("E")]
    assert len(errors) == 1 and "cannot build the Kubernetes API client" in errors[0]


def test_print_backend_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "print_backend.py"), str(EXAMPLES)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.splitlines() == [
        "# full sync, 3 service ports",
        "demo/dns:dns 172.30.0.53:53/UDP -> 10.244.0.13:5353",
        "demo/shop:http 172.30.0.20:80/TCP -> 10.244.0.11:8080",
        "demo/web:http 172.30.0.10:80/TCP -> 10.244.0.11:8080, 10.244.0.12:8080",
    ]


# --- the binary in a network namespace ----------------------------------------------------


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpxc-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _in_ns(ns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, check=False
    )


@pytest.mark.kernel
def test_dry_run_prints_and_touches_nothing(netns: str) -> None:
    result = _in_ns(
        netns,
        str(BIN),
        "--manifests",
        str(EXAMPLES),
        "--hostname-override",
        "demo-node",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "add table ip kube-proxy" in result.stdout
    assert "172.30.0.10 . tcp . 80" in result.stdout
    assert _in_ns(netns, "nft", "list", "tables").stdout.strip() == ""


@pytest.mark.kernel
def test_once_programs_then_cleanup_removes_only_ours(netns: str) -> None:
    foreign = (
        "table inet kpxc-foreign {\n\tchain input {\n"
        "\t\ttype filter hook input priority 0; policy accept;\n\t}\n}\n"
    )
    assert (
        subprocess.run(
            ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=foreign, text=True, check=False
        ).returncode
        == 0
    )
    before = _in_ns(netns, "nft", "list", "table", "inet", "kpxc-foreign").stdout
    result = _in_ns(
        netns,
        str(BIN),
        "--manifests",
        str(EXAMPLES),
        "--hostname-override",
        "demo-node",
        "--once",
    )
    assert result.returncode == 0, result.stderr
    listing = _in_ns(netns, "nft", "list", "table", "ip", "kube-proxy").stdout
    assert "172.30.0.10 . tcp . 80" in listing
    cleanup = _in_ns(netns, str(BIN), "--cleanup")
    assert cleanup.returncode == 0, cleanup.stderr
    tables = _in_ns(netns, "nft", "list", "tables").stdout.split("\n")
    assert [t for t in tables if t] == ["table inet kpxc-foreign"]
    assert _in_ns(netns, "nft", "list", "table", "inet", "kpxc-foreign").stdout == before


def _healthz_code(ns: str) -> str:
    return _in_ns(
        ns,
        "curl",
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "2",
        "http://127.0.0.1:10256/healthz",
    ).stdout


@pytest.mark.kernel
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_daemon_and_leaves_the_rules(netns: str, signum: int) -> None:
    argv = [
        "ip",
        "netns",
        "exec",
        netns,
        str(BIN),
        "--manifests",
        str(EXAMPLES),
        "--hostname-override=demo-node",
        "--healthz-bind-address=127.0.0.1:10256",
        "--metrics-bind-address=127.0.0.1:10249",
        # Leave nf_conntrack_max (and with it the host-wide hash size) alone.
        "--conntrack-max-per-core=0",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20 * default_timeout()  # longer when emulated

        def listing() -> str:
            return _in_ns(netns, "nft", "list", "table", "ip", "kube-proxy").stdout

        # Healthy (the servers are up) and synced (which comes after the other modes'
        # cleanup, itself after the servers bind).
        while _healthz_code(netns) != "200" or "172.30.0.10 . tcp . 80" not in listing():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the daemon never became healthy and synced"
            time.sleep(0.1)
        synced = listing()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=20 * default_timeout())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert f"Received signal {int(signum)}, stopping (rules stay in place)" in stderr
    assert "kube-proxy stopped; the rules stay in place" in stderr
    # The same rules (an owned table is orphaned now, for the next proxy to adopt).
    assert without_owner(listing()) == without_owner(synced)
    assert _healthz_code(netns) == "000"  # the server is closed


@pytest.mark.kernel
def test_make_run_demo_succeeds() -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        [sys.executable, "-m", "kubeproxy.cmd.demo", str(EXAMPLES)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        # Under emulation (make test-kernels) the proxy's --once alone took 76 s on 6.12.
        timeout=120 * default_timeout(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo succeeded" in result.stdout
    assert "hello from pod" in result.stdout
    assert "dns answer from pod3" in result.stdout
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert "kpxd-" not in leftover.stdout


# --- node IPs, families, nodePortAddresses ------------------------------------------------


def test_host_ips_are_the_first_address_and_the_first_of_the_other_family() -> None:
    assert host_ips([]) == ()
    assert host_ips(ips("10.0.0.1", "10.0.0.2")) == tuple(ips("10.0.0.1"))
    assert host_ips(ips("2001:db8::1", "10.0.0.1", "10.0.0.2", "2001:db8::2")) == tuple(
        ips("2001:db8::1", "10.0.0.1")
    )


def test_node_ips_from_the_node(caplog: pytest.LogCaptureFixture) -> None:
    found = detect_node_ips(ips("2001:db8::1", "10.0.0.1"))
    assert found.primary_family is IPFamily.IPV6
    assert (str(found.ipv4), str(found.ipv6)) == ("10.0.0.1", "2001:db8::1")
    assert found.real == tuple(ips("2001:db8::1", "10.0.0.1"))
    assert LOOPBACK_MESSAGE not in caplog.messages


@pytest.mark.parametrize("bind", ["", "0.0.0.0", "::", "not-an-ip"])
def test_an_unspecified_bind_address_overrides_nothing(bind: str) -> None:
    found = detect_node_ips(ips("10.0.0.1"), bind)
    assert (found.primary_family, str(found.primary)) == (IPFamily.IPV4, "10.0.0.1")


def test_bind_address_overrides_the_primary_ip() -> None:
    found = detect_node_ips(ips("10.0.0.1", "2001:db8::1"), "2001:db8::99")
    assert found.primary_family is IPFamily.IPV6
    assert (str(found.ipv4), str(found.ipv6)) == ("10.0.0.1", "2001:db8::99")
    found = detect_node_ips([], "192.0.2.5")
    assert str(found.primary) == "192.0.2.5" and found.ipv6.is_loopback


def test_no_node_ip_means_loopback_and_upstreams_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    found = detect_node_ips([])
    assert found == NodeIPs()
    assert found.primary.is_loopback and found.real == ()
    assert LOOPBACK_MESSAGE in caplog.messages


def test_families() -> None:
    v4_only = detect_node_ips(ips("10.0.0.1"))
    dual = detect_node_ips(ips("10.0.0.1", "2001:db8::1"))
    # Upstream: the primary family, and the other whenever the kernel supports it.
    assert detect_families(v4_only, ipv6_supported=True) == [IPFamily.IPV4, IPFamily.IPV6]
    assert detect_families(v4_only, ipv6_supported=False) == [IPFamily.IPV4]
    assert detect_families(dual, ipv6_supported=False) == [IPFamily.IPV4]
    assert detect_families(dual, ipv6_supported=True) == [IPFamily.IPV4, IPFamily.IPV6]
    v6_only = detect_node_ips(ips("2001:db8::1"))
    assert detect_families(v6_only, ipv6_supported=True) == [IPFamily.IPV4, IPFamily.IPV6]
    with pytest.raises(FamilyNotSupported, match=r'^no support for primary IP family "IPv6"$'):
        detect_families(v6_only, ipv6_supported=False)
    # No node IP at all: loopback stands in, IPv4 primary.
    assert detect_families(detect_node_ips([]), ipv6_supported=True) == [
        IPFamily.IPV4,
        IPFamily.IPV6,
    ]


def test_kernel_without_ipv6_says_so_as_upstream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert not kernel_supports_ipv6(str(tmp_path / "if_inet6"))
    assert caplog.messages == [
        f'No kernel support for IPv6 err="stat {tmp_path / "if_inet6"}: No such file or directory"'
    ]
    (tmp_path / "if_inet6").write_text("")
    assert kernel_supports_ipv6(str(tmp_path / "if_inet6"))


def test_expand_primary() -> None:
    config = ProxierConfig(node_name="n", node_port_addresses=("primary", "localhost"))
    dual = detect_node_ips(ips("10.0.0.1", "2001:db8::1"))
    assert expand_primary(config, dual).node_port_addresses == (
        "10.0.0.1/32",
        "2001:db8::1/128",
        "localhost",
    )
    # No real node IP: primary stays for the proxier (it then matches every address).
    assert expand_primary(config, NodeIPs()) is config
    cidrs = ProxierConfig(node_name="n", node_port_addresses=("10.0.0.0/8",))
    assert expand_primary(cidrs, dual) is cidrs


# --- the handler gate ---------------------------------------------------------------------


class Recorder:
    """A handler that records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, *args))


def test_gate_holds_then_replays_in_order_then_forwards() -> None:
    gate = HandlerGate()
    node_v1 = {"metadata": {"name": "n", "resourceVersion": "1"}}
    node_v2 = {"metadata": {"name": "n", "resourceVersion": "2"}}
    gate.on_node_update(node_v1)
    gate.on_service_add({"s": 1})
    gate.on_services_synced()
    gate.on_node_update(node_v2)
    gate.on_endpoint_slice_add({"e": 1})
    gate.on_service_cidrs_changed((ipaddress.ip_network("10.96.0.0/12"),))
    assert gate.node is node_v2 and gate.held == 6 and not gate.bound
    recorder = Recorder()
    gate.bind(recorder)
    assert [c[0] for c in recorder.calls] == [
        "on_node_update",
        "on_service_add",
        "on_services_synced",
        "on_node_update",
        "on_endpoint_slice_add",
        "on_service_cidrs_changed",
    ]
    gate.on_service_delete({"s": 1})
    gate.on_node_update(None)
    assert recorder.calls[-2:] == [("on_service_delete", {"s": 1}), ("on_node_update", None)]
    assert gate.held == 0 and gate.bound and gate.node is None
    with pytest.raises(RuntimeError):
        gate.bind(recorder)


def test_gate_keeps_order_when_calls_race_the_bind() -> None:
    gate = HandlerGate()
    recorder = Recorder()
    sent = 2000
    ready = threading.Event()

    def deliver() -> None:
        for i in range(sent):
            if i == 100:
                ready.set()
            gate.on_service_add({"n": i})

    thread = threading.Thread(target=deliver)
    thread.start()
    ready.wait(5)
    gate.bind(recorder)
    thread.join()
    assert [c[1]["n"] for c in recorder.calls] == list(range(sent))


def test_a_failing_replayed_call_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Picky(Recorder):
        def on_service_add(self, service: Any) -> None:
            raise ValueError("boom")

    gate = HandlerGate()
    gate.on_service_add({})
    gate.on_services_synced()
    picky = Picky()
    gate.bind(picky)
    assert picky.calls == [("on_services_synced",)]
    assert any("Replaying on_service_add" in m for m in caplog.messages)


# --- the garbage collector ----------------------------------------------------------------


class _Changes:
    def __init__(self, full: bool) -> None:
        self.full = full


class _Snapshot:
    def __init__(self, family: IPFamily) -> None:
        self.family = family


def _tuner(families: list[IPFamily]) -> tuple[GcTuner, list[str]]:
    ops, calls = recording_gc()
    return GcTuner(families, ops, thresholds=(5000, 20, 30)), calls


def _sync(tuner: GcTuner, family: IPFamily, full: bool) -> None:
    tuner(None, _Snapshot(family), _Changes(full))  # type: ignore[arg-type]


def test_gc_is_tuned_once_after_every_familys_first_full_sync() -> None:
    tuner, calls = _tuner([IPFamily.IPV4, IPFamily.IPV6])
    _sync(tuner, IPFamily.IPV4, False)
    _sync(tuner, IPFamily.IPV4, True)
    assert calls == [] and not tuner.done
    _sync(tuner, IPFamily.IPV6, False)
    assert calls == []
    _sync(tuner, IPFamily.IPV6, True)
    assert calls == ["collect", "freeze", "threshold 5000 20 30"] and tuner.done
    _sync(tuner, IPFamily.IPV4, True)
    assert len(calls) == 3


def test_gc_tuner_holds_the_collector_until_the_first_full_syncs() -> None:
    tuner, calls = _tuner([IPFamily.IPV4])
    tuner.hold()
    tuner.hold()
    assert calls == ["disable"] and tuner.held
    _sync(tuner, IPFamily.IPV4, False)
    assert calls == ["disable"]
    _sync(tuner, IPFamily.IPV4, True)
    # Held: nothing to collect, and collecting a whole heap would block the servers.
    assert calls == ["disable", "freeze", "threshold 5000 20 30", "enable"]
    assert not tuner.held
    tuner.hold()  # tuned already: nothing more to hold for
    tuner.release()
    assert len(calls) == 4


def test_gc_tuner_with_the_real_collector() -> None:
    import gc

    thresholds = gc.get_threshold()
    try:
        tuner = GcTuner([IPFamily.IPV4], thresholds=(thresholds[0] + 1, 11, 12))
        _sync(tuner, IPFamily.IPV4, True)
        assert gc.get_threshold() == (thresholds[0] + 1, 11, 12)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_one_shot_gc_ops_freeze_what_was_built_before_the_collector_comes_back() -> None:
    import gc

    assert gc.isenabled()
    try:
        tuner = GcTuner([IPFamily.IPV4], ONE_SHOT_GC_OPS)
        tuner.hold()
        assert not gc.isenabled()
        # Counted from here: an earlier test may have left objects frozen.
        frozen_before = gc.get_freeze_count()
        built = [{"index": index} for index in range(1000)]  # tracked, young objects
        tuner.release()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(built)
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_once_run_of_the_binary_gets_the_one_shot_gc_ops(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given: list[DaemonSeams] = []

    def run_daemon(*_args: object, seams: DaemonSeams, **_kwargs: object) -> int:
        given.append(seams)
        return 0

    monkeypatch.setattr("kubeproxy.cmd.binary.missing_capabilities", lambda _caps: [])
    monkeypatch.setattr("kubeproxy.cmd.binary.run_daemon", run_daemon)
    monkeypatch.setattr("kubeproxy.cmd.binary.configure_logging", lambda _config: None)
    flags = ["--manifests", str(tmp_path), "--hostname-override", "n"]
    assert binary_run(nft_binary.BINARY, [*flags, "--once"]) == 0
    assert binary_run(nft_binary.BINARY, flags) == 0
    own = DaemonSeams(gc_ops=UNTOUCHED)
    assert binary_run(nft_binary.BINARY, [*flags, "--once"], seams=own) == 0
    # A daemon that goes on keeps the usual collector; a test's own ops stay its own.
    assert [seams.gc_ops for seams in given] == [ONE_SHOT_GC_OPS, None, UNTOUCHED]


# --- privileged set-up, events, backend metrics -------------------------------------------


def test_conntrack_sysctls_from_the_configuration() -> None:
    options = parse_options(
        [
            "--hostname-override=n",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=2h",
            "--conntrack-udp-timeout=30s",
            "--conntrack-tcp-be-liberal",
        ],
        "kube-proxy-nftables",
        "nftables",
    )
    assert conntrack_sysctls(options.conntrack) == ConntrackSysctls(
        max_per_core=0,
        min=131072,
        tcp_established_timeout=7200.0,
        tcp_close_wait_timeout=3600.0,
        tcp_be_liberal=True,
        udp_timeout=30.0,
        udp_stream_timeout=0.0,
    )


def test_privileged_setup_logs_refusals_and_carries_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kubeproxy.daemon.privileged import HostPaths

    netfilter = tmp_path / "sys" / "net" / "netfilter"
    netfilter.mkdir(parents=True)
    # nf_conntrack_max is missing (read-only outside the initial namespace): refused.
    (netfilter / "nf_conntrack_tcp_timeout_established").write_text("5\n")
    (netfilter / "nf_conntrack_tcp_timeout_close_wait").write_text("3600\n")
    paths = HostPaths(tmp_path / "sys", tmp_path / "hashsize", tmp_path / "no" / "oom")
    options = parse_options(["--hostname-override=n"], "kube-proxy-nftables", "nftables")
    result = privileged_setup(options, paths)
    assert result.refused == ("net.netfilter.nf_conntrack_max",)
    assert result.written == ("net.netfilter.nf_conntrack_tcp_timeout_established",)
    assert result.unchanged == ("net.netfilter.nf_conntrack_tcp_timeout_close_wait",)
    assert (netfilter / "nf_conntrack_tcp_timeout_established").read_text() == "86400\n"
    assert any(m.startswith("Failed to apply oomScoreAdj -999") for m in caplog.messages)


def test_oom_score_adj(tmp_path: Path) -> None:
    path = tmp_path / "oom_score_adj"
    path.write_text("0\n")
    assert apply_oom_score_adj(-999, path) is True
    assert path.read_text() == "-999\n"
    assert apply_oom_score_adj(-999, tmp_path / "missing" / "file") is False


def test_logging_event_sink(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    sink = LoggingEventSink("node-a")
    sink.starting()
    sink.record(
        "Warning",
        "FailedToStartServiceHealthcheck",
        "Listen",
        "port taken",
        ObjectReference.service("ns", "svc"),
    )
    assert caplog.messages == [
        "Event (not posted: no API server): Normal Starting/StartKubeProxy about Node node-a",
        "Event (not posted: no API server): Warning FailedToStartServiceHealthcheck/Listen"
        " about Service ns/svc: port taken",
    ]


def test_cleanup_failures_reach_the_metric() -> None:
    config = ProxierConfig(node_name="n")
    backend = nftables.NftablesBackend(IPFamily.IPV4, config, executor=FakeNft())
    metrics = ProxyMetrics(mode="nftables", process_metrics=False)
    counter = nft_binary.CleanupFailureCounter(backend, metrics)
    backend.stale_chain_failures += 2
    counter(None, _Snapshot(IPFamily.IPV4), _Changes(False))  # type: ignore[arg-type]
    counter(None, _Snapshot(IPFamily.IPV4), _Changes(False))  # type: ignore[arg-type]
    exposed = metrics.expose().decode()
    line = 'kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total{ip_family="IPv4"} 2'
    assert line in exposed.splitlines()


def test_a_kubeconfig_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "kubeconfig"
    no_context = tmp_path / "no-context.conf"
    no_context.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    for path, why in (
        (missing, "No such file or directory"),
        (tmp_path, "Is a directory"),
        (no_context, "current-context"),
    ):
        result = run_binary("--hostname-override=kpxe-x", f"--kubeconfig={path}")
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("E")]
        assert len(errors) == 1, result.stderr
        assert str(path) in errors[0] and why in errors[0]
    unreadable = run_binary("--hostname-override=kpxe-x", f"--kubeconfig={missing}")
    assert f"cannot read the kubeconfig file {missing}" in unreadable.stderr


# --- manifests: what a one-shot run reports ---------------------------------------------


def _dry_run(
    directory: Path, *argv: str, caplog: pytest.LogCaptureFixture
) -> tuple[int, str, list[str]]:
    """``kube-proxy-nftables --manifests DIR --dry-run ARGV`` in this process: the exit
    code, what it printed and the warnings and errors it logged."""
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        code = binary_run(
            nft_binary.BINARY,
            ["--manifests", str(directory), "--dry-run", *argv],
            out=out,
            seams=DaemonSeams(host_addresses=FakeHostAddresses(), gc_ops=UNTOUCHED),
        )
    finally:  # the binary configured the root logger, as a process does
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    return code, out.getvalue(), problems


def test_once_fails_after_a_manifest_that_did_not_parse_but_syncs_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for path in EXAMPLES.iterdir():
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "broken.yaml").write_text("kind: Service\nmetadata: {name: x\n")
    code, printed, problems = _dry_run(tmp_path, "--hostname-override=demo-node", caplog=caplog)
    assert code == 1
    assert "172.30.0.10 . tcp . 80" in printed  # the valid objects were programmed
    broken = [p for p in problems if "broken.yaml" in p]
    assert len(broken) == 2, problems  # where and why, then the summary that fails the run
    assert "invalid YAML" in broken[0]
    assert broken[1].startswith("Synced what could be used; 1 input problem(s)")
    caplog.clear()
    (tmp_path / "broken.yaml").unlink()
    code, _, problems = _dry_run(tmp_path, "--hostname-override=demo-node", caplog=caplog)
    assert code == 0 and problems == []


def test_manifests_without_this_nodes_node_name_the_nodes_found(
    caplog: pytest.LogCaptureFixture,
) -> None:
    code, printed, problems = _dry_run(EXAMPLES, "--hostname-override=elsewhere", caplog=caplog)
    assert code == 0 and "add table ip kube-proxy" in printed
    assert len(problems) == 1, problems
    assert (
        "holds no Node named elsewhere (--hostname-override) but Nodes demo-node" in (problems[0])
    )
    assert LOOPBACK_MESSAGE not in problems


def test_manifests_without_hostname_override_say_whose_name_was_used() -> None:
    result = run_binary("--manifests", str(EXAMPLES), "--dry-run")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("W")]
    assert len(warnings) == 1, result.stderr
    assert "this host's name (no --hostname-override given)" in warnings[0]
    assert "Nodes demo-node" in warnings[0]


def test_verbose_logs_are_ours_only() -> None:
    argv = [str(BIN), "--manifests", str(EXAMPLES), "--hostname-override=demo-node", "--dry-run"]
    quiet = subprocess.run([*argv, "-v", "4"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    loggers = {line.split()[3] for line in quiet.stderr.splitlines() if line[:1] in "IWE"}
    assert loggers and all(name.startswith("kubeproxy.") for name in loggers), loggers
    # A library named by --vmodule logs again: tests/test_logs.py checks it on the very
    # configuration this binary applies (no library logs on this path any more: the host
    # addresses no longer come through pyroute2).
    asked = subprocess.run(
        [*argv, "-v", "4", "--vmodule=pyroute2*=4"], capture_output=True, text=True, timeout=60
    )
    assert asked.returncode == 0, asked.stderr
