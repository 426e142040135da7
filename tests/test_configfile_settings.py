"""KubeProxyConfiguration: strict decoding, upstream's defaults, validation, proxier mapping."""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kubeproxy.config import LocalDetectMode, LocalDetector
from kubeproxy.configfile.codec import load_config_file, parse_config, write_config
from kubeproxy.configfile.model import ConfigError, Duration, KubeProxyConfiguration, defaults
from kubeproxy.configfile.settings import apply_platform_defaults, to_proxier_config, validate

HEADER = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"

# Every v1alpha1 field, each set to a value other than its default.
FULL = (
    HEADER
    + """\
featureGates:
  KubeProxyNFTablesLocalhostNodePorts: true
  LoggingAlphaOptions: true
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  acceptContentTypes: application/json
  contentType: application/json
  qps: 12.5
  burst: 30
logging:
  format: text
  flushFrequency: 10s
  verbosity: 3
  vmodule:
  - filePattern: proxier
    verbosity: 5
  - filePattern: kubeproxy.sources.*
    verbosity: 2
  options:
    text:
      splitStream: true
      infoBufferSize: 4Ki
    json:
      splitStream: true
      infoBufferSize: 1M
hostnameOverride: node-a
bindAddress: 10.0.0.5
healthzBindAddress: 10.0.0.5:10266
metricsBindAddress: 0.0.0.0:10259
bindAddressHardFail: true
enableProfiling: true
showHiddenMetricsForVersion: "1.33"
mode: nftables
iptables:
  masqueradeBit: 13
  masqueradeAll: true
  localhostNodePorts: false
  syncPeriod: 1m0s
  minSyncPeriod: 2s
ipvs:
  syncPeriod: 45s
  minSyncPeriod: 5s
  scheduler: wrr
  excludeCIDRs:
  - 10.1.0.0/16
  - fd01::/64
  strictARP: true
  tcpTimeout: 15m0s
  tcpFinTimeout: 30s
  udpTimeout: 10s
nftables:
  masqueradeBit: 12
  masqueradeAll: true
  syncPeriod: 1h0m0s
  minSyncPeriod: 500ms
winkernel:
  networkName: l2bridge
  sourceVip: 10.0.0.9
  enableDSR: true
  rootHnsEndpointName: cbr0
  forwardHealthCheckVip: true
detectLocalMode: InterfaceNamePrefix
detectLocal:
  bridgeInterface: cbr0
  interfaceNamePrefix: veth
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
nodePortAddresses:
- 192.168.0.0/16
- fd00::/8
oomScoreAdj: -500
conntrack:
  maxPerCore: 0
  min: 65536
  tcpEstablishedTimeout: 2h0m0s
  tcpCloseWaitTimeout: 30m0s
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 5m0s
configSyncPeriod: 30m0s
portRange: 30000-32767
windowsRunAsService: true
"""
)

# Upstream's defaults, as its --write-config-to writes them (v1alpha1, Linux).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
    "kind": "KubeProxyConfiguration",
    "bindAddress": "0.0.0.0",
    "bindAddressHardFail": False,
    "clientConnection": {
        "acceptContentTypes": "",
        "burst": 10,
        "contentType": "application/vnd.kubernetes.protobuf",
        "kubeconfig": "",
        "qps": 5,
    },
    "clusterCIDR": "",
    "configSyncPeriod": "15m0s",
    "conntrack": {
        "maxPerCore": 32768,
        "min": 131072,
        "tcpBeLiberal": False,
        "tcpCloseWaitTimeout": "1h0m0s",
        "tcpEstablishedTimeout": "24h0m0s",
        "udpStreamTimeout": "0s",
        "udpTimeout": "0s",
    },
    "detectLocal": {"bridgeInterface": "", "interfaceNamePrefix": ""},
    "detectLocalMode": "",
    "enableProfiling": False,
    "healthzBindAddress": "0.0.0.0:10256",
    "hostnameOverride": "",
    "iptables": {
        "localhostNodePorts": True,
        "masqueradeAll": False,
        "masqueradeBit": 14,
        "minSyncPeriod": "1s",
        "syncPeriod": "30s",
    },
    "ipvs": {
        "excludeCIDRs": None,
        "minSyncPeriod": "0s",
        "scheduler": "",
        "strictARP": False,
        "syncPeriod": "30s",
        "tcpFinTimeout": "0s",
        "tcpTimeout": "0s",
        "udpTimeout": "0s",
    },
    "logging": {
        "flushFrequency": "5s",
        "format": "text",
        "options": {"json": {"infoBufferSize": "0"}, "text": {"infoBufferSize": "0"}},
        "verbosity": 0,
    },
    "metricsBindAddress": "127.0.0.1:10249",
    "mode": "",
    "nftables": {
        "masqueradeAll": False,
        "masqueradeBit": 14,
        "minSyncPeriod": "1s",
        "syncPeriod": "30s",
    },
    "nodePortAddresses": None,
    "oomScoreAdj": -999,
    "portRange": "",
    "showHiddenMetricsForVersion": "",
    "winkernel": {
        "enableDSR": False,
        "forwardHealthCheckVip": False,
        "networkName": "",
        "rootHnsEndpointName": "",
        "sourceVip": "",
    },
}


def _leaf_paths(tree: object, prefix: str = "") -> set[str]:
    if isinstance(tree, dict):
        out: set[str] = set()
        for key, value in tree.items():
            out |= _leaf_paths(value, f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(tree, list) and tree and isinstance(tree[0], dict):
        return {p for item in tree for p in _leaf_paths(item, f"{prefix}[]")}
    return {prefix}


def _mapping_paths(tree: object, prefix: str = "") -> list[str]:
    """Every path in ``tree`` that holds a mapping ("" is the root)."""
    out: list[str] = []
    if isinstance(tree, dict):
        out.append(prefix)
        for key, value in tree.items():
            out += _mapping_paths(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(tree, list):
        for i, item in enumerate(tree):
            out += _mapping_paths(item, f"{prefix}[{i}]")
    return out


def _at(tree: Any, path: str) -> Any:
    node = tree
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return node


def _cfg(body: str) -> KubeProxyConfiguration:
    return parse_config(HEADER + body)


# --- durations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ns", "canonical"),
    [
        ("0", 0, "0s"),
        ("0s", 0, "0s"),
        ("30s", 30 * 10**9, "30s"),
        ("1h0m0s", 3600 * 10**9, "1h0m0s"),
        ("24h0m0s", 24 * 3600 * 10**9, "24h0m0s"),
        ("1h", 3600 * 10**9, "1h0m0s"),
        ("15m", 900 * 10**9, "15m0s"),
        ("90s", 90 * 10**9, "1m30s"),
        ("2h22m", (2 * 3600 + 22 * 60) * 10**9, "2h22m0s"),
        ("1.5s", 1_500_000_000, "1.5s"),
        (".5s", 500_000_000, "500ms"),
        ("5.s", 5 * 10**9, "5s"),
        ("500ms", 500_000_000, "500ms"),
        ("1.5h", 5400 * 10**9, "1h30m0s"),
        ("100us", 100_000, "100\u00b5s"),
        ("100\u00b5s", 100_000, "100\u00b5s"),
        ("100\u03bcs", 100_000, "100\u00b5s"),
        ("7ns", 7, "7ns"),
        ("-1m", -60 * 10**9, "-1m0s"),
        ("+3s", 3 * 10**9, "3s"),
        ("1h2m3.004s", (3600 + 120 + 3) * 10**9 + 4_000_000, "1h2m3.004s"),
    ],
)
def test_go_durations_parse_and_print_like_go(text: str, ns: int, canonical: str) -> None:
    duration = Duration.parse(text)
    assert duration.nanoseconds == ns
    assert str(duration) == canonical


@pytest.mark.parametrize(
    "text",
    ["", "30", "1", "s", ".s", "1x", "1hm", "--1s", "1s2", " 1s", "1 s", "9999999999h", "1e3s"],
)
def test_bad_durations_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        Duration.parse(text)


@given(st.integers(min_value=-(2**63) + 1, max_value=2**63 - 1))
def test_duration_text_round_trips(ns: int) -> None:
    assert Duration.parse(str(Duration(ns))).nanoseconds == ns


# --- defaults and round trip --------------------------------------------------------------


def test_defaults_equal_upstreams_table() -> None:
    """Upstream's defaults but one: nftables.minSyncPeriod is left unset (written 0s, read
    back as unset): the sync loop is paced by each sync's cost (issue 29)."""
    ours = copy.deepcopy(UPSTREAM_DEFAULTS)
    ours["nftables"]["minSyncPeriod"] = "0s"
    assert yaml.safe_load(write_config(defaults())) == ours


def test_nftables_min_sync_period_unset_is_paced_and_set_is_upstreams_fixed_rest() -> None:
    def min_sync(text: str, mode: str = "nftables") -> float | None:
        return to_proxier_config(parse_config(HEADER + text), "n", mode).min_sync_period

    assert min_sync("") is None
    assert min_sync("nftables: {minSyncPeriod: 1s}\n") == 1.0
    # A zero in the file is "unset", as upstream reads it.
    assert min_sync("nftables: {minSyncPeriod: 0s}\n") is None
    # The other modes keep upstream's defaults: iptables 1s, ipvs 0s (a fixed rest of 0).
    assert min_sync("", "iptables") == 1.0
    assert min_sync("", "ipvs") == 0.0


def test_minimal_file_gets_upstreams_defaults() -> None:
    assert parse_config(HEADER) == defaults()


def test_full_file_sets_every_field_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(FULL)
    loaded = load_config_file(path)
    validate(loaded)
    written = write_config(loaded)
    assert yaml.safe_load(written) == yaml.safe_load(FULL)
    again = tmp_path / "again.yaml"
    again.write_text(written)
    assert load_config_file(again) == loaded
    assert loaded != defaults()
    # Every field of the model differs from its default: nothing was dropped on the way.
    for section in dataclasses.fields(KubeProxyConfiguration):
        assert getattr(loaded, section.name) != getattr(defaults(), section.name), section.name


def test_full_file_covers_every_upstream_field() -> None:
    full = _leaf_paths(yaml.safe_load(FULL))
    written_defaults = _leaf_paths(UPSTREAM_DEFAULTS)
    # Fields upstream leaves out of its dump when empty (omitempty).
    omitted = {
        "featureGates.KubeProxyNFTablesLocalhostNodePorts",
        "featureGates.LoggingAlphaOptions",
        "logging.vmodule[].filePattern",
        "logging.vmodule[].verbosity",
        "logging.options.text.splitStream",
        "logging.options.json.splitStream",
        "windowsRunAsService",
    }
    assert full == written_defaults | omitted


def test_full_file_values() -> None:
    cfg = parse_config(FULL)
    assert cfg.feature_gates == {
        "KubeProxyNFTablesLocalhostNodePorts": True,
        "LoggingAlphaOptions": True,
    }
    assert cfg.client_connection.qps == 12.5
    assert cfg.logging.vmodule[1].file_pattern == "kubeproxy.sources.*"
    assert cfg.logging.options.json.info_buffer_size == "1M"
    assert cfg.nftables.min_sync_period == Duration(500_000_000)
    assert cfg.ipvs.exclude_cidrs == ("10.1.0.0/16", "fd01::/64")
    assert cfg.conntrack.max_per_core == 0
    assert cfg.oom_score_adj == -500
    assert cfg.winkernel.root_hns_endpoint_name == "cbr0"
    assert cfg.windows_run_as_service is True


def test_json_files_load_like_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        '{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",'
        ' "mode": "nftables", "conntrack": {"maxPerCore": 0}}'
    )
    cfg = load_config_file(path)
    assert cfg.mode == "nftables"
    assert cfg.conntrack.max_per_core == 0
    assert parse_config(yaml.safe_dump(yaml.safe_load(FULL))) == parse_config(FULL)


# --- upstream's defaulting quirks ---------------------------------------------------------


def test_zero_values_of_plain_fields_mean_default() -> None:
    cfg = _cfg(
        "bindAddress: ''\niptables: {syncPeriod: 0s, minSyncPeriod: 0s}\n"
        "nftables: {syncPeriod: '0', minSyncPeriod: 0s}\nipvs: {syncPeriod: 0s}\n"
        "configSyncPeriod: 0s\nclientConnection: {qps: 0, burst: 0, contentType: ''}\n"
        "logging: {format: '', flushFrequency: 0}\n"
    )
    assert cfg == defaults()


def test_explicit_zero_of_pointer_fields_is_kept() -> None:
    cfg = _cfg(
        "oomScoreAdj: 0\niptables: {masqueradeBit: 0, localhostNodePorts: false}\n"
        "nftables: {masqueradeBit: 0}\n"
        "conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}\n"
    )
    assert cfg.oom_score_adj == 0
    assert cfg.iptables.masquerade_bit == 0
    assert cfg.iptables.localhost_node_ports is False
    assert cfg.nftables.masquerade_bit == 0
    assert cfg.conntrack.max_per_core == 0
    assert cfg.conntrack.min == 0
    assert cfg.conntrack.tcp_established_timeout == Duration()
    assert cfg.conntrack.tcp_close_wait_timeout == Duration()


def test_null_means_unset() -> None:
    assert _cfg("mode: null\noomScoreAdj: null\nconntrack: null\nnodePortAddresses: null\n") == (
        defaults()
    )


@pytest.mark.parametrize(
    ("body", "healthz", "metrics"),
    [
        ("", "0.0.0.0:10256", "127.0.0.1:10249"),
        ("bindAddress: '::'\n", "[::]:10256", "[::1]:10249"),
        ("bindAddress: fd00::5\n", "[::]:10256", "[::1]:10249"),
        (
            "healthzBindAddress: 10.0.0.1\nmetricsBindAddress: ::1\n",
            "10.0.0.1:10256",
            "[::1]:10249",
        ),
        ("healthzBindAddress: 10.0.0.1:99\n", "10.0.0.1:99", "127.0.0.1:10249"),
        ("healthzBindAddress: ''\nmetricsBindAddress: ''\n", "0.0.0.0:10256", "127.0.0.1:10249"),
    ],
)
def test_server_addresses_default_and_get_their_port(body: str, healthz: str, metrics: str) -> None:
    cfg = _cfg(body)
    assert (cfg.healthz_bind_address, cfg.metrics_bind_address) == (healthz, metrics)
    validate(cfg)


# --- strict decoding ----------------------------------------------------------------------


# featureGates is a map of gate names, not a struct: any key is a gate name there.
STRUCT_PATHS = [p for p in _mapping_paths(yaml.safe_load(FULL)) if p != "featureGates"]


@pytest.mark.parametrize("path", STRUCT_PATHS)
def test_unknown_fields_are_rejected_at_every_level(path: str) -> None:
    tree = yaml.safe_load(FULL)
    _at(tree, path)["bogusField"] = 1
    expected = f"{path}.bogusField" if path else "bogusField"
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(tree))
    assert caught.value.field == expected
    assert str(caught.value) == f"{expected}: unknown field"


def test_mapping_paths_cover_every_section() -> None:
    assert {
        "",
        "clientConnection",
        "logging",
        "logging.vmodule[0]",
        "logging.vmodule[1]",
        "logging.options",
        "logging.options.text",
        "logging.options.json",
        "iptables",
        "ipvs",
        "nftables",
        "winkernel",
        "detectLocal",
        "conntrack",
    } == set(STRUCT_PATHS)


def test_misspelled_field_gets_a_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"^conntrack\.maxPercore: unknown field \(did you mean maxPerCore\?\)$"
    ):
        _cfg("conntrack:\n  maxPercore: 1\n")


def test_field_names_are_case_sensitive() -> None:
    with pytest.raises(ConfigError, match=r"^Mode: unknown field"):
        _cfg("Mode: nftables\n")


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("kind: KubeProxyConfiguration\n", "apiVersion", "missing"),
        ("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n", "kind", "missing"),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
            "apiVersion",
            "must be kubeproxy.config.k8s.io/v1alpha1",
        ),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
            "kind",
            "must be KubeProxyConfiguration",
        ),
        ("", "", "empty"),
        ("- a\n- b\n", "", "must hold a mapping"),
        (HEADER + "---\n" + HEADER, "", "2 YAML documents"),
        (HEADER + "mode: [\n", "", "not valid YAML"),
        ('{"kind": ', "", "not valid JSON"),
    ],
)
def test_bad_documents(text: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(text)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ("mode: 1\n", "mode", "must be a string, got number 1"),
        ("portRange: 8080\n", "portRange", "must be a string"),
        ("hostnameOverride: [a]\n", "hostnameOverride", "must be a string, got a list"),
        ("enableProfiling: 'yes'\n", "enableProfiling", 'must be true or false, got string "yes"'),
        ("iptables: {masqueradeAll: 1}\n", "iptables.masqueradeAll", "must be true or false"),
        ("oomScoreAdj: '-999'\n", "oomScoreAdj", "must be an integer"),
        ("oomScoreAdj: true\n", "oomScoreAdj", "must be an integer, got boolean true"),
        ("oomScoreAdj: 1.5\n", "oomScoreAdj", "must be an integer"),
        ("conntrack: {min: 4294967296}\n", "conntrack.min", "out of range"),
        ("logging: {verbosity: -1}\n", "logging.verbosity", "out of range"),
        ("iptables: {syncPeriod: 30}\n", "iptables.syncPeriod", "must be a duration string"),
        ("iptables: {syncPeriod: '30'}\n", "iptables.syncPeriod", "missing unit"),
        ("nftables: {minSyncPeriod: 1d}\n", "nftables.minSyncPeriod", "unknown unit"),
        ("conntrack: {udpTimeout: soon}\n", "conntrack.udpTimeout", "invalid duration"),
        ("clientConnection: {qps: fast}\n", "clientConnection.qps", "must be a number"),
        ("nodePortAddresses: primary\n", "nodePortAddresses", "must be a list of strings"),
        ("nodePortAddresses: [1]\n", "nodePortAddresses[0]", "must be a string"),
        ("ipvs: {excludeCIDRs: [10.0.0.0/8, 2]}\n", "ipvs.excludeCIDRs[1]", "must be a string"),
        ("featureGates: {A: 'on'}\n", "featureGates.A", "must be true or false"),
        ("featureGates: [A]\n", "featureGates", "must be a mapping"),
        ("conntrack: 5\n", "conntrack", "must be a mapping, got number 5"),
        ("logging: {vmodule: [{verbosity: 2}]}\n", "logging.vmodule[0].filePattern", "required"),
        ("logging: {vmodule: x}\n", "logging.vmodule", "must be a list"),
        (
            "logging: {options: {json: {infoBufferSize: lots}}}\n",
            "logging.options.json.infoBufferSize",
            "quantity",
        ),
        ("mode: nftables\nmode: iptables\n", "mode", "duplicate field"),
        ("iptables:\n  syncPeriod: 1s\n  syncPeriod: 2s\n", "syncPeriod", "duplicate field"),
    ],
)
def test_wrong_types_name_the_field(body: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        _cfg(body)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


def test_duplicate_fields_in_json_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^mode: duplicate field"):
        parse_config(
            '{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",'
            ' "mode": "nftables", "mode": "ipvs"}'
        )


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(tmp_path / "missing.yaml")


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ("mode: userspace\n", "mode", "must be iptables, ipvs, nftables or blank"),
        ("mode: kernelspace\n", "mode", "must be iptables"),
        ("iptables: {syncPeriod: -1s}\n", "iptables.syncPeriod", "greater than 0"),
        ("iptables: {minSyncPeriod: -1s}\n", "iptables.minSyncPeriod", "0 or more"),
        (
            "iptables: {minSyncPeriod: 1m}\n",
            "iptables.minSyncPeriod",
            r"must not exceed iptables\.syncPeriod \(30s\), got 1m0s",
        ),
        (
            "nftables: {syncPeriod: 5s, minSyncPeriod: 10s}\n",
            "nftables.minSyncPeriod",
            "must not exceed nftables.syncPeriod",
        ),
        ("ipvs: {syncPeriod: 1s, minSyncPeriod: 2s}\n", "ipvs.minSyncPeriod", "must not exceed"),
        ("iptables: {masqueradeBit: 32}\n", "iptables.masqueradeBit", r"\[0, 31\], got 32"),
        ("iptables: {masqueradeBit: -1}\n", "iptables.masqueradeBit", r"\[0, 31\]"),
        ("nftables: {masqueradeBit: 40}\n", "nftables.masqueradeBit", r"\[0, 31\]"),
        ("configSyncPeriod: -5m\n", "configSyncPeriod", "greater than 0"),
        ("bindAddress: localhost\n", "bindAddress", "not an IP address"),
        ("healthzBindAddress: localhost:10256\n", "healthzBindAddress", "not a valid IP"),
        (
            "healthzBindAddress: '0.0.0.0:0'\n",
            "healthzBindAddress",
            r"port must be in \[1, 65535\]",
        ),
        ("metricsBindAddress: '127.0.0.1:65536'\n", "metricsBindAddress", "port must be"),
        ("metricsBindAddress: '127.0.0.1:http'\n", "metricsBindAddress", "port must be"),
        ("metricsBindAddress: 'fd00::1:99:10249'\n", "metricsBindAddress", "IPv6 in brackets"),
        (
            "metricsBindAddress: '0.0.0.0:10256'\n",
            "metricsBindAddress",
            "collides with healthzBindAddress",
        ),
        (
            "healthzBindAddress: '[::]:10256'\nmetricsBindAddress: '10.0.0.1:10256'\n",
            "metricsBindAddress",
            "collides with healthzBindAddress",
        ),
        ("clusterCIDR: 10.0.0.0/33\n", "clusterCIDR", "is not a CIDR"),
        ("clusterCIDR: 10.0.0.1\n", "clusterCIDR", "is not a CIDR"),
        ("clusterCIDR: 10.0.0.0/8,10.1.0.0/16\n", "clusterCIDR", "one IPv4 and one IPv6"),
        ("clusterCIDR: 10.0.0.0/8,fd00::/8,fd01::/8\n", "clusterCIDR", "dual-stack pair"),
        (
            "nodePortAddresses: [primary, 10.0.0.0/8]\n",
            "nodePortAddresses[0]",
            "can't use both 'primary' and CIDRs",
        ),
        (
            "nodePortAddresses: [10.0.0.0/8, nowhere]\n",
            "nodePortAddresses[1]",
            "neither a CIDR nor",
        ),
        ("nodePortAddresses: [10.0.0.1]\n", "nodePortAddresses[0]", "neither a CIDR nor"),
        ("conntrack: {maxPerCore: -1}\n", "conntrack.maxPerCore", "0 or more"),
        ("conntrack: {min: -1}\n", "conntrack.min", "0 or more"),
        (
            "conntrack: {tcpEstablishedTimeout: -1s}\n",
            "conntrack.tcpEstablishedTimeout",
            "0 or more",
        ),
        ("conntrack: {tcpCloseWaitTimeout: -1s}\n", "conntrack.tcpCloseWaitTimeout", "0 or more"),
        ("conntrack: {udpTimeout: -1s}\n", "conntrack.udpTimeout", "0 or more"),
        ("conntrack: {udpStreamTimeout: -1s}\n", "conntrack.udpStreamTimeout", "0 or more"),
        ("ipvs: {tcpTimeout: -1s}\n", "ipvs.tcpTimeout", "0 or more"),
        ("ipvs: {tcpFinTimeout: -1s}\n", "ipvs.tcpFinTimeout", "0 or more"),
        ("ipvs: {udpTimeout: -1s}\n", "ipvs.udpTimeout", "0 or more"),
        ("ipvs: {scheduler: fastest}\n", "ipvs.scheduler", "unknown scheduler"),
        ("ipvs: {excludeCIDRs: [10.0.0.0/8, 300.0.0.0/8]}\n", "ipvs.excludeCIDRs[1]", "not a CIDR"),
        ("oomScoreAdj: 1001\n", "oomScoreAdj", r"\[-1000, 1000\]"),
        ("oomScoreAdj: -1001\n", "oomScoreAdj", r"\[-1000, 1000\]"),
        ("detectLocalMode: Magic\n", "detectLocalMode", "must be one of ClusterCIDR, NodeCIDR"),
        ("detectLocalMode: None\n", "detectLocalMode", "must be one of"),
        (
            "detectLocalMode: BridgeInterface\n",
            "detectLocal.bridgeInterface",
            "required when detectLocalMode is BridgeInterface",
        ),
        (
            "detectLocalMode: InterfaceNamePrefix\n",
            "detectLocal.interfaceNamePrefix",
            "required when detectLocalMode is InterfaceNamePrefix",
        ),
        (
            "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: a/b}\n",
            "detectLocal.bridgeInterface",
            "not a valid interface name",
        ),
        (
            "detectLocalMode: InterfaceNamePrefix\n"
            "detectLocal: {interfaceNamePrefix: averyveryverylongname}\n",
            "detectLocal.interfaceNamePrefix",
            "not a valid interface name",
        ),
        ("clientConnection: {burst: -1}\n", "clientConnection.burst", "0 or more"),
        (
            "clientConnection: {contentType: text/plain}\n",
            "clientConnection.contentType",
            "must be application/vnd.kubernetes.protobuf or application/json",
        ),
        ("logging: {format: xml}\n", "logging.format", "must be one of text, json"),
        ("logging: {flushFrequency: -1s}\n", "logging.flushFrequency", "greater than 0"),
        (
            "logging: {format: json, vmodule: [{filePattern: x, verbosity: 1}]}\n",
            "logging.vmodule",
            "only supported with the text log format",
        ),
        (
            "logging: {vmodule: [{filePattern: 'a=b', verbosity: 1}]}\n",
            "logging.vmodule[0].filePattern",
            "without ',' or '='",
        ),
        ("portRange: 200-100\n", "portRange", "port range"),
        ("portRange: lots\n", "portRange", "port range"),
        ("showHiddenMetricsForVersion: v1\n", "showHiddenMetricsForVersion", "<major>.<minor>"),
    ],
)
def test_each_validation_rule_names_the_field(body: str, field: str, message: str) -> None:
    cfg = _cfg(body)
    with pytest.raises(ConfigError, match=message) as caught:
        validate(cfg)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "body",
    [
        "clusterCIDR: 10.0.0.0/8,fd00::/64\n",
        "detectLocalMode: NodeCIDR\nclusterCIDR: whatever\n",  # unused in NodeCIDR mode
        "nodePortAddresses: [primary]\n",
        "nodePortAddresses: [primary, localhost]\n",
        "nodePortAddresses: [all]\n",
        "nodePortAddresses: [10.0.0.0/8, fd00::/8, localhost]\n",
        "healthzBindAddress: '127.0.0.1:10256'\nmetricsBindAddress: '[::1]:10256'\n",
        "metricsBindAddress: '10.0.0.1:10256'\nhealthzBindAddress: '10.0.0.2:10256'\n",
        "portRange: 30000+100\n",
        "portRange: '8080'\n",
        "ipvs: {scheduler: mh}\n",
        "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cni0}\n",
        "mode: iptables\niptables: {minSyncPeriod: 30s}\n",
    ],
)
def test_valid_edge_cases(body: str) -> None:
    validate(_cfg(body))


def test_validate_only_knows_linux() -> None:
    with pytest.raises(ValueError, match="linux"):
        validate(defaults(), platform="windows")


def test_programmatic_configuration_without_port_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^healthzBindAddress: must be IP:port"):
        validate(dataclasses.replace(defaults(), healthz_bind_address="10.0.0.1"))


# --- platform defaults and the proxier mapping --------------------------------------------


def test_platform_defaults() -> None:
    assert apply_platform_defaults(defaults()) == dataclasses.replace(
        defaults(), mode="iptables", detect_local_mode="ClusterCIDR"
    )
    nft = apply_platform_defaults(dataclasses.replace(defaults(), mode="nftables"))
    assert nft.node_port_addresses == ("primary",)
    kept = apply_platform_defaults(
        dataclasses.replace(defaults(), mode="nftables", node_port_addresses=("10.0.0.0/8",))
    )
    assert kept.node_port_addresses == ("10.0.0.0/8",)


def test_nftables_mode_takes_the_nftables_section() -> None:
    cfg = parse_config(FULL)
    config = to_proxier_config(cfg, "node-a")
    assert (config.sync_period, config.min_sync_period) == (3600.0, 0.5)
    assert (config.masquerade_bit, config.masquerade_all) == (12, True)
    assert config.node_port_addresses == ("192.168.0.0/16", "fd00::/8")
    assert config.node_name == "node-a"


def test_iptables_and_ipvs_modes_take_their_sections() -> None:
    cfg = parse_config(FULL)
    iptables = to_proxier_config(cfg, "n", "iptables")
    assert (iptables.sync_period, iptables.min_sync_period) == (60.0, 2.0)
    assert (iptables.masquerade_bit, iptables.masquerade_all) == (13, True)
    ipvs = to_proxier_config(cfg, "n", "ipvs")
    assert (ipvs.sync_period, ipvs.min_sync_period) == (45.0, 5.0)
    assert ipvs.masquerade_bit == 13


def test_node_port_addresses_default_per_mode() -> None:
    assert to_proxier_config(defaults(), "n", "nftables").node_port_addresses == ("primary",)
    assert to_proxier_config(defaults(), "n", "iptables").node_port_addresses == ()
    assert to_proxier_config(defaults(), "n").node_port_addresses == ()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("", LocalDetector()),
        (
            "clusterCIDR: 10.244.0.0/16,fd00::/56\n",
            LocalDetector(
                LocalDetectMode.CLUSTER_CIDR,
                (ipaddress.ip_network("10.244.0.0/16"), ipaddress.ip_network("fd00::/56")),
            ),
        ),
        ("detectLocalMode: NodeCIDR\n", LocalDetector(LocalDetectMode.NODE_CIDR)),
        (
            "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}\n",
            LocalDetector(LocalDetectMode.BRIDGE_INTERFACE, interface="cbr0"),
        ),
        (
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}\n",
            LocalDetector(LocalDetectMode.INTERFACE_NAME_PREFIX, interface="veth"),
        ),
    ],
)
def test_detect_local_maps_to_the_local_detector(body: str, expected: LocalDetector) -> None:
    assert to_proxier_config(_cfg(body), "n").local_detector == expected


def test_service_cidrs_and_bad_mode() -> None:
    cidr = ipaddress.ip_network("172.30.0.0/16")
    assert to_proxier_config(defaults(), "n", service_cidrs=[cidr]).service_cidrs == (cidr,)
    with pytest.raises(ConfigError, match=r"^mode:"):
        to_proxier_config(defaults(), "n", "userspace")
