"""Command line of the kube-proxy binaries: upstream's flags, ``--config``, and precedence.

Every upstream Linux flag is accepted with its name, syntax (Go durations, ``--flag=false``,
comma-separated lists) and default. Precedence is upstream's:

* without ``--config``: upstream's defaults, overridden by the flags given; the deprecated
  ``--healthz-port``/``--metrics-port`` then complete (or, with 0, disable) the bind
  addresses (not with ``--write-config-to``, as upstream);
* with ``--config``: the file wins and the flags that map to configuration fields are
  ignored (listed in :attr:`Options.ignored_flags`, with a warning in
  :attr:`Options.warnings`), except ``--hostname-override`` and the logging flags
  (``-v``, ``--logging-format``, ``--vmodule``, ``--log-*``), which override the file.
  Flags that are not configuration fields (``--master``, ``--cleanup``, ``--init-only``,
  ``--write-config-to``, ``--version``, and our ``--manifests``, ``--once``, ``--dry-run``,
  ``--service-cluster-ip-range``) always apply.

As upstream, the ``--iptables-[min-]sync-period`` flags also set the nftables section
(upstream applies them in every mode but ipvs), ``--masquerade-all`` applies to every mode,
and ``--iptables-masquerade-bit`` does not affect nftables mode (which uses
``nftables.masqueradeBit``, a file-only field).

The single-mode binaries pass ``fixed_mode``; a different ``mode`` in the file or
``--proxy-mode`` is an error. The multi-mode ``kube-proxy`` runs in iptables mode when no
mode is given, like upstream, and says so through :attr:`Options.mode_defaulted`.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kubeproxy.config import ProxierConfig
from kubeproxy.objects import IPNetwork
from kubeproxy.proxyconfig import (
    DEFAULT_HEALTHZ_PORT,
    DEFAULT_METRICS_PORT,
    LOG_FORMATS,
    PROXY_MODES,
    ConfigError,
    Duration,
    KubeProxyConfiguration,
    KubeProxyConntrackConfiguration,
    LoggingConfiguration,
    VModuleItem,
    append_port_if_needed,
    apply_platform_defaults,
    defaults,
    load_config_file,
    to_proxier_config,
    validate,
)

__all__ = [
    "MODE_DEFAULTED_MESSAGE",
    "Options",
    "OptionsError",
    "build_parser",
    "parse_options",
    "usage",
]

MODE_DEFAULTED_MESSAGE = (
    "No proxy mode was set (--proxy-mode or mode in the configuration file); running in "
    "iptables mode, upstream's current default. Upstream plans to make nftables the default: "
    "set the mode explicitly (nftables is recommended)."
)
"""What the multi-mode binary logs (and posts as an event) when the mode was defaulted."""


class OptionsError(ValueError):
    """A command line that cannot be used; the message names the flag or field."""


@dataclass(frozen=True, slots=True)
class Options:
    """What the command line (and ``--config`` file) asked for, validated and defaulted.

    ``configuration`` is the effective KubeProxyConfiguration (file or flags, with
    upstream's start-up defaults applied: ``mode`` is set); ``config`` is what the proxier
    of ``mode`` takes from it. ``show_help``/``show_version`` ask the binary to print
    :func:`usage` or its version and exit; the other fields then hold defaults only.
    """

    configuration: KubeProxyConfiguration
    config: ProxierConfig
    mode: str
    mode_defaulted: bool
    node_name: str
    config_file: Path | None = None
    write_config_to: Path | None = None
    manifests: Path | None = None
    master: str = ""
    once: bool = False
    dry_run: bool = False
    cleanup: bool = False
    init_only: bool = False
    show_help: bool = False
    show_version: str = ""
    ignored_flags: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def kubeconfig(self) -> str:
        """``clientConnection.kubeconfig`` (``--kubeconfig``); empty: in-cluster or ``master``."""
        return self.configuration.client_connection.kubeconfig

    @property
    def qps(self) -> float:
        """``clientConnection.qps`` (``--kube-api-qps``)."""
        return self.configuration.client_connection.qps

    @property
    def burst(self) -> int:
        """``clientConnection.burst`` (``--kube-api-burst``)."""
        return self.configuration.client_connection.burst

    @property
    def content_type(self) -> str:
        """``clientConnection.contentType`` (``--kube-api-content-type``)."""
        return self.configuration.client_connection.content_type

    @property
    def accept_content_types(self) -> str:
        """``clientConnection.acceptContentTypes``."""
        return self.configuration.client_connection.accept_content_types

    @property
    def healthz_bind_address(self) -> str:
        """``IP:port`` of the health server; empty disables it."""
        return self.configuration.healthz_bind_address

    @property
    def metrics_bind_address(self) -> str:
        """``IP:port`` of the metrics server; empty disables it."""
        return self.configuration.metrics_bind_address

    @property
    def bind_address_hard_fail(self) -> bool:
        """Whether failing to bind the health or metrics server is fatal."""
        return self.configuration.bind_address_hard_fail

    @property
    def enable_profiling(self) -> bool:
        """``enableProfiling`` (``--profiling``)."""
        return self.configuration.enable_profiling

    @property
    def logging(self) -> LoggingConfiguration:
        """The logging settings (file, overridden by the logging flags)."""
        return self.configuration.logging

    @property
    def verbosity(self) -> int:
        """``-v``: 0-2 info, 4 and more debug."""
        return self.configuration.logging.verbosity

    @property
    def logging_format(self) -> str:
        """``text`` or ``json``."""
        return self.configuration.logging.format

    @property
    def conntrack(self) -> KubeProxyConntrackConfiguration:
        """The conntrack sysctls to set at start-up (0: leave the kernel's value)."""
        return self.configuration.conntrack

    @property
    def oom_score_adj(self) -> int:
        """The ``oom_score_adj`` to give this process."""
        return self.configuration.oom_score_adj

    @property
    def config_sync_period(self) -> float:
        """``configSyncPeriod`` in seconds (informer resync)."""
        return self.configuration.config_sync_period.seconds

    @property
    def feature_gates(self) -> Mapping[str, bool]:
        """``featureGates`` (``--feature-gates``)."""
        return self.configuration.feature_gates


# --- value parsers (Go's flag syntax) -----------------------------------------------------

_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")


def _go_bool(text: str) -> bool:
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def _duration(text: str) -> Duration:
    try:
        return Duration.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{err} (e.g. 5s, 1m, 2h22m)") from None


def _integer(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?\d+", text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{low}, {high}]")
        return value

    return parse


_int32 = _integer(-(2**31), 2**31 - 1)
_uint32 = _integer(0, 2**32 - 1)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _ip(text: str) -> str:
    if text.strip():
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid IP address") from None
    return text


def _ip_or_ip_port(text: str) -> str:
    if not text.strip():
        return ""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not in a valid format (ip or ip:port)"
        ) from None
    if not sep or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{port!r} is not a valid port (in {text!r})")
    return text


def _csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part] if text else []


def _feature_gates(text: str) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for pair in _csv(text):
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"{pair!r} is not name=true|false")
        gates[name.strip()] = _go_bool(value.strip())
    return gates


def _vmodule(text: str) -> list[VModuleItem]:
    items = []
    for pair in _csv(text):
        pattern, sep, level = pair.partition("=")
        if not sep or not pattern:
            raise argparse.ArgumentTypeError(f"{pair!r} is not pattern=N")
        items.append(VModuleItem(pattern, _uint32(level)))
    return items


def _log_format(text: str) -> str:
    if text not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_FORMATS)}")
    return text


def _port(text: str) -> int:
    return _integer(0, 65535)(text)


def _port_range(text: str) -> str:
    if text.strip() and not re.fullmatch(r"\s*\d+(?:[-+]\d+)?\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a port range (e.g. 30000-32767)")
    return text


def _version(text: str) -> str:
    if text not in ("true", "false", "raw"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or raw")
    return text


# --- the parser ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`OptionsError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        """Turn argparse's complaint into an :class:`OptionsError` naming the flag."""
        unknown = "unrecognized arguments: "
        if message.startswith(unknown):
            raise OptionsError(f"unknown flag or argument: {message[len(unknown) :]}")
        match = re.match(r"argument ([^:]+): (.*)", message, re.DOTALL)
        if match:
            raise OptionsError(f"{match.group(1).split('/')[-1]}: {match.group(2)}")
        raise OptionsError(message)


@dataclass(frozen=True, slots=True)
class _Flag:
    """One flag: its names, parser, help, and the configuration field it sets (if any)."""

    names: tuple[str, ...]
    help: str
    kind: Callable[[str], Any] = str
    field: str = ""
    boolean: bool = False
    repeat: bool = False

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")


def _f(*names: str, help: str, field: str = "", kind: Callable[[str], Any] = str) -> _Flag:
    return _Flag(names, help, kind=kind, field=field)


def _b(name: str, *, help: str, field: str = "") -> _Flag:
    return _Flag((name,), help, kind=_go_bool, field=field, boolean=True)


def _list(name: str, *, help: str, field: str, kind: Callable[[str], Any] = _csv) -> _Flag:
    return _Flag((name,), help, kind=kind, field=field, repeat=True)


_IGNORED_WITH_CONFIG = "Ignored when --config is given."
_FLAGS: tuple[_Flag, ...] = (
    _f(
        "--config",
        help="The path to the configuration file (a KubeProxyConfiguration, "
        "kubeproxy.config.k8s.io/v1alpha1, YAML or JSON).",
        kind=Path,
    ),
    _f(
        "--write-config-to",
        help="Write the effective configuration to this file and exit.",
        kind=Path,
    ),
    _b(
        "--cleanup",
        help=(
            "Remove what every proxy mode makes, whichever mode this binary runs: the ip "
            "and ip6 kube-proxy nftables tables, iptables mode's chains and jumps (both "
            "iptables variants, both families), ipvs mode's virtual servers, kube-ipvs0 "
            "interface, ipsets and chains; then exit (1 if a mode could not be cleaned). "
            "Nothing else is touched."
        ),
    ),
    _b(
        "--init-only",
        help="Do the set-up that needs full root privileges (sysctls), then "
        "exit; run again with only CAP_NET_ADMIN.",
    ),
    _f(
        "--version",
        help="Print version information and exit (--version=raw: more detail).",
        kind=_version,
    ),
    _f(
        "--proxy-mode",
        help="Which proxy mode to use: iptables (default), ipvs (deprecated) "
        "or nftables. " + _IGNORED_WITH_CONFIG,
        field="mode",
    ),
    _list(
        "--feature-gates",
        help="Comma-separated name=true|false feature gates. " + _IGNORED_WITH_CONFIG,
        field="featureGates",
        kind=_feature_gates,
    ),
    _f(
        "--kubeconfig",
        help="Path to a kubeconfig file with authorization information (the "
        "server can be overridden by --master). " + _IGNORED_WITH_CONFIG,
        field="clientConnection.kubeconfig",
    ),
    _f(
        "--master",
        help="The address of the Kubernetes API server (overrides any value in the kubeconfig).",
    ),
    _f(
        "--kube-api-content-type",
        help="Content type of requests sent to the API server "
        "(default application/vnd.kubernetes.protobuf; this client speaks JSON either way). "
        + _IGNORED_WITH_CONFIG,
        field="clientConnection.contentType",
    ),
    _f(
        "--kube-api-burst",
        help="Burst to use while talking to the API server (default 10). " + _IGNORED_WITH_CONFIG,
        field="clientConnection.burst",
        kind=_int32,
    ),
    _f(
        "--kube-api-qps",
        help="QPS to use while talking to the API server (default 5). " + _IGNORED_WITH_CONFIG,
        field="clientConnection.qps",
        kind=_number,
    ),
    _f(
        "--hostname-override",
        help="The name of this Node (default: the OS hostname). "
        "Overrides hostnameOverride of the configuration file.",
        field="hostnameOverride",
    ),
    _f(
        "--bind-address",
        help="Overrides this node's primary IP (binds nothing; default "
        "0.0.0.0). " + _IGNORED_WITH_CONFIG,
        field="bindAddress",
        kind=_ip,
    ),
    _f(
        "--healthz-bind-address",
        help="IP[:port] of the health server (default "
        "0.0.0.0:10256); empty disables it. " + _IGNORED_WITH_CONFIG,
        field="healthzBindAddress",
        kind=_ip_or_ip_port,
    ),
    _f(
        "--metrics-bind-address",
        help="IP[:port] of the metrics server (default "
        "127.0.0.1:10249); empty disables it. " + _IGNORED_WITH_CONFIG,
        field="metricsBindAddress",
        kind=_ip_or_ip_port,
    ),
    _b(
        "--bind-address-hard-fail",
        help="Exit if the health or metrics server cannot bind. " + _IGNORED_WITH_CONFIG,
        field="bindAddressHardFail",
    ),
    _b(
        "--profiling",
        help="Serve profiling data on the metrics server. " + _IGNORED_WITH_CONFIG,
        field="enableProfiling",
    ),
    _f(
        "--show-hidden-metrics-for-version",
        help="The previous version for which to show "
        "hidden metrics (<major>.<minor>). " + _IGNORED_WITH_CONFIG,
        field="showHiddenMetricsForVersion",
    ),
    _b(
        "--masquerade-all",
        help="SNAT all traffic sent to Service cluster IPs (every mode). " + _IGNORED_WITH_CONFIG,
        field="iptables.masqueradeAll",
    ),
    _f(
        "--iptables-masquerade-bit",
        help="The fwmark bit that asks for SNAT in iptables and "
        "ipvs modes [0-31] (default 14; nftables mode uses nftables.masqueradeBit). "
        + _IGNORED_WITH_CONFIG,
        field="iptables.masqueradeBit",
        kind=_int32,
    ),
    _b(
        "--iptables-localhost-nodeports",
        help="Allow NodePorts on localhost (iptables mode, "
        "IPv4; default true). " + _IGNORED_WITH_CONFIG,
        field="iptables.localhostNodePorts",
    ),
    _f(
        "--iptables-sync-period",
        help="Period of re-synchronizing and cleanup operations "
        "(default 30s; also nftables mode). " + _IGNORED_WITH_CONFIG,
        field="iptables.syncPeriod",
        kind=_duration,
    ),
    _f(
        "--iptables-min-sync-period",
        help="Minimum period between rule syncs (default 1s; "
        "also nftables mode). " + _IGNORED_WITH_CONFIG,
        field="iptables.minSyncPeriod",
        kind=_duration,
    ),
    _f(
        "--ipvs-sync-period",
        help="ipvs mode: period of re-synchronizing operations (default "
        "30s). " + _IGNORED_WITH_CONFIG,
        field="ipvs.syncPeriod",
        kind=_duration,
    ),
    _f(
        "--ipvs-min-sync-period",
        help="ipvs mode: minimum period between rule syncs. " + _IGNORED_WITH_CONFIG,
        field="ipvs.minSyncPeriod",
        kind=_duration,
    ),
    _f(
        "--ipvs-scheduler",
        help="ipvs mode: the scheduler (default rr). " + _IGNORED_WITH_CONFIG,
        field="ipvs.scheduler",
    ),
    _list(
        "--ipvs-exclude-cidrs",
        help="ipvs mode: comma-separated CIDRs the cleanup leaves alone. " + _IGNORED_WITH_CONFIG,
        field="ipvs.excludeCIDRs",
    ),
    _b(
        "--ipvs-strict-arp",
        help="ipvs mode: set arp_ignore=1 and arp_announce=2. " + _IGNORED_WITH_CONFIG,
        field="ipvs.strictARP",
    ),
    _f(
        "--ipvs-tcp-timeout",
        help="ipvs mode: idle TCP timeout, 0 leaves it as is. " + _IGNORED_WITH_CONFIG,
        field="ipvs.tcpTimeout",
        kind=_duration,
    ),
    _f(
        "--ipvs-tcpfin-timeout",
        help="ipvs mode: TCP timeout after FIN, 0 leaves it as is. " + _IGNORED_WITH_CONFIG,
        field="ipvs.tcpFinTimeout",
        kind=_duration,
    ),
    _f(
        "--ipvs-udp-timeout",
        help="ipvs mode: UDP timeout, 0 leaves it as is. " + _IGNORED_WITH_CONFIG,
        field="ipvs.udpTimeout",
        kind=_duration,
    ),
    _f(
        "--detect-local-mode",
        help="How to detect local pod traffic: ClusterCIDR (default), "
        "NodeCIDR, BridgeInterface, InterfaceNamePrefix. " + _IGNORED_WITH_CONFIG,
        field="detectLocalMode",
    ),
    _f(
        "--pod-bridge-interface",
        help="The bridge that local pod traffic comes from "
        "(BridgeInterface mode). " + _IGNORED_WITH_CONFIG,
        field="detectLocal.bridgeInterface",
    ),
    _f(
        "--pod-interface-name-prefix",
        help="The interface-name prefix of local pod traffic "
        "(InterfaceNamePrefix mode). " + _IGNORED_WITH_CONFIG,
        field="detectLocal.interfaceNamePrefix",
    ),
    _f(
        "--cluster-cidr",
        help="The pods' CIDR (or a comma-separated dual-stack pair); with "
        "ClusterCIDR mode, traffic from it is local. " + _IGNORED_WITH_CONFIG,
        field="clusterCIDR",
    ),
    _list(
        "--nodeport-addresses",
        help="Comma-separated CIDRs and keywords (primary, "
        "localhost, all) of the node addresses that accept NodePorts (default: primary in "
        "nftables mode, all otherwise). " + _IGNORED_WITH_CONFIG,
        field="nodePortAddresses",
    ),
    _f(
        "--oom-score-adj",
        help="The oom_score_adj of this process [-1000, 1000] (default "
        "-999). " + _IGNORED_WITH_CONFIG,
        field="oomScoreAdj",
        kind=_int32,
    ),
    _f(
        "--conntrack-max-per-core",
        help="Conntrack entries to allow per CPU (default 32768; "
        "0 leaves the limit as is). " + _IGNORED_WITH_CONFIG,
        field="conntrack.maxPerCore",
        kind=_int32,
    ),
    _f(
        "--conntrack-min",
        help="Minimum conntrack entries, whatever the CPU count (default "
        "131072). " + _IGNORED_WITH_CONFIG,
        field="conntrack.min",
        kind=_int32,
    ),
    _f(
        "--conntrack-tcp-timeout-established",
        help="Idle timeout of established TCP "
        "connections (default 24h0m0s; 0 leaves it as is). " + _IGNORED_WITH_CONFIG,
        field="conntrack.tcpEstablishedTimeout",
        kind=_duration,
    ),
    _f(
        "--conntrack-tcp-timeout-close-wait",
        help="Timeout of TCP connections in CLOSE_WAIT (default 1h0m0s). " + _IGNORED_WITH_CONFIG,
        field="conntrack.tcpCloseWaitTimeout",
        kind=_duration,
    ),
    _b(
        "--conntrack-tcp-be-liberal",
        help="Set nf_conntrack_tcp_be_liberal to 1. " + _IGNORED_WITH_CONFIG,
        field="conntrack.tcpBeLiberal",
    ),
    _f(
        "--conntrack-udp-timeout",
        help="Idle timeout of UNREPLIED UDP flows (0 leaves it as is). " + _IGNORED_WITH_CONFIG,
        field="conntrack.udpTimeout",
        kind=_duration,
    ),
    _f(
        "--conntrack-udp-timeout-stream",
        help="Idle timeout of ASSURED UDP flows (0 leaves it as is). " + _IGNORED_WITH_CONFIG,
        field="conntrack.udpStreamTimeout",
        kind=_duration,
    ),
    _f(
        "--config-sync-period",
        help="How often the API caches are resynced (default 15m0s). " + _IGNORED_WITH_CONFIG,
        field="configSyncPeriod",
        kind=_duration,
    ),
    _f(
        "--healthz-port",
        help="DEPRECATED (use --healthz-bind-address): the health server's "
        "port, 0 disables it. " + _IGNORED_WITH_CONFIG,
        kind=_port,
    ),
    _f(
        "--metrics-port",
        help="DEPRECATED (use --metrics-bind-address): the metrics server's "
        "port, 0 disables it. " + _IGNORED_WITH_CONFIG,
        kind=_port,
    ),
    _f(
        "--proxy-port-range",
        help="DEPRECATED, no effect. " + _IGNORED_WITH_CONFIG,
        field="portRange",
        kind=_port_range,
    ),
    _f(
        "-v",
        "--v",
        help="Log verbosity: 0-2 info, 4 and more debug. Overrides the file.",
        field="logging.verbosity",
        kind=_uint32,
    ),
    _f(
        "--logging-format",
        help="Log format: text or json. Overrides the file.",
        field="logging.format",
        kind=_log_format,
    ),
    _list(
        "--vmodule",
        help="Comma-separated pattern=N verbosity per logger or module (text "
        "format only). Overrides the file.",
        field="logging.vmodule",
        kind=_vmodule,
    ),
    _f(
        "--log-flush-frequency",
        help="Accepted for compatibility (lines are never buffered). Overrides the file.",
        field="logging.flushFrequency",
        kind=_duration,
    ),
    _b(
        "--log-text-split-stream",
        help="Text format: info lines to stdout, errors to stderr. Overrides the file.",
        field="logging.options.text.splitStream",
    ),
    _f(
        "--log-text-info-buffer-size",
        help="Accepted for compatibility (no buffering). Overrides the file.",
        field="logging.options.text.infoBufferSize",
    ),
    _b(
        "--log-json-split-stream",
        help="JSON format: info lines to stdout, errors to stderr. Overrides the file.",
        field="logging.options.json.splitStream",
    ),
    _f(
        "--log-json-info-buffer-size",
        help="Accepted for compatibility (no buffering). Overrides the file.",
        field="logging.options.json.infoBufferSize",
    ),
    _f(
        "--manifests",
        help="Proxy the Services/EndpointSlices/Nodes in this directory of "
        "YAML manifests (watched for changes) instead of an API server.",
        kind=Path,
    ),
    _b("--once", help="Sync once and exit (0 when the sync succeeded)."),
    _b("--dry-run", help="Print the rule transactions a sync would run; touch nothing."),
    _f(
        "--service-cluster-ip-range",
        help="Comma-separated Service CIDRs: traffic to "
        "unallocated Service IPs in them is rejected when the API offers no ServiceCIDR "
        "objects.",
    ),
    _f(
        "--boot-id-file",
        help="Accepted for upstream's command line (a flag its binary inherits from a "
        "library); has no effect.",
    ),
    _Flag(("-h", "--help"), "Show this help and exit."),
)
_BY_DEST = {flag.dest: flag for flag in _FLAGS}
# The modes a flag matters in (the others accept it, as upstream's binary does).
_ONLY_FOR: dict[str, frozenset[str]] = {
    "iptables_masquerade_bit": frozenset({"iptables", "ipvs"}),
    "iptables_localhost_nodeports": frozenset({"iptables"}),
    "iptables_sync_period": frozenset({"iptables", "nftables"}),
    "iptables_min_sync_period": frozenset({"iptables", "nftables"}),
    **{flag.dest: frozenset({"ipvs"}) for flag in _FLAGS if flag.field.startswith("ipvs.")},
}


def _help(flag: _Flag, fixed_mode: str | None) -> str:
    """``flag``'s help as one binary describes it."""
    if flag.dest == "proxy_mode":
        if fixed_mode is None:
            return flag.help
        return (
            f"This binary always runs in {fixed_mode} mode: leave the mode unset or set it to "
            f"{fixed_mode}; any other is an error (the multi-mode kube-proxy binary runs the "
            "others). " + _IGNORED_WITH_CONFIG
        )
    modes = _ONLY_FOR.get(flag.dest)
    if fixed_mode is not None and modes is not None and fixed_mode not in modes:
        return f"{flag.help} Not used by this binary ({fixed_mode} mode): accepted only."
    return flag.help


# Flags that still apply when --config is given, overriding the file.
_OVERRIDE_CONFIG = {"hostname_override"} | {
    flag.dest for flag in _FLAGS if flag.field.startswith("logging.")
}


_METAVARS: dict[Callable[[str], Any], str] = {
    _duration: "DURATION",
    _int32: "INT",
    _uint32: "INT",
    _port: "PORT",
    _number: "FLOAT",
    Path: "PATH",
    _ip: "IP",
    _ip_or_ip_port: "IP[:PORT]",
    _log_format: "FORMAT",
    _port_range: "RANGE",
}


def build_parser(prog: str, fixed_mode: str | None = None) -> argparse.ArgumentParser:
    """The flag parser of one binary; errors raise :class:`OptionsError`.

    Every flag's default is "not given" (absent from the namespace), so precedence can
    tell the flags given from the defaults.
    """
    what = f"{fixed_mode} mode" if fixed_mode else "iptables, ipvs or nftables mode"
    parser = _Parser(
        prog=prog,
        description=f"Kubernetes service proxy ({what}); upstream kube-proxy's flags and "
        "configuration file.",
        allow_abbrev=False,
        add_help=False,
        argument_default=argparse.SUPPRESS,
    )
    for flag in _FLAGS:
        names = flag.names
        if flag.dest == "help":
            parser.add_argument(
                *names, dest="help", action="store_true", help=_help(flag, fixed_mode)
            )
        elif flag.boolean:
            parser.add_argument(
                *names,
                dest=flag.dest,
                nargs="?",
                const=True,
                type=flag.kind,
                help=_help(flag, fixed_mode),
                metavar="BOOL",
            )
        elif flag.repeat:
            parser.add_argument(
                *names,
                dest=flag.dest,
                action="append",
                type=flag.kind,
                help=_help(flag, fixed_mode),
                metavar="LIST",
            )
        elif flag.dest == "version":
            parser.add_argument(
                *names,
                dest="version",
                nargs="?",
                const="true",
                type=flag.kind,
                help=_help(flag, fixed_mode),
            )
        else:
            metavar = _METAVARS.get(flag.kind, "STRING")
            parser.add_argument(
                *names,
                dest=flag.dest,
                type=flag.kind,
                help=_help(flag, fixed_mode),
                metavar=metavar,
            )
    return parser


def usage(prog: str, fixed_mode: str | None = None) -> str:
    """The ``--help`` text of one binary."""
    return build_parser(prog, fixed_mode).format_help()


# --- flags into a configuration -----------------------------------------------------------


def _flatten(values: list[list[Any]]) -> list[Any]:
    # pflag's list flags: the first use replaces the default, later uses append.
    return [item for chunk in values for item in chunk]


def _merged_gates(values: list[dict[str, bool]]) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for chunk in values:
        gates.update(chunk)
    return gates


def _apply_logging_flags(
    logging_config: LoggingConfiguration, given: Mapping[str, Any]
) -> LoggingConfiguration:
    out = logging_config
    if "v" in given:
        out = dataclasses.replace(out, verbosity=given["v"])
    if "logging_format" in given:
        out = dataclasses.replace(out, format=given["logging_format"])
    if "vmodule" in given:
        # Flags first: the first matching pattern wins, so the command line has priority.
        out = dataclasses.replace(
            out, vmodule=(*_flatten(given["vmodule"]), *logging_config.vmodule)
        )
    if "log_flush_frequency" in given:
        out = dataclasses.replace(out, flush_frequency=given["log_flush_frequency"])
    options = out.options
    for name in ("text", "json"):
        routing = getattr(options, name)
        if f"log_{name}_split_stream" in given:
            routing = dataclasses.replace(routing, split_stream=given[f"log_{name}_split_stream"])
        if f"log_{name}_info_buffer_size" in given:
            routing = dataclasses.replace(
                routing, info_buffer_size=given[f"log_{name}_info_buffer_size"]
            )
        options = dataclasses.replace(options, **{name: routing})
    return dataclasses.replace(out, options=options)


def _config_from_flags(given: Mapping[str, Any]) -> KubeProxyConfiguration:
    """Upstream's defaults overridden by the flags given (no ``--config``)."""
    base = defaults()
    # Upstream keeps one internal minSyncPeriod, initialised from the iptables default
    # (1s); only --ipvs-min-sync-period replaces it in ipvs mode.
    ipvs = dataclasses.replace(base.ipvs, min_sync_period=base.iptables.min_sync_period)
    cfg = dataclasses.replace(base, ipvs=ipvs)

    def pick(dest: str, current: Any) -> Any:
        return given.get(dest, current)

    client = cfg.client_connection
    client = dataclasses.replace(
        client,
        kubeconfig=pick("kubeconfig", client.kubeconfig),
        content_type=pick("kube_api_content_type", client.content_type),
        burst=pick("kube_api_burst", client.burst),
        qps=pick("kube_api_qps", client.qps),
    )
    masquerade_all = pick("masquerade_all", False)
    iptables = dataclasses.replace(
        cfg.iptables,
        masquerade_bit=pick("iptables_masquerade_bit", cfg.iptables.masquerade_bit),
        masquerade_all=masquerade_all,
        localhost_node_ports=pick("iptables_localhost_nodeports", True),
        sync_period=pick("iptables_sync_period", cfg.iptables.sync_period),
        min_sync_period=pick("iptables_min_sync_period", cfg.iptables.min_sync_period),
    )
    nftables = dataclasses.replace(
        cfg.nftables,
        masquerade_all=masquerade_all,
        sync_period=pick("iptables_sync_period", cfg.nftables.sync_period),
        min_sync_period=pick("iptables_min_sync_period", cfg.nftables.min_sync_period),
    )
    ipvs = dataclasses.replace(
        cfg.ipvs,
        sync_period=pick("ipvs_sync_period", cfg.ipvs.sync_period),
        min_sync_period=pick("ipvs_min_sync_period", cfg.ipvs.min_sync_period),
        scheduler=pick("ipvs_scheduler", ""),
        exclude_cidrs=tuple(_flatten(given.get("ipvs_exclude_cidrs", []))),
        strict_arp=pick("ipvs_strict_arp", False),
        tcp_timeout=pick("ipvs_tcp_timeout", Duration()),
        tcp_fin_timeout=pick("ipvs_tcpfin_timeout", Duration()),
        udp_timeout=pick("ipvs_udp_timeout", Duration()),
    )
    ct = cfg.conntrack
    conntrack = dataclasses.replace(
        ct,
        max_per_core=pick("conntrack_max_per_core", ct.max_per_core),
        min=pick("conntrack_min", ct.min),
        tcp_established_timeout=pick(
            "conntrack_tcp_timeout_established", ct.tcp_established_timeout
        ),
        tcp_close_wait_timeout=pick("conntrack_tcp_timeout_close_wait", ct.tcp_close_wait_timeout),
        tcp_be_liberal=pick("conntrack_tcp_be_liberal", False),
        udp_timeout=pick("conntrack_udp_timeout", Duration()),
        udp_stream_timeout=pick("conntrack_udp_timeout_stream", Duration()),
    )
    detect_local = dataclasses.replace(
        cfg.detect_local,
        bridge_interface=pick("pod_bridge_interface", ""),
        interface_name_prefix=pick("pod_interface_name_prefix", ""),
    )
    healthz = pick("healthz_bind_address", cfg.healthz_bind_address)
    metrics = pick("metrics_bind_address", cfg.metrics_bind_address)
    if "write_config_to" not in given:
        healthz = _address_from_port(healthz, given.get("healthz_port", DEFAULT_HEALTHZ_PORT))
        metrics = _address_from_port(metrics, given.get("metrics_port", DEFAULT_METRICS_PORT))
    return dataclasses.replace(
        cfg,
        feature_gates=_merged_gates(given.get("feature_gates", [])),
        client_connection=client,
        logging=_apply_logging_flags(cfg.logging, given),
        bind_address=pick("bind_address", cfg.bind_address),
        healthz_bind_address=healthz,
        metrics_bind_address=metrics,
        bind_address_hard_fail=pick("bind_address_hard_fail", False),
        enable_profiling=pick("profiling", False),
        show_hidden_metrics_for_version=pick("show_hidden_metrics_for_version", ""),
        mode=pick("proxy_mode", ""),
        iptables=iptables,
        ipvs=ipvs,
        nftables=nftables,
        detect_local_mode=pick("detect_local_mode", ""),
        detect_local=detect_local,
        cluster_cidr=pick("cluster_cidr", ""),
        node_port_addresses=tuple(_flatten(given.get("nodeport_addresses", []))),
        oom_score_adj=pick("oom_score_adj", cfg.oom_score_adj),
        conntrack=conntrack,
        config_sync_period=pick("config_sync_period", cfg.config_sync_period),
        port_range=pick("proxy_port_range", ""),
    )


def _address_from_port(address: str, port: int) -> str:
    """Upstream's handling of the deprecated port flags: 0 disables, else fill in the port."""
    if port == 0:
        return ""
    return append_port_if_needed(address, port)


# --- errors -------------------------------------------------------------------------------

# Configuration fields set by a flag of another name than the field's.
_EXTRA_FIELD_FLAGS = {
    "nftables.syncPeriod": "--iptables-sync-period",
    "nftables.minSyncPeriod": "--iptables-min-sync-period",
    "nftables.masqueradeAll": "--masquerade-all",
}
_FIELD_FLAGS = {
    **{flag.field: flag.names[-1] for flag in _FLAGS if flag.field},
    **_EXTRA_FIELD_FLAGS,
}


def _flag_for(field_path: str) -> str:
    path = re.sub(r"\[\d+\]", "", field_path)
    while path:
        if path in _FIELD_FLAGS:
            return _FIELD_FLAGS[path]
        path = path.rpartition(".")[0]
    return ""


def _named(err: ConfigError, config_file: Path | None, given: Mapping[str, Any]) -> OptionsError:
    """The error, named after the flag that set the field, or the file it came from."""
    flag = _flag_for(err.field)
    dest = _BY_DEST[flag.lstrip("-").replace("-", "_")].dest if flag else ""
    if config_file is not None and not (dest in _OVERRIDE_CONFIG and dest in given):
        return OptionsError(f"--config {config_file}: {err}")
    if flag:
        return OptionsError(f"{flag}: {err}")
    return OptionsError(str(err))


# --- entry point --------------------------------------------------------------------------


def _node_name(cfg: KubeProxyConfiguration, get_hostname: Callable[[], str]) -> str:
    name = (cfg.hostname_override or get_hostname()).strip().lower()
    if not name:
        raise ConfigError("hostnameOverride", "empty hostname is invalid")
    return name


def _service_cidrs(text: str) -> tuple[IPNetwork, ...]:
    cidrs: list[IPNetwork] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            cidrs.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise OptionsError(f"--service-cluster-ip-range: {part!r} is not a CIDR") from None
    return tuple(cidrs)


def _early_exit(fixed_mode: str | None, given: Mapping[str, Any]) -> Options:
    """Options for ``--help``/``--version``: upstream acts on them before reading anything."""
    cfg = apply_platform_defaults(dataclasses.replace(defaults(), mode=fixed_mode or ""))
    version = given.get("version", "false")
    return Options(
        configuration=cfg,
        config=to_proxier_config(cfg, ""),
        mode=cfg.mode,
        mode_defaulted=fixed_mode is None,
        node_name="",
        show_help=bool(given.get("help")),
        show_version="" if version == "false" else version,
    )


def parse_options(
    argv: Sequence[str],
    prog: str,
    fixed_mode: str | None = None,
    *,
    get_hostname: Callable[[], str] = socket.gethostname,
    default_nodeport: Sequence[str] | None = None,
) -> Options:
    """Parse ``argv`` (and the ``--config`` file) for ``prog``; raise :class:`OptionsError`.

    ``fixed_mode`` (``nftables``, ``iptables``, ``ipvs``) is the mode of a single-mode
    binary; ``None`` is the multi-mode ``kube-proxy``. ``get_hostname`` gives the node name
    when none is configured. ``default_nodeport`` is transitional, for callers written
    before ``fixed_mode`` existed: passing it means ``fixed_mode="nftables"``.
    """
    if default_nodeport is not None and fixed_mode is None:
        fixed_mode = "nftables"
    if fixed_mode is not None and fixed_mode not in PROXY_MODES:
        raise ValueError(f"fixed_mode must be one of {', '.join(PROXY_MODES)}, not {fixed_mode!r}")
    given: dict[str, Any] = vars(build_parser(prog, fixed_mode).parse_args(list(argv)))
    if given.get("help") or given.get("version", "false") != "false":
        return _early_exit(fixed_mode, given)

    config_file: Path | None = given.get("config")
    warnings: list[str] = []
    ignored: tuple[str, ...] = ()
    if config_file is not None:
        try:
            cfg = load_config_file(config_file)
        except ConfigError as err:
            raise OptionsError(f"--config {config_file}: {err}") from None
        cfg = dataclasses.replace(cfg, logging=_apply_logging_flags(cfg.logging, given))
        ignored = tuple(
            _BY_DEST[dest].names[-1]
            for dest in given
            if (_BY_DEST[dest].field or dest in ("healthz_port", "metrics_port"))
            and dest not in _OVERRIDE_CONFIG
        )
        if ignored:
            warnings.append(
                f"Flags ignored because --config is given (the file wins): {', '.join(ignored)}"
            )
    else:
        cfg = _config_from_flags(given)
    for dest in ("healthz_port", "metrics_port", "proxy_port_range"):
        if dest in given:
            warnings.append(f"Flag {_BY_DEST[dest].names[-1]} is deprecated: {_BY_DEST[dest].help}")

    mode_source = "--proxy-mode" if config_file is None else f"--config {config_file}: mode"
    if fixed_mode is not None:
        if cfg.mode and cfg.mode != fixed_mode:
            raise OptionsError(
                f"{mode_source}: {prog} always runs in {fixed_mode} mode, got {cfg.mode!r} "
                f"(leave mode unset or set it to {fixed_mode})"
            )
        mode_defaulted = False
        cfg = dataclasses.replace(cfg, mode=fixed_mode)
    else:
        mode_defaulted = not cfg.mode
    cfg = apply_platform_defaults(cfg)

    override = given.get("hostname_override", "")
    if override:
        if not override.strip():
            raise OptionsError("--hostname-override: empty hostname-override is invalid")
        cfg = dataclasses.replace(cfg, hostname_override=override.strip().lower())

    manifests: Path | None = given.get("manifests")
    if manifests is not None and not manifests.is_dir():
        raise OptionsError(f"--manifests: {manifests} is not a directory")
    service_cidrs = _service_cidrs(given.get("service_cluster_ip_range", ""))
    try:
        validate(cfg)
        node_name = _node_name(cfg, get_hostname)
        proxier_config = to_proxier_config(cfg, node_name, cfg.mode, service_cidrs=service_cidrs)
    except ConfigError as err:
        raise _named(err, config_file, given) from None
    except ValueError as err:
        raise OptionsError(str(err)) from None
    return Options(
        configuration=cfg,
        config=proxier_config,
        mode=cfg.mode,
        mode_defaulted=mode_defaulted,
        node_name=node_name,
        config_file=config_file,
        write_config_to=given.get("write_config_to"),
        manifests=manifests,
        master=given.get("master", ""),
        once=bool(given.get("once", False)),
        dry_run=bool(given.get("dry_run", False)),
        cleanup=bool(given.get("cleanup", False)),
        init_only=bool(given.get("init_only", False)),
        ignored_flags=ignored,
        warnings=tuple(warnings),
    )
