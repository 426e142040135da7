"""Command-line options: upstream's flags, --config precedence, fixed and defaulted modes."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml

from kubeproxy.cmd.commandline import (
    MODE_DEFAULTED_MESSAGE,
    Options,
    OptionsError,
    parse_options,
    usage,
)
from kubeproxy.config import LocalDetectMode
from kubeproxy.configfile.codec import parse_config, write_config
from kubeproxy.configfile.model import Duration, VModuleItem, defaults
from kubeproxy.pacing import DEFAULT_PACING

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "cluster"
HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def _host() -> str:
    return "Test-Host"


def _nft(*argv: str) -> Options:
    return parse_options(list(argv), "kube-proxy-nftables", "nftables", get_hostname=_host)


def _multi(*argv: str) -> Options:
    return parse_options(list(argv), "kube-proxy", None, get_hostname=_host)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    return tmp_path / "kube-proxy.yaml"


def _write(path: Path, body: str) -> str:
    path.write_text(HEADER + body)
    return str(path)


# --- defaults -----------------------------------------------------------------------------


def test_defaults_follow_upstream() -> None:
    options = _nft("--manifests", str(EXAMPLES), "--hostname-override", "Node-A")
    assert options.node_name == "node-a"
    assert options.mode == "nftables"
    assert options.mode_defaulted is False
    assert options.manifests == EXAMPLES
    config = options.config
    assert config.node_name == "node-a"
    assert config.node_port_addresses == ("primary",)
    # Upstream's syncPeriod; minSyncPeriod unset: paced by the sync's cost (issue 29).
    assert (config.sync_period, config.min_sync_period) == (30.0, None)
    assert config.sync_pacing == DEFAULT_PACING
    assert config.masquerade_bit == 14
    assert config.local_detector.mode is LocalDetectMode.NONE
    assert options.healthz_bind_address == "0.0.0.0:10256"
    assert options.metrics_bind_address == "127.0.0.1:10249"
    assert (options.qps, options.burst) == (5.0, 10)
    assert options.content_type == "application/vnd.kubernetes.protobuf"
    assert options.kubeconfig == options.master == ""
    assert options.oom_score_adj == -999
    assert options.conntrack.max_per_core == 32768
    assert options.config_sync_period == 900.0
    assert (options.verbosity, options.logging_format) == (0, "text")
    assert options.bind_address_hard_fail is False
    assert not (options.once or options.dry_run or options.cleanup or options.init_only)
    assert options.warnings == options.ignored_flags == ()


def test_node_name_defaults_to_the_hostname_lower_cased() -> None:
    assert _nft().node_name == "test-host"
    with pytest.raises(OptionsError, match="hostnameOverride: empty hostname"):
        parse_options([], "p", "nftables", get_hostname=lambda: "  ")


def test_multi_mode_binary_defaults_to_iptables_and_says_so() -> None:
    options = _multi()
    assert (options.mode, options.mode_defaulted) == ("iptables", True)
    assert options.configuration.mode == "iptables"
    assert options.config.node_port_addresses == ()
    assert "nftables" in MODE_DEFAULTED_MESSAGE
    explicit = _multi("--proxy-mode", "iptables")
    assert (explicit.mode, explicit.mode_defaulted) == ("iptables", False)


def test_multi_mode_binary_takes_the_mode_from_the_file(config_file: Path) -> None:
    options = _multi("--config", _write(config_file, "mode: nftables\n"))
    assert (options.mode, options.mode_defaulted) == ("nftables", False)
    assert options.config.node_port_addresses == ("primary",)


# --- flags --------------------------------------------------------------------------------

# Every upstream Linux flag (cmd/kube-proxy/app, v1alpha1 era) with a valid value.
UPSTREAM_FLAGS = [
    ["--bind-address", "10.0.0.1"],
    ["--bind-address-hard-fail"],
    ["--cleanup=false"],
    ["--cluster-cidr", "10.244.0.0/16"],
    ["--config-sync-period", "10m"],
    ["--conntrack-max-per-core", "0"],
    ["--conntrack-min", "1000"],
    ["--boot-id-file", "/proc/sys/kernel/random/boot_id"],
    ["--conntrack-tcp-be-liberal"],
    ["--conntrack-tcp-timeout-close-wait", "30m"],
    ["--conntrack-tcp-timeout-established", "12h"],
    ["--conntrack-udp-timeout", "30s"],
    ["--conntrack-udp-timeout-stream", "5m"],
    ["--detect-local-mode", "NodeCIDR"],
    ["--feature-gates", "MultiCIDRServiceAllocator=true"],
    ["--healthz-bind-address", "0.0.0.0:10256"],
    ["--healthz-port", "10256"],
    ["--hostname-override", "n1"],
    ["--init-only=false"],
    ["--iptables-localhost-nodeports=false"],
    ["--iptables-masquerade-bit", "15"],
    ["--iptables-min-sync-period", "2s"],
    ["--iptables-sync-period", "1m"],
    ["--ipvs-exclude-cidrs", "10.0.0.0/8"],
    ["--ipvs-min-sync-period", "1s"],
    ["--ipvs-scheduler", "rr"],
    ["--ipvs-strict-arp"],
    ["--ipvs-sync-period", "1m"],
    ["--ipvs-tcp-timeout", "1m"],
    ["--ipvs-tcpfin-timeout", "10s"],
    ["--ipvs-udp-timeout", "10s"],
    ["--kube-api-burst", "20"],
    ["--kube-api-content-type", "application/json"],
    ["--kube-api-qps", "10"],
    ["--kubeconfig", "/var/lib/kube-proxy/kubeconfig"],
    ["--log-flush-frequency", "5s"],
    ["--log-json-info-buffer-size", "0"],
    ["--log-json-split-stream=false"],
    ["--log-text-info-buffer-size", "0"],
    ["--log-text-split-stream=false"],
    ["--logging-format", "json"],
    ["--masquerade-all"],
    ["--master", "https://10.0.0.1:6443"],
    ["--metrics-bind-address", "0.0.0.0:10249"],
    ["--metrics-port", "10249"],
    ["--nodeport-addresses", "primary"],
    ["--oom-score-adj", "-998"],
    ["--pod-bridge-interface", "cbr0"],
    ["--pod-interface-name-prefix", "veth"],
    ["--profiling"],
    ["--proxy-mode", "nftables"],
    ["--proxy-port-range", "30000-32767"],
    ["--show-hidden-metrics-for-version", "1.33"],
    ["--v", "2"],
    ["-v", "2"],
    ["--vmodule", "proxier=4"],
    ["--write-config-to", "/tmp/out.yaml"],
]


@pytest.mark.parametrize("argv", UPSTREAM_FLAGS, ids=lambda argv: argv[0])
def test_every_upstream_flag_is_accepted(argv: list[str]) -> None:
    assert isinstance(_multi(*argv), Options)


def test_flags_set_their_fields() -> None:
    options = _multi(
        "--proxy-mode=ipvs",
        "--bind-address=fd00::1",
        "--kube-api-qps=2.5",
        "--kube-api-burst=3",
        "--kubeconfig=/k",
        "--master=https://api:6443",
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=2h",
        "--conntrack-tcp-be-liberal=true",
        "--oom-score-adj=-1000",
        "--config-sync-period=1m",
        "--ipvs-scheduler=wrr",
        "--ipvs-sync-period=20s",
        "--ipvs-exclude-cidrs=10.0.0.0/8,fd00::/8",
        "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true,ContextualLogging=false",
        "--feature-gates=LoggingAlphaOptions=1",
        "--profiling",
        "--bind-address-hard-fail",
        "--iptables-localhost-nodeports=false",
    )
    cfg = options.configuration
    assert options.mode == "ipvs"
    assert cfg.bind_address == "fd00::1"
    assert (options.qps, options.burst, options.kubeconfig) == (2.5, 3, "/k")
    assert options.master == "https://api:6443"
    assert cfg.conntrack.max_per_core == 0
    assert cfg.conntrack.tcp_established_timeout == Duration.of(hours=2)
    assert cfg.conntrack.tcp_be_liberal is True
    assert options.oom_score_adj == -1000
    assert options.config_sync_period == 60.0
    assert cfg.ipvs.scheduler == "wrr"
    assert cfg.ipvs.exclude_cidrs == ("10.0.0.0/8", "fd00::/8")
    assert options.feature_gates == {
        "KubeProxyNFTablesLocalhostNodePorts": True,
        "ContextualLogging": False,
        "LoggingAlphaOptions": True,
    }
    assert options.gates.enabled("KubeProxyNFTablesLocalhostNodePorts")
    assert not options.gates.enabled("ContextualLogging")
    assert options.enable_profiling and options.bind_address_hard_fail
    assert cfg.iptables.localhost_node_ports is False
    assert options.config.sync_period == 20.0


def test_cluster_cidr_and_durations() -> None:
    options = _nft(
        "--cluster-cidr",
        "10.0.0.0/8,fd00::/64",
        "--iptables-min-sync-period",
        "500ms",
        "--iptables-sync-period",
        "1m30s",
    )
    detector = options.config.local_detector
    assert detector.mode is LocalDetectMode.CLUSTER_CIDR
    assert detector.cidrs == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/64"),
    )
    assert options.config.min_sync_period == 0.5
    assert options.config.sync_period == 90.0


def test_iptables_flags_apply_to_nftables_mode_but_not_the_masquerade_bit() -> None:
    nft = _nft("--iptables-sync-period=10s", "--masquerade-all", "--iptables-masquerade-bit=3")
    assert nft.config.sync_period == 10.0
    assert nft.config.masquerade_all is True
    assert nft.config.masquerade_bit == 14  # nftables.masqueradeBit, a file-only field
    ipt = _multi("--proxy-mode=iptables", "--masquerade-all", "--iptables-masquerade-bit=3")
    assert (ipt.config.masquerade_all, ipt.config.masquerade_bit) == (True, 3)


def test_an_operators_min_sync_period_is_upstreams_fixed_rest_in_nftables_mode() -> None:
    assert _nft("--iptables-min-sync-period=1s").config.min_sync_period == 1.0
    # Zero is "unset", as a zero in the file is: paced.
    assert _nft("--iptables-min-sync-period=0s").config.min_sync_period is None
    ipt = _multi("--proxy-mode=iptables")
    assert ipt.config.min_sync_period == 1.0  # iptables mode keeps upstream's default


def test_ipvs_mode_ignores_iptables_periods_and_keeps_upstreams_one_second_minimum() -> None:
    options = _multi("--proxy-mode=ipvs", "--iptables-sync-period=5s")
    assert (options.config.sync_period, options.config.min_sync_period) == (30.0, 1.0)
    tuned = _multi("--proxy-mode=ipvs", "--ipvs-min-sync-period=0s")
    assert tuned.config.min_sync_period == 0.0


def test_go_style_booleans_and_repeated_lists() -> None:
    assert _nft("--masquerade-all=false").config.masquerade_all is False
    assert _nft("--masquerade-all=T").config.masquerade_all is True
    assert _nft("--cleanup").cleanup is True
    options = _nft("--nodeport-addresses", "10.0.0.0/8", "--nodeport-addresses=fd00::/8,localhost")
    assert options.config.node_port_addresses == ("10.0.0.0/8", "fd00::/8", "localhost")
    assert _nft("--nodeport-addresses=").config.node_port_addresses == ("primary",)


def test_server_addresses_and_deprecated_ports() -> None:
    assert _nft("--healthz-port=0").healthz_bind_address == ""
    assert _nft("--metrics-bind-address=").metrics_bind_address == ""
    options = _nft("--healthz-bind-address=10.0.0.1", "--healthz-port=999")
    assert options.healthz_bind_address == "10.0.0.1:999"
    assert _nft("--metrics-bind-address=::1").metrics_bind_address == "[::1]:10249"
    # An address with a port keeps it, as upstream (the port flag only fills one in).
    assert _nft("--healthz-port=999").healthz_bind_address == "0.0.0.0:10256"
    assert any("--healthz-port is deprecated" in w for w in _nft("--healthz-port=1").warnings)


def test_write_config_to_writes_the_effective_configuration(tmp_path: Path) -> None:
    out = tmp_path / "out.yaml"
    options = _nft("--write-config-to", str(out), "--conntrack-min=5")
    assert options.write_config_to == out
    written = parse_config(write_config(options.configuration))
    assert written == options.configuration
    assert written.mode == "nftables"
    assert written.conntrack.min == 5


def test_logging_flags() -> None:
    options = _nft(
        "-v=5",
        "--logging-format=json",
        "--log-json-split-stream",
        "--feature-gates=LoggingAlphaOptions=true",
    )
    assert (options.verbosity, options.logging_format) == (5, "json")
    assert options.logging.options.json.split_stream is True
    vmodule = _nft("--vmodule=proxier=4,sources*=2").logging.vmodule
    assert vmodule == (VModuleItem("proxier", 4), VModuleItem("sources*", 2))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cluster-cidr", "10.0.0.0/33"], "--cluster-cidr: clusterCIDR: "),
        (["--cluster-cidr", "10.0.0.0/8,10.1.0.0/16"], "--cluster-cidr: clusterCIDR: "),
        (["--iptables-sync-period", "soon"], "--iptables-sync-period: invalid duration"),
        (["--iptables-sync-period", "30"], "--iptables-sync-period: missing unit"),
        (["--iptables-min-sync-period", "1h"], "--iptables-min-sync-period: .*minSyncPeriod"),
        (["--nodeport-addresses", "nowhere"], "--nodeport-addresses: nodePortAddresses"),
        (["--iptables-masquerade-bit", "40"], "--iptables-masquerade-bit: .*masqueradeBit"),
        (["--detect-local-mode", "BridgeInterface"], "--pod-bridge-interface: "),
        (["--detect-local-mode", "Magic"], "--detect-local-mode: detectLocalMode: "),
        (["--oom-score-adj", "2000"], "--oom-score-adj: oomScoreAdj: "),
        (["--oom-score-adj", "x"], "--oom-score-adj: 'x' is not an integer"),
        (["--conntrack-min=-1"], "--conntrack-min: conntrack.min: "),
        (["--bind-address", "nowhere"], "--bind-address: 'nowhere' is not a valid IP"),
        (["--healthz-bind-address", "host:1"], "--healthz-bind-address: "),
        (["--metrics-bind-address", "1.2.3.4:99999"], "--metrics-bind-address: "),
        (["--masquerade-all=maybe"], "--masquerade-all: 'maybe' is not a boolean"),
        (["--feature-gates", "A"], "--feature-gates: 'A' is not name=true"),
        (["--logging-format", "xml"], "--logging-format: 'xml' is not one of text, json"),
        (["--vmodule", "x"], "--vmodule: 'x' is not pattern=N"),
        (["--kube-api-content-type", "text/xml"], "--kube-api-content-type: "),
        (["--ipvs-scheduler", "best"], "--ipvs-scheduler: ipvs.scheduler"),
        (["--proxy-port-range", "a-b"], "--proxy-port-range: "),
        (["--hostname-override", "  "], "--hostname-override: empty"),
        (["--service-cluster-ip-range", "nope"], "--service-cluster-ip-range: 'nope'"),
        (["--manifests", "/nonexistent/dir"], "--manifests: "),
        (["--bogus"], "unknown flag or argument: --bogus"),
        (["positional"], "unknown flag or argument: positional"),
        (["--proxy-mode", "iptables"], "--proxy-mode: kube-proxy-nftables always runs in nftables"),
        (["--logging-format=json", "--vmodule=a=1"], "--vmodule: logging.vmodule: only"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(OptionsError, match=f"^{message}"):
        _nft(*argv)


def test_bad_multi_mode_value_names_the_flag() -> None:
    with pytest.raises(OptionsError, match=r"^--proxy-mode: mode: must be iptables"):
        _multi("--proxy-mode=userspace")


# --- --config precedence ------------------------------------------------------------------


def test_config_file_wins_over_flags(config_file: Path) -> None:
    path = _write(
        config_file, "nftables: {syncPeriod: 1m, minSyncPeriod: 2s}\nclusterCIDR: 10.0.0.0/8\n"
    )
    options = _nft(
        "--config",
        path,
        "--iptables-sync-period=5s",
        "--cluster-cidr=fd00::/8",
        "--kubeconfig=/ignored",
        "--healthz-port=0",
        "--proxy-mode=iptables",
    )
    assert options.config_file == config_file
    assert options.config.sync_period == 60.0
    assert options.config.local_detector.cidrs == (ipaddress.ip_network("10.0.0.0/8"),)
    assert options.kubeconfig == ""
    assert options.healthz_bind_address == "0.0.0.0:10256"
    assert options.mode == "nftables"
    assert options.ignored_flags == (
        "--iptables-sync-period",
        "--cluster-cidr",
        "--kubeconfig",
        "--healthz-port",
        "--proxy-mode",
    )
    assert any("ignored because --config" in w and "--cluster-cidr" in w for w in options.warnings)


def test_some_flags_still_apply_with_a_config_file(config_file: Path, tmp_path: Path) -> None:
    path = _write(
        config_file,
        "hostnameOverride: from-file\nlogging: {verbosity: 1, format: text}\n",
    )
    options = _nft(
        "--config",
        path,
        "--hostname-override=From-Flag",
        "-v=4",
        "--logging-format=json",
        "--master=https://api:6443",
        "--manifests",
        str(EXAMPLES),
        "--once",
        "--dry-run",
        "--cleanup",
        "--init-only",
        "--write-config-to",
        str(tmp_path / "out.yaml"),
        "--service-cluster-ip-range=172.30.0.0/16",
    )
    assert options.node_name == "from-flag"
    assert options.configuration.hostname_override == "from-flag"
    assert (options.verbosity, options.logging_format) == (4, "json")
    assert options.master == "https://api:6443"
    assert options.manifests == EXAMPLES
    assert options.once and options.dry_run and options.cleanup and options.init_only
    assert options.write_config_to == tmp_path / "out.yaml"
    assert options.config.service_cidrs == (ipaddress.ip_network("172.30.0.0/16"),)
    assert options.ignored_flags == ()


def test_config_file_values_and_logging_from_file(config_file: Path) -> None:
    path = _write(
        config_file,
        "hostnameOverride: Worker-1\nlogging:\n  verbosity: 3\n  vmodule:\n"
        "  - {filePattern: proxier, verbosity: 5}\n",
    )
    options = _nft("--config", path, "--vmodule=sources=2")
    assert options.node_name == "worker-1"
    assert options.verbosity == 3
    # Command-line vmodule entries come first, so they win.
    assert options.logging.vmodule == (VModuleItem("sources", 2), VModuleItem("proxier", 5))


def test_fixed_mode_conflicts_with_the_file(config_file: Path) -> None:
    path = _write(config_file, "mode: iptables\n")
    with pytest.raises(OptionsError, match=r"--config .*: mode: kube-proxy-nftables always runs"):
        _nft("--config", path)
    same = _nft("--config", _write(config_file, "mode: nftables\n"))
    assert (same.mode, same.mode_defaulted) == ("nftables", False)
    unset = _nft("--config", _write(config_file, ""))
    assert (unset.mode, unset.mode_defaulted) == ("nftables", False)


def test_iptables_binary_rejects_an_ipvs_file(config_file: Path) -> None:
    with pytest.raises(OptionsError, match="mode: kube-proxy-iptables always runs in iptables"):
        parse_options(
            ["--config", _write(config_file, "mode: ipvs\n")], "kube-proxy-iptables", "iptables"
        )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("conntrack: {maxPercore: 1}\n", "conntrack.maxPercore: unknown field"),
        ("nftables: {syncPeriod: 5s, minSyncPeriod: 10s}\n", "nftables.minSyncPeriod: must not"),
        ("detectLocalMode: BridgeInterface\n", "detectLocal.bridgeInterface: required"),
        ("logging: {format: json, vmodule: [{filePattern: a, verbosity: 1}]}\n", "logging.vmodule"),
    ],
)
def test_config_file_errors_name_the_file_and_field(
    config_file: Path, body: str, message: str
) -> None:
    path = _write(config_file, body)
    with pytest.raises(OptionsError) as caught:
        _nft("--config", path)
    assert str(caught.value).startswith(f"--config {path}: {message}")


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(OptionsError, match=r"^--config .*missing\.yaml: cannot read"):
        _nft("--config", str(tmp_path / "missing.yaml"))


def test_a_written_configuration_reads_back_the_same(tmp_path: Path) -> None:
    flags = _nft("--cluster-cidr=10.0.0.0/8", "--conntrack-min=7", "--masquerade-all")
    path = tmp_path / "written.yaml"
    path.write_text(write_config(flags.configuration))
    from_file = _nft("--config", str(path))
    assert from_file.configuration == flags.configuration
    assert from_file.config == flags.config


# --- help, version, transitional call -----------------------------------------------------


def test_help_and_version_exit_early() -> None:
    assert _nft("--help", "--cluster-cidr=not-checked").show_help is True
    assert _nft("-h").show_help is True
    assert _nft("--version").show_version == "true"
    assert _nft("--version=raw").show_version == "raw"
    assert _nft("--version=false").show_version == ""
    text = usage("kube-proxy-nftables", "nftables")
    for flag in ("--config", "--proxy-mode", "--nodeport-addresses", "--logging-format"):
        assert flag in text


def test_transitional_default_nodeport_means_the_nftables_binary() -> None:
    options = parse_options([], "kube-proxy-nftables", default_nodeport=("primary",))
    assert options.mode == "nftables"
    assert options.config.node_port_addresses == ("primary",)


def test_fixed_mode_must_be_a_mode() -> None:
    with pytest.raises(ValueError, match="fixed_mode"):
        parse_options([], "p", "userspace")


def test_defaults_match_the_model() -> None:
    # Flags-only options equal the model's defaults but for what start-up decides.
    options = _multi()
    expected = defaults()
    cfg = options.configuration
    assert cfg.iptables == expected.iptables
    assert cfg.nftables == expected.nftables
    assert cfg.conntrack == expected.conntrack
    assert cfg.client_connection == expected.client_connection
    assert yaml.safe_load(write_config(cfg))["detectLocalMode"] == "ClusterCIDR"


def test_boot_id_file_is_accepted_and_changes_nothing(config_file: Path) -> None:
    plain = _nft("--hostname-override", "n1")
    given = _nft("--hostname-override", "n1", "--boot-id-file=/a,/b")
    assert given.configuration == plain.configuration
    # With a configuration file too (a DaemonSet passing it must not crash-loop).
    path = _write(config_file, "mode: nftables\n")
    assert _nft("--config", path, "--boot-id-file", "/x").warnings == ()


@pytest.mark.parametrize("mode", ["nftables", "iptables", "ipvs"])
def test_each_fixed_mode_binary_describes_itself(mode: str) -> None:
    text = " ".join(usage(f"kube-proxy-{mode}", mode).split())
    assert f"Kubernetes service proxy ({mode} mode)" in text
    assert "iptables (default)" not in text
    assert f"--proxy-mode STRING This binary always runs in {mode} mode" in text
    # --cleanup removes every mode's state, whichever binary runs it.
    cleanup = text.split("--cleanup [BOOL]", 2)[2].split("--init-only", 1)[0]
    for what in ("nftables tables", "iptables mode's chains", "ipvs mode's virtual servers"):
        assert what in cleanup
    ipvs_only = text.split("--ipvs-scheduler STRING", 2)[2].split("--ipvs-exclude", 1)[0]
    assert ("Not used by this binary" in ipvs_only) is (mode != "ipvs")
    localhost = text.split("--iptables-localhost-nodeports [BOOL]", 2)[2].split(" --iptables", 1)[0]
    assert ("Not used by this binary" in localhost) is (mode != "iptables")


def test_the_multi_mode_binary_offers_every_mode() -> None:
    text = " ".join(usage("kube-proxy", None).split())
    assert "iptables (default), ipvs (deprecated) or nftables" in text
    assert "Not used by this binary" not in text
