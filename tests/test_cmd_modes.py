"""The four binaries and their modes: fixed modes, the multi-mode default, the ipvs
deprecation (log, Event, metric), backend-specific metrics, --dry-run per mode, and
cleanup across modes (upstream's platformCleanup and --cleanup).

The daemon runs in this process against the fake API server, with stand-in backends (the
in-memory nftables fake) so that every mode can start on this kernel; the cleanups are
recorded, never run on the host. The real backends' cleanups are exercised in network
namespaces by test_mode_switch.py.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.backend import Backend, BackendFactory, SyncError
from kubeproxy.backends import nftables
from kubeproxy.backends.nftables.fake import FakeNft
from kubeproxy.cmd import iptables as iptables_binary
from kubeproxy.cmd import ipvs as ipvs_binary
from kubeproxy.cmd import multimode
from kubeproxy.cmd import nftables as nftables_binary
from kubeproxy.cmd.binary import IPVS_DEPRECATION_MESSAGE, Binary, run
from kubeproxy.cmd.commandline import MODE_DEFAULTED_MESSAGE
from kubeproxy.cmd.modes import (
    MODES,
    BackendCounters,
    Mode,
    cleanup_all,
    cleanup_modes,
    iptables_hooks,
    nftables_hooks,
    platform_cleanup,
)
from kubeproxy.config import ProxierConfig
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import DaemonPlugins, DaemonSeams
from kubeproxy.daemon.sources import SourceTuning
from kubeproxy.host import capabilities
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.metrics import ProxyMetrics
from kubeproxy.objects import IPFamily
from kubeproxy.proxier import FinishedSync
from kubeproxy.testing.fakeapi import FakeAPIServer, endpoint_slice, node, service
from tests.gcops import UNTOUCHED

NODE = "kpxm-node"
BRISK = SourceTuning(watch_timeout=5.0, request_timeout=5.0, initial_backoff=0.05, max_backoff=0.3)
BIN = Path(sys.executable).parent
BINARIES = [nftables_binary.BINARY, iptables_binary.BINARY, ipvs_binary.BINARY, multimode.BINARY]
V4 = IPFamily.IPV4
# The daemon tunes the garbage collector after its first full sync: not this process's.
NO_GC = UNTOUCHED


# --- stand-ins ----------------------------------------------------------------------------


class StandIns:
    """A mode table whose backends are nftables fakes and whose cleanups are recorded."""

    def __init__(
        self,
        fail_cleanup: Mapping[str, Exception] | None = None,
        fail_create: Mapping[str, Exception] | None = None,
    ) -> None:
        self.created: list[tuple[str, IPFamily]] = []
        self.cleaned: list[str] = []
        self.steps: list[str] = []  # creations and cleanups, in order
        self.fakes: list[FakeNft] = []
        self.fail_cleanup = dict(fail_cleanup or {})
        self.fail_create = dict(fail_create or {})
        self.on_clean: Callable[[], object] = lambda: None  # called as a cleanup starts
        self.modes = {name: self._mode(mode) for name, mode in MODES.items()}

    def _mode(self, real: Mode) -> Mode:
        def factory() -> BackendFactory:
            def create(
                family: IPFamily, config: ProxierConfig, *, netns: str | None = None
            ) -> Backend:
                if real.name in self.fail_create:
                    raise self.fail_create[real.name]
                self.created.append((real.name, family))
                self.steps.append(f"create {real.name}")
                fake = FakeNft()
                self.fakes.append(fake)
                return nftables.NftablesBackend(family, config, executor=fake)

            return create

        def cleanup(netns: str | None) -> None:
            self.on_clean()
            self.cleaned.append(real.name)
            self.steps.append(f"clean {real.name}")
            if real.name in self.fail_cleanup:
                raise self.fail_cleanup[real.name]

        return Mode(real.name, factory, cleanup, real.hooks, real.dry_run)


@pytest.fixture
def fake() -> Iterator[FakeAPIServer]:
    with FakeAPIServer(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """run() configures the root logger, as a binary does; put it back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)


class StopWhen:
    """SIGTERM this process (the running binary's handler stops it) once ``check`` holds,
    or after ``timeout`` seconds unless :meth:`done` was called (the binary returned).

    ``to_this_thread``: the signal goes to the watcher's own thread, not the main one,
    as the kernel may deliver a process's signal; :attr:`stopped_after` says how long the
    binary took to return then (a process-wide SIGTERM follows after 10 s, so a binary
    that missed it cannot hang the test)."""

    def __init__(
        self, check: Callable[[], bool], timeout: float = 20.0, *, to_this_thread: bool = False
    ) -> None:
        self.check = check
        self.timeout = timeout
        self.to_this_thread = to_this_thread
        self.stopped_after: float | None = None
        self._returned = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not self.check():
            if self._returned.wait(0.05):
                return
            if time.monotonic() > deadline:
                break
        if self._returned.is_set():
            return
        if self.to_this_thread:
            sent = time.monotonic()
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            if self._returned.wait(10):
                self.stopped_after = time.monotonic() - sent
                return
        os.kill(os.getpid(), signal.SIGTERM)

    def done(self) -> None:
        self._returned.set()
        self._thread.join(30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def reasons(fake: FakeAPIServer) -> list[str]:
    return [event["reason"] for event in fake.posted_events]


def serve_cluster(fake: FakeAPIServer) -> None:
    fake.apply(node(NODE, addresses=["203.0.113.7"]))
    fake.apply(service("web", cluster_ip="172.30.0.10"))
    fake.apply(endpoint_slice("web-a", "web", node_name=NODE))


def run_against(
    fake: FakeAPIServer,
    binary: Binary,
    stand_ins: StandIns,
    *argv: str,
    until: Callable[[], bool] | None = None,
    metrics_bind: str = "",
) -> tuple[int, list[dict[str, Any]]]:
    """Run ``binary`` in this process until ``until`` holds (by default: until Starting has
    been posted and, after the first sync, the other modes' leftovers removed); (exit
    code, events)."""
    watcher = StopWhen(until or (lambda: "Starting" in reasons(fake) and bool(stand_ins.cleaned)))
    code = run(
        binary,
        [
            "--master",
            fake.url,
            "--kube-api-content-type=application/json",
            "--hostname-override",
            NODE,
            "--healthz-bind-address=",
            f"--metrics-bind-address={metrics_bind}",
            *argv,
        ],
        modes=stand_ins.modes,
        seams=api_seams(),
    )
    watcher.done()
    return code, fake.posted_events


# --- fixed modes and the multi-mode default -----------------------------------------------


@pytest.mark.parametrize("binary", BINARIES[:3], ids=lambda b: b.prog)
def test_a_fixed_mode_binary_refuses_another_mode_in_the_file(
    binary: Binary, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = "nftables" if binary.fixed_mode != "nftables" else "iptables"
    config = tmp_path / "config.conf"
    config.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        f"mode: {other}\n"
    )
    assert run(binary, ["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{binary.prog}: --config {config}: mode: {binary.prog} always runs in "
        f"{binary.fixed_mode} mode, got {other!r} (leave mode unset or set it to "
        f"{binary.fixed_mode})"
    ]


@pytest.mark.parametrize("binary", BINARIES, ids=lambda b: b.prog)
def test_every_binary_is_installed_with_its_help(binary: Binary) -> None:
    result = subprocess.run(
        [str(BIN / binary.prog), "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {binary.prog} ")
    what = f"({binary.fixed_mode} mode)" if binary.fixed_mode else "(iptables, ipvs or nftables"
    assert what in result.stdout


def test_multimode_without_a_mode_warns_posts_an_event_and_runs_iptables(
    fake: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    code, events = run_against(fake, multimode.BINARY, stand_ins)
    assert code == 0
    assert stand_ins.created == [("iptables", V4)]
    # Starting in iptables mode removes the nftables mode's tables, nothing else.
    assert stand_ins.cleaned == ["nftables"]
    defaulted = [e for e in events if e["reason"] == "ProxyModeDefaulted"]
    assert len(defaulted) == 1
    assert defaulted[0]["type"] == "Warning" and defaulted[0]["action"] == "ProxyModeCheck"
    assert defaulted[0]["note"] == MODE_DEFAULTED_MESSAGE
    assert defaulted[0]["regarding"]["kind"] == "Node"
    assert defaulted[0]["regarding"]["name"] == NODE
    assert reasons(fake).index("ProxyModeDefaulted") < reasons(fake).index("Starting")
    assert "IPVSDeprecation" not in reasons(fake)
    assert MODE_DEFAULTED_MESSAGE in caplog.messages


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_multimode_with_an_explicit_mode_says_nothing_of_it(
    fake: FakeAPIServer, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    code, _ = run_against(fake, multimode.BINARY, stand_ins, f"--proxy-mode={mode}")
    assert code == 0
    assert stand_ins.created == [(mode, V4)]
    assert stand_ins.cleaned == (["iptables", "ipvs"] if mode == "nftables" else ["nftables"])
    assert reasons(fake) == ["Starting"]
    assert MODE_DEFAULTED_MESSAGE not in caplog.messages


@pytest.mark.parametrize(
    ("binary", "argv"),
    [(ipvs_binary.BINARY, ()), (multimode.BINARY, ("--proxy-mode=ipvs",))],
    ids=["kube-proxy-ipvs", "kube-proxy"],
)
def test_ipvs_logs_the_deprecation_and_posts_the_event(
    fake: FakeAPIServer,
    binary: Binary,
    argv: tuple[str, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    code, events = run_against(fake, binary, stand_ins, *argv)
    assert code == 0
    assert stand_ins.created == [("ipvs", V4)]
    assert stand_ins.cleaned == ["nftables"]
    deprecation = [e for e in events if e["reason"] == "IPVSDeprecation"]
    assert len(deprecation) == 1
    assert deprecation[0]["type"] == "Warning"
    assert deprecation[0]["action"] == "ProxyModeCheck"
    assert deprecation[0]["note"] == IPVS_DEPRECATION_MESSAGE
    assert deprecation[0]["regarding"] == {
        "kind": "Node",
        "name": NODE,
        "uid": NODE,
        "apiVersion": "v1",
    }
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert IPVS_DEPRECATION_MESSAGE in [r.getMessage() for r in warnings]
    assert "ProxyModeDefaulted" not in reasons(fake)


def test_ipvs_mode_sets_the_deprecated_mode_metric(fake: FakeAPIServer) -> None:
    # The metric from the daemon's own metrics server, as a scrape sees it.
    serve_cluster(fake)
    stand_ins = StandIns()
    seen: list[str] = []
    port = free_port()

    def scraped() -> bool:
        if "Starting" not in reasons(fake):
            return False
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            seen.append(resp.read().decode())
        return True

    code, _ = run_against(
        fake, ipvs_binary.BINARY, stand_ins, until=scraped, metrics_bind=f"127.0.0.1:{port}"
    )
    assert code == 0
    assert 'kubeproxy_deprecated_proxy_mode{mode="ipvs"} 1' in seen[0].splitlines()


def api_seams() -> DaemonSeams:
    """Fakes for the host, a brisk source, one family: these tests are about modes."""
    return DaemonSeams(
        host_addresses=FakeHostAddresses(),
        gc_ops=NO_GC,
        conntrack=FakeConntrack(),
        privileged=False,
        tuning=BRISK,
        ipv6_supported=False,
    )


def run_once(fake: FakeAPIServer, binary: Binary, stand_ins: StandIns) -> int:
    """``binary --once`` against the fake API server's cluster; the exit code."""
    serve_cluster(fake)
    return run(
        binary,
        ["--master", fake.url, "--hostname-override", NODE, "--once"],
        modes=stand_ins.modes,
        seams=api_seams(),
    )


def test_a_sigterm_another_thread_receives_stops_the_daemon(
    fake: FakeAPIServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The kernel hands a process's SIGTERM to any thread that does not block it; Python
    # runs the handler in the main thread, which must not sleep through it (it did: the
    # DaemonSet's pod then waits out its grace period and is killed).
    serve_cluster(fake)
    watcher = StopWhen(lambda: "Starting" in reasons(fake), to_this_thread=True)
    code = run(
        nftables_binary.BINARY,
        [
            "--master",
            fake.url,
            "--kube-api-content-type=application/json",
            "--hostname-override",
            NODE,
            "--healthz-bind-address=",
            "--metrics-bind-address=",
        ],
        modes=StandIns().modes,
        seams=api_seams(),
    )
    watcher.done()
    assert code == 0
    assert watcher.stopped_after is not None, "only the process-wide SIGTERM stopped it"
    assert "Received signal 15, stopping (rules stay in place)" in caplog.messages


def test_once_posts_no_mode_events(fake: FakeAPIServer) -> None:
    assert run_once(fake, ipvs_binary.BINARY, StandIns()) == 0
    assert fake.posted_events == []


def dry_run(binary: Binary) -> str:
    """What ``binary --dry-run`` over examples/cluster prints (it must exit 0)."""
    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    out = io.StringIO()
    code = run(
        binary,
        ["--manifests", str(examples), "--hostname-override", "demo-node", "--dry-run"],
        out=out,
        seams=DaemonSeams(host_addresses=FakeHostAddresses(), gc_ops=NO_GC),
    )
    assert code == 0
    return out.getvalue()


def test_dry_run_prints_every_executors_work_in_ipvs_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = dry_run(ipvs_binary.BINARY)
    lines = text.splitlines()
    assert "add vs 172.30.0.10:80/TCP rr flags=0x0 timeout=0" in lines
    assert "add rs 172.30.0.10:80/TCP -> 10.244.0.12:8080 weight=1" in lines
    assert "add address 172.30.0.10 dev kube-ipvs0" in lines
    assert "add KUBE-CLUSTER-IP 172.30.0.10,tcp:80" in lines
    assert "# iptables-restore --noflush" in lines
    # The deprecation is said once, and the dry run posts no event anywhere.
    assert caplog.messages.count(IPVS_DEPRECATION_MESSAGE) == 1


# --- cleanup across modes -----------------------------------------------------------------


@pytest.mark.parametrize("binary", BINARIES, ids=lambda b: b.prog)
def test_cleanup_removes_every_modes_leftovers_from_any_binary(binary: Binary) -> None:
    stand_ins = StandIns()
    assert run(binary, ["--cleanup"], modes=stand_ins.modes) == 0
    assert stand_ins.cleaned == ["nftables", "iptables", "ipvs"]
    assert stand_ins.created == []


def test_cleanup_without_ip_vs_in_the_kernel_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.cmd.modes")
    stand_ins = StandIns({"ipvs": OSError("kernel lacks IP_VS (no ip_vs genetlink family)")})
    assert cleanup_all(stand_ins.modes) == 0
    assert stand_ins.cleaned == ["nftables", "iptables", "ipvs"]
    assert (
        "Nothing to clean up for ipvs mode: kernel lacks IP_VS (no ip_vs genetlink family)"
        in caplog.messages
    )


def test_a_cleanup_error_is_one_line_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stand_ins = StandIns({"iptables": RuntimeError("iptables-restore: line 2 failed\n  -X KUBE-X")})
    assert run(multimode.BINARY, ["--cleanup"], modes=stand_ins.modes) == 1
    # The failed one is tried once more after the others (they share chain names: what
    # one cannot delete another's chains may have held).
    assert stand_ins.cleaned == ["nftables", "iptables", "ipvs", "iptables"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["Cleanup failed: iptables mode: iptables-restore: line 2 failed -X KUBE-X"]


@pytest.mark.parametrize(
    ("mode", "cleaned"),
    [
        ("nftables", ["iptables", "ipvs"]),
        ("iptables", ["nftables"]),
        ("ipvs", ["nftables"]),
    ],
)
def test_platform_cleanup_removes_the_other_kind_of_mode(mode: str, cleaned: list[str]) -> None:
    stand_ins = StandIns()
    assert platform_cleanup(mode, stand_ins.modes) == []
    assert stand_ins.cleaned == cleaned


def test_a_failing_platform_cleanup_is_a_warning_only(caplog: pytest.LogCaptureFixture) -> None:
    stand_ins = StandIns({"iptables": FileNotFoundError(2, "No such file", "iptables-save")})
    errors = platform_cleanup("nftables", stand_ins.modes)
    assert stand_ins.cleaned == ["iptables", "ipvs", "iptables"]
    assert len(errors) == 1 and errors[0].startswith("iptables mode: ")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        f"Could not remove another mode's leftovers: {errors[0]}"
    ]


def test_a_cleanup_that_another_modes_chains_held_up_works_the_second_time() -> None:
    stand_ins = StandIns({"iptables": RuntimeError("delete chain KUBE-MARK-MASQ: busy")})
    real = stand_ins.modes["iptables"].cleanup

    def once_busy(netns: str | None) -> None:
        try:
            real(netns)
        finally:
            stand_ins.fail_cleanup.pop("iptables", None)  # ipvs mode's chains go next

    modes = {
        **stand_ins.modes,
        "iptables": dataclasses.replace(stand_ins.modes["iptables"], cleanup=once_busy),
    }
    assert platform_cleanup("nftables", modes) == []
    assert stand_ins.cleaned == ["iptables", "ipvs", "iptables"]


def test_cleanup_modes_reports_each_failure() -> None:
    stand_ins = StandIns({"nftables": ValueError("boom"), "ipvs": ValueError("")})
    errors = cleanup_modes(stand_ins.modes.values())
    assert errors == ["nftables mode: boom", "ipvs mode: ValueError"]


# --- backend-specific metrics -------------------------------------------------------------


class CountingBackend:
    """What an iptables-restore based backend exposes for the metrics."""

    def __init__(self, family: IPFamily = V4) -> None:
        self.family = family
        self.restore_failures = 0
        self.partial_restore_failures = 0
        self.rules_total: dict[str, int] = {}
        self.rules_last: dict[str, int] = {}


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, labels)
    return value


def test_backend_counters_feed_the_iptables_metrics() -> None:
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    backend = CountingBackend()
    backend.restore_failures = 5  # before the hook existed: not ours to count
    hooks = iptables_hooks(backend, metrics)  # type: ignore[arg-type]
    assert len(hooks) == 1 and isinstance(hooks[0], BackendCounters)
    counters = hooks[0]
    # A partial restore failed, the full one repaired it: the sync succeeded.
    backend.restore_failures += 1
    backend.partial_restore_failures += 1
    backend.rules_total = {"filter": 7, "nat": 40}
    backend.rules_last = {"filter": 7, "nat": 12}
    counters.sync_finished(FinishedSync(V4, False, 0.01, None, 3, 3))
    # The next sync failed outright (the metrics do not count it a second time).
    backend.restore_failures += 1
    metrics.sync_finished(FinishedSync(V4, True, 0.01, SyncError("refused"), 3, 3))
    counters.sync_finished(FinishedSync(V4, True, 0.01, SyncError("refused"), 3, 3))
    # Another family's sync is not this backend's.
    backend.restore_failures += 1
    counters.sync_finished(FinishedSync(IPFamily.IPV6, True, 0.01, None, 0, 0))
    prefix = "kubeproxy_sync_proxy_rules_iptables"
    v4 = {"ip_family": "IPv4"}
    assert sample(metrics, f"{prefix}_restore_failures_total", **v4) == 2
    assert sample(metrics, f"{prefix}_partial_restore_failures_total", **v4) == 1
    assert sample(metrics, f"{prefix}_total", table="nat", **v4) == 40
    assert sample(metrics, f"{prefix}_last", table="nat", **v4) == 12
    assert sample(metrics, f"{prefix}_last", table="filter", **v4) == 7
    assert sample(metrics, f"{prefix}_restore_failures_total", ip_family="IPv6") is None


def test_ipvs_counts_restore_failures_only() -> None:
    metrics = ProxyMetrics(mode="ipvs", process_metrics=False)

    class IPVSLike:
        family = V4
        restore_failures = 0

    backend = IPVSLike()
    (counters,) = iptables_hooks(backend, metrics)  # type: ignore[arg-type]
    backend.restore_failures = 3
    assert isinstance(counters, BackendCounters)
    counters.sync_finished(FinishedSync(V4, True, 0.01, None, 0, 0))
    name = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
    assert sample(metrics, name, ip_family="IPv4") == 3


def test_hooks_ignore_backends_without_counters() -> None:
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    backend = nftables.NftablesBackend(V4, ProxierConfig(node_name="n"), executor=FakeNft())
    assert iptables_hooks(backend, metrics) == ()
    assert len(nftables_hooks(backend, metrics)) == 2  # the cleanup counter, the sweeper
    assert nftables_hooks(CountingBackend(), metrics) == ()  # type: ignore[arg-type]


def test_dry_run_output_goes_to_out_in_nftables_mode() -> None:
    text = dry_run(nftables_binary.BINARY)
    assert "add table ip kube-proxy" in text
    assert "172.30.0.10 . tcp . 80" in text


def test_dry_run_prints_the_restore_inputs_in_iptables_mode() -> None:
    text = dry_run(iptables_binary.BINARY)
    assert text.startswith("# iptables-restore --noflush\n*")
    assert "\n*nat\n" in text and "\n*filter\n" in text and "\nCOMMIT\n" in text
    assert ":KUBE-SERVICES - [0:0]" in text
    assert "-d 172.30.0.10 --dport 80 -j KUBE-SVC-" in text


def test_the_iptables_backends_counts_reach_the_daemons_metrics() -> None:
    from kubeproxy.backends.iptables import IptablesBackend
    from kubeproxy.backends.iptables.fake import FakeIptables
    from kubeproxy.cmd.commandline import parse_options
    from kubeproxy.daemon import build_daemon

    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    backends: list[IptablesBackend] = []

    def factory(family: IPFamily, config: ProxierConfig, *, netns: str | None = None) -> Backend:
        fake = FakeIptables()
        fake.fail_next()  # the first restore fails; the proxier retries with a full sync
        backends.append(IptablesBackend(family, config, executor=fake))
        return backends[-1]

    options = parse_options(
        ["--manifests", str(examples), "--hostname-override", "demo-node"],
        "kube-proxy-iptables",
        "iptables",
    )
    daemon = build_daemon(
        options,
        factory,
        plugins=DaemonPlugins(mode="iptables", backend_hooks=MODES["iptables"].hooks),
        seams=DaemonSeams(
            host_addresses=FakeHostAddresses(),
            conntrack=FakeConntrack(),
            privileged=False,
            ipv6_supported=False,
            gc_ops=NO_GC,
        ),
    )
    try:
        daemon.sync_once()
        assert daemon.handler.sync_now()
    finally:
        daemon.stop()
    (backend,) = backends
    assert backend.restore_failures == 1
    metrics = daemon.metrics
    v4 = {"ip_family": "IPv4"}
    prefix = "kubeproxy_sync_proxy_rules_iptables"
    # The failed restore counted once (from the backend, not again as a failed sync).
    assert sample(metrics, f"{prefix}_restore_failures_total", **v4) == 1
    for table in ("nat", "filter"):
        total = sample(metrics, f"{prefix}_total", table=table, **v4)
        last = sample(metrics, f"{prefix}_last", table=table, **v4)
        assert (total, last) == (backend.rules_total[table], backend.rules_last[table])
    assert backend.rules_total["nat"] >= 10  # three Services' chains and rules


@given(
    st.lists(
        st.tuples(
            st.sampled_from([IPFamily.IPV4, IPFamily.IPV6]),
            st.integers(0, 3),  # restores failed before this sync finished
            st.integers(0, 2),  # of which partial
            st.booleans(),  # the sync failed
        ),
        max_size=20,
    ),
    st.integers(0, 5),
)
def test_backend_counters_count_each_failure_once_per_family(
    syncs: list[tuple[IPFamily, int, int, bool]], before: int
) -> None:
    metrics = ProxyMetrics(mode="iptables", process_metrics=False)
    backends = {family: CountingBackend(family) for family in (IPFamily.IPV4, IPFamily.IPV6)}
    for backend in backends.values():
        backend.restore_failures = backend.partial_restore_failures = before
    counters = {family: BackendCounters(b, metrics) for family, b in backends.items()}
    for family, failed, partial_failed, sync_failed in syncs:
        backend = backends[family]
        backend.restore_failures += failed
        backend.partial_restore_failures += min(partial_failed, failed)
        error = SyncError("refused") if sync_failed else None
        # Every observer hears every family's syncs, as in the daemon.
        metrics.sync_finished(FinishedSync(family, True, 0.01, error, 0, 0))
        for observer in counters.values():
            observer.sync_finished(FinishedSync(family, True, 0.01, error, 0, 0))
    for family, backend in backends.items():
        labels = {"ip_family": family.value}
        prefix = "kubeproxy_sync_proxy_rules_iptables"
        restore = sample(metrics, f"{prefix}_restore_failures_total", **labels)
        partial = sample(metrics, f"{prefix}_partial_restore_failures_total", **labels)
        assert (restore or 0) == backend.restore_failures - before
        assert (partial or 0) == backend.partial_restore_failures - before


# --- a start that cannot succeed removes nothing ------------------------------------------


def test_other_modes_are_removed_only_once_this_modes_backends_exist(fake: FakeAPIServer) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    code, _ = run_against(fake, nftables_binary.BINARY, stand_ins)
    assert code == 0
    assert stand_ins.steps == ["create nftables", "clean iptables", "clean ipvs"]


@pytest.mark.parametrize(
    ("binary", "mode"),
    [
        (ipvs_binary.BINARY, "ipvs"),
        (nftables_binary.BINARY, "nftables"),
        (iptables_binary.BINARY, "iptables"),
    ],
    ids=lambda v: getattr(v, "prog", v),
)
def test_a_mode_that_cannot_run_removes_nothing(
    fake: FakeAPIServer, binary: Binary, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    serve_cluster(fake)
    why = {
        "ipvs": OSError("kernel lacks IP_VS (no ip_vs genetlink family)"),
        "nftables": OSError("cannot load libnftables.so.1 (install nftables)"),
        "iptables": OSError("iptables-nft-restore is not installed"),
    }[mode]
    stand_ins = StandIns(fail_create={mode: why})
    code, _ = run_against(fake, binary, stand_ins, until=lambda: False)
    assert code == 1
    assert stand_ins.cleaned == []
    assert "Starting" not in reasons(fake)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"cannot set up the IPv4 backend: {why}"]


def test_a_server_that_cannot_bind_with_hard_fail_removes_nothing(fake: FakeAPIServer) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _ = run_against(
            fake,
            nftables_binary.BINARY,
            stand_ins,
            "--bind-address-hard-fail",
            until=lambda: False,
            metrics_bind=f"127.0.0.1:{port}",
        )
    assert code == 1
    # The servers listen first of all (a daemon answers /livez from its first second):
    # one that cannot bind stops the start before any backend exists.
    assert stand_ins.created == []
    assert stand_ins.cleaned == []
    assert "FailedToStartMetricServer" in reasons(fake)


def test_once_removes_the_other_modes_after_its_sync(fake: FakeAPIServer) -> None:
    stand_ins = StandIns()
    synced_first: list[bool] = []
    stand_ins.on_clean = lambda: synced_first.append(bool(stand_ins.fakes[0].transactions))
    assert run_once(fake, iptables_binary.BINARY, stand_ins) == 0
    assert stand_ins.steps == ["create iptables", "clean nftables"]
    # The previous proxy's rules serve until ours are in: the sync came first.
    assert synced_first == [True]


def test_a_process_without_the_modes_capabilities_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tkube-proxy\nCapEff:\t0000000000002000\n")  # CAP_NET_RAW only
    monkeypatch.setattr(
        "kubeproxy.cmd.binary.missing_capabilities",
        functools.partial(capabilities.missing_capabilities, status=status),
    )
    stand_ins = StandIns()
    modes = {
        name: dataclasses.replace(mode, capabilities=MODES[name].capabilities)
        for name, mode in stand_ins.modes.items()
    }
    for argv in (["--cleanup"], ["--manifests", str(tmp_path), "--once"]):
        caplog.clear()
        assert run(nftables_binary.BINARY, argv, modes=modes) == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1
        assert "needs CAP_NET_ADMIN" in errors[0] and "lacks CAP_NET_ADMIN" in errors[0]
    assert stand_ins.steps == []
    # --dry-run touches no kernel: no capability needed.
    out = io.StringIO()
    examples = Path(__file__).resolve().parent.parent / "examples" / "cluster"
    argv = ["--manifests", str(examples), "--hostname-override", "demo-node", "--dry-run"]
    assert (
        run(nftables_binary.BINARY, argv, modes=modes, out=out, seams=DaemonSeams(gc_ops=NO_GC))
        == 0
    )
    assert "add table ip kube-proxy" in out.getvalue()


def test_configz_serves_the_effective_configuration(fake: FakeAPIServer) -> None:
    serve_cluster(fake)
    stand_ins = StandIns()
    port = free_port()
    seen: list[Any] = []

    def scraped() -> bool:
        if "Starting" not in reasons(fake):
            return False
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/configz", timeout=5) as resp:
            seen.append((resp.headers["Content-Type"], json.loads(resp.read())))
        return True

    code, _ = run_against(
        fake,
        nftables_binary.BINARY,
        stand_ins,
        "--conntrack-min=4242",
        until=scraped,
        metrics_bind=f"127.0.0.1:{port}",
    )
    assert code == 0
    content_type, body = seen[0]
    assert content_type == "application/json"
    config = body["kubeproxy.config.k8s.io"]
    assert config["apiVersion"] == "kubeproxy.config.k8s.io/v1alpha1"
    assert config["kind"] == "KubeProxyConfiguration"
    assert config["mode"] == "nftables"
    assert config["hostnameOverride"] == NODE
    assert config["conntrack"]["min"] == 4242
    assert config["metricsBindAddress"] == f"127.0.0.1:{port}"
