"""Upstream's kube-proxy flags: the table of every flag, its value syntax, and the parser.

Every upstream Linux flag with its name, syntax (Go durations, ``--flag=false``,
comma-separated lists), help text and the configuration field it sets; our own
(``--manifests``, ``--once``, ``--dry-run``, ``--cleanup-leftovers``) beside them. How
flags and ``--config`` combine is :mod:`kubeproxy.cmd.commandline`' business.

Longer than most modules (about 680 lines) because :data:`FLAGS` is a table of some
seventy entries with upstream's help texts: one entry per flag, in one place, is what
keeps ``--help`` and the configuration mapping from drifting apart.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kubeproxy.configfile.model import LOG_FORMATS, Duration, VModuleItem
from kubeproxy.featuregates import known_features

__all__ = [
    "BY_DEST",
    "FLAGS",
    "OVERRIDE_CONFIG",
    "Flag",
    "OptionsError",
    "build_parser",
    "usage",
]


class OptionsError(ValueError):
    """A command line that cannot be used; the message names the flag or field."""


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


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, keeping the line breaks a help text has (upstream's
    ``--feature-gates`` help lists one gate per line)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        for line in text.splitlines():
            lines.extend(super()._split_lines(line, width) or [""])
        return lines


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
class Flag:
    """One flag: its names, parser, help, and the configuration field it sets (if any)."""

    names: tuple[str, ...]
    help: str
    kind: Callable[[str], Any] = str
    field: str = ""
    boolean: bool = False
    repeat: bool = False

    @property
    def dest(self) -> str:
        """The attribute the parser stores it under (its long name in snake case)."""
        return self.names[-1].lstrip("-").replace("-", "_")


def _f(*names: str, help: str, field: str = "", kind: Callable[[str], Any] = str) -> Flag:
    return Flag(names, help, kind=kind, field=field)


def _b(name: str, *, help: str, field: str = "") -> Flag:
    return Flag((name,), help, kind=_go_bool, field=field, boolean=True)


def _list(name: str, *, help: str, field: str, kind: Callable[[str], Any] = _csv) -> Flag:
    return Flag((name,), help, kind=kind, field=field, repeat=True)


_IGNORED_WITH_CONFIG = "Ignored when --config is given."
FLAGS: tuple[Flag, ...] = (
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
        "--cleanup-leftovers",
        help=(
            "After upstream's kube-proxy took the node back: remove what only this proxy "
            "makes and upstream's leaves unused (in the kube-proxy nftables tables, our "
            "generation of sets, maps and chains and our affinity and localhost NodePort "
            "objects; in iptables, KUBE-SERVICE-IPS once nothing jumps to it); then exit "
            "(1 if a mode could not be cleaned). No name upstream writes is touched, and "
            "nothing is while our rules are still in use."
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
        help="A set of key=value pairs that describe feature gates for alpha/experimental "
        "features (upstream 1.37's gates; GA and deprecated ones are accepted too). "
        + _IGNORED_WITH_CONFIG
        + " Options are:\n"
        + "\n".join(known_features()),
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
        help="Serve the /debug/ pages (upstream: pprof) on the metrics server. "
        + _IGNORED_WITH_CONFIG,
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
        help="Minimum period between rule syncs (default 1s in iptables mode; also "
        "nftables mode, where unset or 0 paces syncs by their cost). " + _IGNORED_WITH_CONFIG,
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
    Flag(("-h", "--help"), "Show this help and exit."),
)
BY_DEST = {flag.dest: flag for flag in FLAGS}
# The modes a flag matters in (the others accept it, as upstream's binary does).
_ONLY_FOR: dict[str, frozenset[str]] = {
    "iptables_masquerade_bit": frozenset({"iptables", "ipvs"}),
    "iptables_localhost_nodeports": frozenset({"iptables"}),
    "iptables_sync_period": frozenset({"iptables", "nftables"}),
    "iptables_min_sync_period": frozenset({"iptables", "nftables"}),
    **{flag.dest: frozenset({"ipvs"}) for flag in FLAGS if flag.field.startswith("ipvs.")},
}


def _help(flag: Flag, fixed_mode: str | None) -> str:
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
OVERRIDE_CONFIG = {"hostname_override"} | {
    flag.dest for flag in FLAGS if flag.field.startswith("logging.")
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
        formatter_class=_Formatter,
        argument_default=argparse.SUPPRESS,
    )
    for flag in FLAGS:
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
