"""The daemon as an out-of-tree proxy uses it: options from a configuration, a backend of
its own, and what it plugs in (its name, metrics, health conditions, Events).

No kernel: the backend records what it is given, the source is the example cluster's
manifests directory, the servers listen on free ports of 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter

import kubeproxy
import kubeproxy.daemon
from kubeproxy import (
    BackendContext,
    DaemonOptions,
    IPFamily,
    ProxierConfig,
    ProxySnapshot,
    StartupError,
    SyncChanges,
    build_daemon,
    run_daemon,
)
from kubeproxy.cmd.commandline import Options, parse_options
from kubeproxy.configfile.codec import parse_config
from kubeproxy.configfile.model import ConfigError, defaults
from kubeproxy.conntrack import FakeConntrack
from kubeproxy.daemon import DaemonPlugins, DaemonSeams, LoggingEventSink
from kubeproxy.daemon.gctuning import GcOps
from kubeproxy.events import FakeEventRecorder
from kubeproxy.host.netlink import FakeHostAddresses
from kubeproxy.proxier import Proxier, SyncHook, SyncObserver
from tests.gcops import UNTOUCHED, recording_gc

CLUSTER = Path(__file__).resolve().parent.parent / "examples" / "cluster"


class RecordingBackend:
    """Keeps the Service ports of every sync."""

    def __init__(self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None):
        self.family = family
        self.config = config
        self.synced: list[set[str]] = []

    def sync(self, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
        self.synced.append({f"{name} {port}" for name, port in snapshot.services.items()})

    def cleanup(self) -> None:
        pass


class Backends:
    def __init__(self) -> None:
        self.made: list[RecordingBackend] = []

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> RecordingBackend:
        backend = RecordingBackend(family, config, netns=netns)
        self.made.append(backend)
        return backend


def local_servers(options: DaemonOptions) -> DaemonOptions:
    """The servers on free ports of 127.0.0.1 (port 0 is the kernel's pick; validation
    wants a real port, so the configuration is edited afterwards)."""
    configuration = dataclasses.replace(
        options.configuration,
        healthz_bind_address="127.0.0.1:0",
        metrics_bind_address="127.0.0.1:0",
    )
    return dataclasses.replace(options, configuration=configuration)


def cluster_options(**fields: Any) -> DaemonOptions:
    configuration = dataclasses.replace(defaults(), hostname_override="demo-node")
    options = DaemonOptions.from_configuration(
        configuration, mode="nftables", manifests=CLUSTER, **fields
    )
    return local_servers(options)


# The collector's tuning is the process's: a test records it instead of freezing pytest's.
GC_UNTOUCHED = UNTOUCHED


def offline(privileged: bool = True, gc_ops: GcOps = GC_UNTOUCHED) -> DaemonSeams:
    """What the daemon is given here besides options and factory: no kernel, no host."""
    return DaemonSeams(
        host_addresses=FakeHostAddresses(),
        conntrack=FakeConntrack(),
        ipv6_supported=False,
        gc_ops=gc_ops,
        privileged=privileged,
    )


def get(port: int | None, path: str) -> tuple[int, str]:
    assert port is not None, "server not bound"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# --- options ------------------------------------------------------------------------------


def test_options_from_a_configuration_are_settled_as_upstream_settles_them() -> None:
    configuration = dataclasses.replace(defaults(), hostname_override="Node-A")
    options = DaemonOptions.from_configuration(configuration, mode="nftables")
    assert options.node_name == "node-a"
    assert options.configuration.mode == "nftables"
    # nftables mode: the nftables section's periods, nodePortAddresses [primary].
    assert options.config.node_port_addresses == ("primary",)
    assert options.config.sync_period == configuration.nftables.sync_period.seconds
    iptables = DaemonOptions.from_configuration(configuration, mode="iptables")
    assert iptables.config.node_port_addresses == ()
    assert options.manifests is None and not options.once and options.master == ""


def test_options_name_the_host_when_no_override_is_given() -> None:
    options = DaemonOptions.from_configuration(defaults(), get_hostname=lambda: "Host-7")
    assert options.node_name == "host-7"
    assert options.configuration.mode == "iptables", "upstream's default mode"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("mode: userspace", "mode"),
        ("oomScoreAdj: 5000", "oomScoreAdj"),
        ("healthzBindAddress: nowhere:port", "healthzBindAddress"),
    ],
)
def test_a_bad_configuration_names_its_field(text: str, field: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        f"apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{text}\n"
    )
    with pytest.raises(ConfigError) as raised:
        DaemonOptions.from_file(path, get_hostname=lambda: "node")
    assert field in str(raised.value)


def test_an_empty_node_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="hostnameOverride"):
        DaemonOptions.from_configuration(defaults(), get_hostname=lambda: " ")


def test_the_binaries_options_are_daemon_options() -> None:
    options = parse_options(["--hostname-override", "n1"], "kube-proxy-nftables", "nftables")
    assert isinstance(options, Options) and isinstance(options, DaemonOptions)
    settled = DaemonOptions.from_configuration(
        parse_config(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
            "hostnameOverride: n1\nmode: nftables\n"
        )
    )
    assert options.config == settled.config and options.node_name == settled.node_name


def test_the_daemon_is_public() -> None:
    for name in (
        "run_daemon",
        "build_daemon",
        "Daemon",
        "DaemonOptions",
        "DaemonPlugins",
        "DaemonSeams",
        "BackendContext",
    ):
        assert name in kubeproxy.__all__ and name in dir(kubeproxy)
        assert getattr(kubeproxy, name) is getattr(kubeproxy.daemon, name)


def test_importing_the_core_leaves_the_daemon_until_it_is_used() -> None:
    script = (
        "import sys, kubeproxy\n"
        "print('kubeproxy.daemon' in sys.modules, 'prometheus_client' in sys.modules)\n"
        "from kubeproxy import DaemonOptions\n"
        "print('kubeproxy.daemon' in sys.modules)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert ran.stdout.split() == ["False", "False", "True"]


# --- a proxy of one's own -----------------------------------------------------------------


class Plugged:
    """A proxy's own hooks: a counter of its syncs, and a health condition."""

    def __init__(self) -> None:
        self.contexts: list[BackendContext] = []
        self.counter: Counter | None = None

    def __call__(self, context: BackendContext) -> Iterable[SyncHook | SyncObserver]:
        self.contexts.append(context)
        if self.counter is None:
            self.counter = Counter(
                "myproxy_syncs_total", "Syncs of my proxy", registry=context.metrics.registry
            )
        counter = self.counter

        def count(proxier: Proxier, snapshot: ProxySnapshot, changes: SyncChanges) -> None:
            counter.inc()

        return (count,)


def test_a_proxy_plugs_in_its_name_metrics_health_and_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kubeproxy.daemon")
    backends = Backends()
    plugged = Plugged()
    events = FakeEventRecorder("demo-node")
    daemon = build_daemon(
        cluster_options(),
        backends,
        plugins=DaemonPlugins(name="my-proxy", backend_hooks=plugged),
        seams=dataclasses.replace(offline(privileged=False), events=events),
    )
    try:
        (context,) = plugged.contexts
        assert context.backend is backends.made[0] and context.family is IPFamily.IPV4
        assert context.metrics is daemon.metrics and context.health is daemon.health
        assert context.events is events
        daemon.start()
        wait_for(lambda: bool(backends.made[0].synced), "the first sync")
        assert "demo/web:http 172.30.0.10:80/TCP" in backends.made[0].synced[0]
        assert "my-proxy started for node demo-node" in caplog.messages
        assert 'my-proxy running in single-stack mode ipFamily="IPv4"' in caplog.messages
        assert "Using nftables Proxier" in caplog.messages
        assert events.reasons() == ["Starting"]

        # Its own metric, next to upstream's.
        code, metrics = get(daemon.metrics_server.port, "/metrics")
        counted = re.search(r"^myproxy_syncs_total (\d+)$", metrics, re.MULTILINE)
        assert code == 200 and counted is not None and int(counted.group(1)) >= 1
        assert "kubeproxy_sync_proxy_rules_duration_seconds_count" in metrics

        # Its own health condition: /healthz answers 503 with the reason until repaired.
        context.health.report_data_plane_broken(IPFamily.IPV4, "my-map", "my BPF map is full")
        code, body = get(daemon.health_server.port, "/healthz")
        assert code == 503 and json.loads(body)["reason"] == "IPv4: my BPF map is full"
        assert get(daemon.health_server.port, "/livez")[0] == 200
        context.health.report_data_plane_repaired(IPFamily.IPV4, "my-map")
        assert get(daemon.health_server.port, "/healthz")[0] == 200
    finally:
        daemon.stop()
    assert "my-proxy stopped; the rules stay in place" in caplog.messages


def test_without_an_api_server_events_are_logged() -> None:
    daemon = build_daemon(cluster_options(), Backends(), seams=offline(privileged=False))
    try:
        assert isinstance(daemon.events, LoggingEventSink)
    finally:
        daemon.stop()


def test_run_daemon_once_returns_the_exit_code() -> None:
    backends = Backends()
    code = run_daemon(cluster_options(once=True), backends, seams=offline())
    assert code == 0
    assert "demo/web:http 172.30.0.10:80/TCP" in backends.made[0].synced[-1]


def test_a_backend_that_cannot_be_made_stops_the_start() -> None:
    def broken(
        family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> RecordingBackend:
        raise OSError("kernel lacks nf_tables (test)")

    with pytest.raises(StartupError, match="cannot set up the IPv4 backend: kernel lacks"):
        build_daemon(cluster_options(), broken, seams=offline(privileged=False))


class GatedBackends(Backends):
    """Backends whose first sync waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(
        self, family: IPFamily, config: ProxierConfig, *, netns: str | None = None
    ) -> RecordingBackend:
        backend = super().__call__(family, config, netns=netns)
        sync = backend.sync

        def gated(snapshot: ProxySnapshot, changes: SyncChanges) -> None:
            assert self.release.wait(30)
            sync(snapshot, changes)

        backend.sync = gated  # type: ignore[method-assign]
        return backend


def test_served_early_livez_answers_at_once_and_healthz_503_until_the_first_sync() -> None:
    backends = GatedBackends()
    daemon = build_daemon(cluster_options(), backends, seams=offline(), serve_early=True)
    started = threading.Thread(target=daemon.start)
    try:
        # Listening before anything was synced, or even delivered.
        assert not backends.made[0].synced
        assert get(daemon.health_server.port, "/livez")[0] == 200
        code, body = get(daemon.health_server.port, "/healthz")
        assert code == 503
        assert json.loads(body)["reason"] == "IPv4: waiting for the first sync"
        assert get(daemon.metrics_server.port, "/metrics")[0] == 200
        started.start()  # delivers, and the first sync waits in the backend
        time.sleep(0.2)
        assert get(daemon.health_server.port, "/healthz")[0] == 503
        backends.release.set()
        started.join(10)
        wait_for(lambda: get(daemon.health_server.port, "/healthz")[0] == 200, "healthz 200")
        assert backends.made[0].synced
    finally:
        backends.release.set()
        if started.is_alive():
            started.join(10)
        daemon.stop()


def test_the_collector_is_held_while_the_cluster_is_read() -> None:
    ops, calls = recording_gc()
    daemon = build_daemon(
        cluster_options(), Backends(), seams=offline(privileged=False, gc_ops=ops)
    )
    try:
        assert calls == []
        daemon.start()
        wait_for(lambda: "enable" in calls, "the collector released")
        # Held while the cluster was read, tuned after the first full sync, then released.
        assert calls == ["disable", "freeze", "threshold 20000 10 10", "enable"]
    finally:
        daemon.stop()
    assert calls.count("enable") == 1


def test_a_daemon_stopped_before_its_first_sync_releases_the_collector() -> None:
    ops, calls = recording_gc()
    code = run_daemon(cluster_options(once=True), Backends(), seams=offline(gc_ops=ops))
    assert code == 0
    assert calls == ["disable", "enable"]


def test_healthz_is_503_all_the_way_to_the_first_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubeproxy.daemon import startup
    from kubeproxy.daemon.serving import servers as make_servers

    made: list[Any] = []
    seen: list[int] = []
    backends = Backends()

    def noted(*args: Any, **kwargs: Any) -> Any:
        made.append(make_servers(*args, **kwargs))
        return made[-1]

    def factory(family: IPFamily, config: ProxierConfig, *, netns: str | None = None) -> Any:
        # The Node is known by now, the families not yet: still 503.
        seen.append(get(made[0].health_server.port, "/healthz")[0])
        return backends(family, config, netns=netns)

    monkeypatch.setattr(startup, "servers", noted)
    daemon = build_daemon(cluster_options(), factory, seams=offline(), serve_early=True)
    try:
        assert seen == [503]
        daemon.start()
        wait_for(lambda: get(daemon.health_server.port, "/healthz")[0] == 200, "healthz 200")
    finally:
        daemon.stop()
