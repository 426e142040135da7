"""Upstream's configuration file: ``KubeProxyConfiguration`` (``kubeproxy.config.k8s.io/v1alpha1``).

The model mirrors every v1alpha1 field with upstream's names (snake_case here, camelCase in
the file) and defaults. Decoding is strict, as upstream's: an unknown or duplicated field, a
value of the wrong type, or a missing/wrong ``apiVersion``/``kind`` is a
:class:`ConfigError` naming the field's full path (``conntrack.maxPerCore``).

Defaulting follows upstream's v1alpha1 defaulting exactly, quirks included: for the fields
Go declares as plain values (not pointers) an explicit zero means "unset" and gets the
default (``iptables.minSyncPeriod: 0s`` becomes ``1s``, ``bindAddress: ""`` becomes
``0.0.0.0``), while pointer fields keep an explicit zero (``conntrack.maxPerCore: 0``,
``oomScoreAdj: 0``). ``healthzBindAddress``/``metricsBindAddress`` get their port appended
when only an IP is given. :func:`apply_platform_defaults` adds what upstream decides at
start-up on Linux (the mode, ``nodePortAddresses: [primary]`` in nftables mode, the
detect-local mode).

:func:`validate` applies upstream's validation rules (plus a few contradictions upstream
only finds at run time); :func:`to_proxier_config` maps the result to the
:class:`~kubeproxy.config.ProxierConfig` a proxier consumes, picking the section of the
active mode as upstream's internal conversion does. ``winkernel`` and
``windowsRunAsService`` are accepted and ignored on Linux, as upstream does.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kubeproxy.config import IPVSSettings, LocalDetectMode, LocalDetector, ProxierConfig
from kubeproxy.objects import IPNetwork

__all__ = [
    "API_VERSION",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "DEFAULT_HEALTHZ_PORT",
    "DEFAULT_METRICS_PORT",
    "DETECT_LOCAL_MODES",
    "KIND",
    "LOG_FORMATS",
    "PROXY_MODES",
    "ClientConnectionConfiguration",
    "ConfigError",
    "DetectLocalConfiguration",
    "Duration",
    "FormatOptions",
    "KubeProxyConfiguration",
    "KubeProxyConntrackConfiguration",
    "KubeProxyIPTablesConfiguration",
    "KubeProxyIPVSConfiguration",
    "KubeProxyNFTablesConfiguration",
    "KubeProxyWinkernelConfiguration",
    "LoggingConfiguration",
    "OutputRoutingOptions",
    "VModuleItem",
    "append_port_if_needed",
    "apply_platform_defaults",
    "cluster_cidrs",
    "config_document",
    "defaults",
    "effective_mode",
    "load_config_file",
    "parse_config",
    "to_proxier_config",
    "validate",
    "write_config",
]

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
"""The only ``apiVersion`` accepted (v1alpha2 was never merged upstream)."""
KIND = "KubeProxyConfiguration"
"""The ``kind`` a configuration file must declare."""
PROXY_MODES = ("iptables", "ipvs", "nftables")
"""Valid ``mode`` values on Linux (besides ``""``, which means iptables at run time)."""
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
"""Valid ``detectLocalMode`` values (besides ``""``, which means ClusterCIDR)."""
LOG_FORMATS = ("text", "json")
"""Valid ``logging.format`` values."""
CONTENT_TYPE_PROTOBUF = "application/vnd.kubernetes.protobuf"
"""Upstream's default ``clientConnection.contentType``."""
CONTENT_TYPE_JSON = "application/json"
"""The other content type an API client can use."""
DEFAULT_HEALTHZ_PORT = 10256
"""Upstream's health-check port (``ports.ProxyHealthzPort``)."""
DEFAULT_METRICS_PORT = 10249
"""Upstream's metrics port (``ports.ProxyStatusPort``)."""

_NODE_PORT_KEYWORDS = ("primary", "localhost", "all")
# The schedulers the Linux kernel ships (net/netfilter/ipvs/ip_vs_*.c).
_IPVS_SCHEDULERS = frozenset(
    {"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos"}
)
_INT32 = (-(2**31), 2**31 - 1)
_UINT32 = (0, 2**32 - 1)
# resource.Quantity's syntax (k8s.io/apimachinery/pkg/api/resource).
_QUANTITY = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
_FEATURE_GATE = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_HIDDEN_METRICS_VERSION = re.compile(r"\d+\.\d+")


class ConfigError(ValueError):
    """A configuration that cannot be used; ``field`` is the offending field's path.

    The message reads ``<field>: <problem>`` (just ``<problem>`` when no single field is to
    blame, e.g. a file that is not YAML).
    """

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"{field_path}: {problem}" if field_path else problem)
        self.field = field_path
        self.problem = problem


# --- Go durations -------------------------------------------------------------------------

_NS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_MAX_NS = 2**63 - 1
_DIGITS = "0123456789"


def _parse_go_duration(text: str) -> int:
    """Nanoseconds in ``text``, parsed as Go's ``time.ParseDuration`` does."""
    rest = text
    negative = False
    if rest[:1] in ("-", "+"):
        negative = rest[0] == "-"
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"invalid duration {text!r}")
    total = 0
    while rest:
        if rest[0] != "." and rest[0] not in _DIGITS:
            raise ValueError(f"invalid duration {text!r}")
        i = 0
        while i < len(rest) and rest[i] in _DIGITS:
            i += 1
        whole, rest = rest[:i], rest[i:]
        fraction = ""
        if rest.startswith("."):
            j = 1
            while j < len(rest) and rest[j] in _DIGITS:
                j += 1
            fraction, rest = rest[1:j], rest[j:]
            if not whole and not fraction:
                raise ValueError(f"invalid duration {text!r}")
        elif not whole:
            raise ValueError(f"invalid duration {text!r}")
        k = 0
        while k < len(rest) and rest[k] != "." and rest[k] not in _DIGITS:
            k += 1
        unit, rest = rest[:k], rest[k:]
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        scale = _NS_PER_UNIT.get(unit)
        if scale is None:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        total += int(whole or "0") * scale
        if fraction:
            total += int(fraction) * scale // 10 ** len(fraction)
        if total > _MAX_NS:
            raise ValueError(f"invalid duration {text!r} (out of range)")
    return -total if negative else total


def _format_fraction(value: int, unit: int) -> str:
    whole, rest = divmod(value, unit)
    if not rest:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{str(rest).rjust(digits, '0').rstrip('0')}"


def _format_go_duration(ns: int) -> str:
    """``ns`` nanoseconds written as Go's ``time.Duration.String`` does (``1h0m0s``)."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    value = abs(ns)
    if value < 1_000:
        return f"{sign}{value}ns"
    if value < 1_000_000:
        return f"{sign}{_format_fraction(value, 1_000)}\u00b5s"
    if value < 1_000_000_000:
        return f"{sign}{_format_fraction(value, 1_000_000)}ms"
    hours, value = divmod(value, 3_600_000_000_000)
    minutes, value = divmod(value, 60_000_000_000)
    seconds = _format_fraction(value, 1_000_000_000) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


@dataclass(frozen=True, slots=True, order=True)
class Duration:
    """A Go ``time.Duration`` (``metav1.Duration`` in the file): whole nanoseconds.

    ``str()`` gives Go's spelling (``30s``, ``15m0s``, ``24h0m0s``), which
    :meth:`parse` reads back exactly.
    """

    nanoseconds: int = 0

    @classmethod
    def parse(cls, text: str) -> Duration:
        """Parse Go's duration syntax (``300ms``, ``1.5h``, ``2h45m``); ``ValueError`` if bad."""
        return cls(_parse_go_duration(text))

    @classmethod
    def of(cls, *, hours: int = 0, minutes: int = 0, seconds: float = 0) -> Duration:
        """A duration from hours, minutes and seconds."""
        return cls(hours * 3_600_000_000_000 + minutes * 60_000_000_000 + round(seconds * 1e9))

    @property
    def seconds(self) -> float:
        """The duration in seconds."""
        return self.nanoseconds / 1e9

    def __str__(self) -> str:
        return _format_go_duration(self.nanoseconds)


_SECOND = 1_000_000_000
_ZERO = Duration()
_1S = Duration(_SECOND)
_5S = Duration(5 * _SECOND)
_30S = Duration(30 * _SECOND)
_15M = Duration(15 * 60 * _SECOND)
_1H = Duration(3600 * _SECOND)
_24H = Duration(24 * 3600 * _SECOND)


# --- the model ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientConnectionConfiguration:
    """``clientConnection``: how to reach the API server."""

    kubeconfig: str = ""
    accept_content_types: str = ""
    content_type: str = CONTENT_TYPE_PROTOBUF
    qps: float = 5.0
    burst: int = 10


@dataclass(frozen=True, slots=True)
class VModuleItem:
    """One ``logging.vmodule`` entry: a verbosity for the loggers matching a pattern.

    Upstream matches Go file names; here the pattern is matched (``fnmatch``) against the
    Python module name and the logger name.
    """

    file_pattern: str
    verbosity: int


@dataclass(frozen=True, slots=True)
class OutputRoutingOptions:
    """``logging.options.text``/``json``: split info and error streams (upstream alpha)."""

    split_stream: bool = False
    info_buffer_size: str = "0"


@dataclass(frozen=True, slots=True)
class FormatOptions:
    """``logging.options``: per-format output options."""

    text: OutputRoutingOptions = field(default_factory=OutputRoutingOptions)
    json: OutputRoutingOptions = field(default_factory=OutputRoutingOptions)


@dataclass(frozen=True, slots=True)
class LoggingConfiguration:
    """``logging``: format (``text``/``json``), verbosity (``-v``) and per-module levels."""

    format: str = "text"
    flush_frequency: Duration = _5S
    verbosity: int = 0
    vmodule: tuple[VModuleItem, ...] = ()
    options: FormatOptions = field(default_factory=FormatOptions)


@dataclass(frozen=True, slots=True)
class KubeProxyIPTablesConfiguration:
    """``iptables``: used in iptables mode (``masqueradeBit`` also in ipvs mode)."""

    masquerade_bit: int = 14
    masquerade_all: bool = False
    localhost_node_ports: bool = True
    sync_period: Duration = _30S
    min_sync_period: Duration = _1S


@dataclass(frozen=True, slots=True)
class KubeProxyIPVSConfiguration:
    """``ipvs``: used in (deprecated) ipvs mode."""

    sync_period: Duration = _30S
    min_sync_period: Duration = Duration()
    scheduler: str = ""
    exclude_cidrs: tuple[str, ...] = ()
    strict_arp: bool = False
    tcp_timeout: Duration = Duration()
    tcp_fin_timeout: Duration = Duration()
    udp_timeout: Duration = Duration()


@dataclass(frozen=True, slots=True)
class KubeProxyNFTablesConfiguration:
    """``nftables``: used in nftables mode."""

    masquerade_bit: int = 14
    masquerade_all: bool = False
    sync_period: Duration = _30S
    min_sync_period: Duration = _1S


@dataclass(frozen=True, slots=True)
class KubeProxyConntrackConfiguration:
    """``conntrack``: sysctls set at start-up; 0 leaves the kernel's value alone."""

    max_per_core: int = 32768
    min: int = 131072
    tcp_established_timeout: Duration = _24H
    tcp_close_wait_timeout: Duration = _1H
    tcp_be_liberal: bool = False
    udp_timeout: Duration = Duration()
    udp_stream_timeout: Duration = Duration()


@dataclass(frozen=True, slots=True)
class KubeProxyWinkernelConfiguration:
    """``winkernel``: Windows only; accepted and ignored on Linux."""

    network_name: str = ""
    source_vip: str = ""
    enable_dsr: bool = False
    root_hns_endpoint_name: str = ""
    forward_health_check_vip: bool = False


@dataclass(frozen=True, slots=True)
class DetectLocalConfiguration:
    """``detectLocal``: the companions of ``detectLocalMode``."""

    bridge_interface: str = ""
    interface_name_prefix: str = ""


@dataclass(frozen=True, slots=True)
class KubeProxyConfiguration:
    """The whole v1alpha1 configuration, defaulted as upstream does.

    ``mode`` and ``detect_local_mode`` may be ``""`` (decided at start-up, see
    :func:`apply_platform_defaults`); ``node_port_addresses`` empty means unset.
    ``healthz_bind_address``/``metrics_bind_address`` are ``IP:port`` or ``""``
    (disabled, reachable only through flags as upstream).
    """

    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    client_connection: ClientConnectionConfiguration = field(
        default_factory=ClientConnectionConfiguration
    )
    logging: LoggingConfiguration = field(default_factory=LoggingConfiguration)
    hostname_override: str = ""
    bind_address: str = "0.0.0.0"
    healthz_bind_address: str = f"0.0.0.0:{DEFAULT_HEALTHZ_PORT}"
    metrics_bind_address: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}"
    bind_address_hard_fail: bool = False
    enable_profiling: bool = False
    show_hidden_metrics_for_version: str = ""
    mode: str = ""
    iptables: KubeProxyIPTablesConfiguration = field(default_factory=KubeProxyIPTablesConfiguration)
    ipvs: KubeProxyIPVSConfiguration = field(default_factory=KubeProxyIPVSConfiguration)
    nftables: KubeProxyNFTablesConfiguration = field(default_factory=KubeProxyNFTablesConfiguration)
    winkernel: KubeProxyWinkernelConfiguration = field(
        default_factory=KubeProxyWinkernelConfiguration
    )
    detect_local_mode: str = ""
    detect_local: DetectLocalConfiguration = field(default_factory=DetectLocalConfiguration)
    cluster_cidr: str = ""
    node_port_addresses: tuple[str, ...] = ()
    oom_score_adj: int = -999
    conntrack: KubeProxyConntrackConfiguration = field(
        default_factory=KubeProxyConntrackConfiguration
    )
    config_sync_period: Duration = _15M
    port_range: str = ""
    windows_run_as_service: bool = False


def defaults() -> KubeProxyConfiguration:
    """Upstream's v1alpha1 defaults (what ``--write-config-to`` shows before start-up)."""
    return KubeProxyConfiguration()


# --- decoding -----------------------------------------------------------------------------


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, int | float):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _dec_str(raw: object, path: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(path, f"must be a string, got {_kind_of(raw)}")
    return raw


def _dec_bool(raw: object, path: str) -> bool:
    if not isinstance(raw, bool):
        raise ConfigError(path, f"must be true or false, got {_kind_of(raw)}")
    return raw


def _dec_int(bounds: tuple[int, int]) -> Callable[[object, str], int]:
    def decode(raw: object, path: str) -> int:
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(path, f"must be an integer, got {_kind_of(raw)}")
        if not bounds[0] <= raw <= bounds[1]:
            raise ConfigError(path, f"{raw} is out of range [{bounds[0]}, {bounds[1]}]")
        return raw

    return decode


def _dec_float(raw: object, path: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ConfigError(path, f"must be a number, got {_kind_of(raw)}")
    return float(raw)


def _dec_duration(raw: object, path: str) -> Duration:
    if not isinstance(raw, str):
        raise ConfigError(
            path, f'must be a duration string such as "30s" or "1h0m0s", got {_kind_of(raw)}'
        )
    try:
        return Duration.parse(raw)
    except ValueError as err:
        raise ConfigError(path, str(err)) from None


def _dec_time_or_duration(raw: object, path: str) -> Duration:
    # logging.flushFrequency also takes a number of nanoseconds (TimeOrMetaDuration).
    if isinstance(raw, int) and not isinstance(raw, bool):
        return Duration(raw)
    return _dec_duration(raw, path)


def _dec_str_list(raw: object, path: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise ConfigError(path, f"must be a list of strings, got {_kind_of(raw)}")
    return tuple(_dec_str(item, f"{path}[{i}]") for i, item in enumerate(raw))


def _dec_feature_gates(raw: object, path: str) -> dict[str, bool]:
    if not isinstance(raw, dict):
        raise ConfigError(
            path, f"must be a mapping of feature names to booleans, got {_kind_of(raw)}"
        )
    gates: dict[str, bool] = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not _FEATURE_GATE.fullmatch(name):
            raise ConfigError(path, f"{name!r} is not a feature gate name")
        gates[name] = _dec_bool(value, _child(path, name))
    return gates


def _dec_quantity(raw: object, path: str) -> str:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str) or not _QUANTITY.fullmatch(raw.strip()):
        raise ConfigError(
            path, f"must be a quantity such as 0, 512, 4Ki or 1M, got {_kind_of(raw)}"
        )
    return raw.strip()


def _dec_vmodule(raw: object, path: str) -> tuple[VModuleItem, ...]:
    if not isinstance(raw, list):
        raise ConfigError(
            path, f"must be a list of {{filePattern, verbosity}}, got {_kind_of(raw)}"
        )
    items = []
    for i, entry in enumerate(raw):
        item_path = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(item_path, f"must be a mapping, got {_kind_of(entry)}")
        _reject_unknown(entry, ("filePattern", "verbosity"), item_path)
        if entry.get("filePattern") is None:
            raise ConfigError(_child(item_path, "filePattern"), "required")
        pattern = _dec_str(entry["filePattern"], _child(item_path, "filePattern"))
        level = entry.get("verbosity")
        verbosity = 0 if level is None else _dec_int(_UINT32)(level, _child(item_path, "verbosity"))
        items.append(VModuleItem(pattern, verbosity))
    return tuple(items)


def _enc_identity(value: Any) -> object:
    return value


def _enc_str(value: Any) -> object:
    return str(value)


def _enc_number(value: Any) -> object:
    # Go writes a float32 holding a whole number without a fraction (qps: 5).
    return int(value) if float(value).is_integer() else value


def _enc_list(value: Any) -> object:
    return list(value) if value else None


def _enc_dict(value: Any) -> object:
    return dict(sorted(value.items()))


def _enc_vmodule(value: Any) -> object:
    return [{"filePattern": item.file_pattern, "verbosity": item.verbosity} for item in value]


@dataclass(frozen=True, slots=True)
class _Field:
    """One field of a struct: its key in the file, attribute here, and how to convert it.

    ``zero_is_unset`` marks Go's non-pointer fields that upstream defaults when zero;
    ``omitempty`` fields are left out of the written file when empty.
    """

    key: str
    attr: str
    decode: Callable[[object, str], Any]
    encode: Callable[[Any], object] = _enc_identity
    zero_is_unset: bool = False
    omitempty: bool = False


def _struct(cls: type[Any]) -> Callable[[object, str], Any]:
    def decode(raw: object, path: str) -> Any:
        return _decode_struct(cls, raw, path)

    return decode


def _enc_struct(value: Any) -> object:
    return _encode_struct(value)


def _dur(key: str, attr: str, *, zero_is_unset: bool = False) -> _Field:
    return _Field(key, attr, _dec_duration, _enc_str, zero_is_unset=zero_is_unset)


_ROUTING = (
    _Field("splitStream", "split_stream", _dec_bool, omitempty=True),
    _Field("infoBufferSize", "info_buffer_size", _dec_quantity, zero_is_unset=True),
)
_SCHEMAS: dict[type[Any], tuple[_Field, ...]] = {
    ClientConnectionConfiguration: (
        _Field("kubeconfig", "kubeconfig", _dec_str),
        _Field("acceptContentTypes", "accept_content_types", _dec_str),
        _Field("contentType", "content_type", _dec_str, zero_is_unset=True),
        _Field("qps", "qps", _dec_float, _enc_number, zero_is_unset=True),
        _Field("burst", "burst", _dec_int(_INT32), zero_is_unset=True),
    ),
    OutputRoutingOptions: _ROUTING,
    FormatOptions: (
        _Field("text", "text", _struct(OutputRoutingOptions), _enc_struct),
        _Field("json", "json", _struct(OutputRoutingOptions), _enc_struct),
    ),
    LoggingConfiguration: (
        _Field("format", "format", _dec_str, zero_is_unset=True, omitempty=True),
        _Field(
            "flushFrequency", "flush_frequency", _dec_time_or_duration, _enc_str, zero_is_unset=True
        ),
        _Field("verbosity", "verbosity", _dec_int(_UINT32)),
        _Field("vmodule", "vmodule", _dec_vmodule, _enc_vmodule, omitempty=True),
        _Field("options", "options", _struct(FormatOptions), _enc_struct, omitempty=True),
    ),
    KubeProxyIPTablesConfiguration: (
        _Field("masqueradeBit", "masquerade_bit", _dec_int(_INT32)),
        _Field("masqueradeAll", "masquerade_all", _dec_bool),
        _Field("localhostNodePorts", "localhost_node_ports", _dec_bool),
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period", zero_is_unset=True),
    ),
    KubeProxyIPVSConfiguration: (
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period"),
        _Field("scheduler", "scheduler", _dec_str),
        _Field("excludeCIDRs", "exclude_cidrs", _dec_str_list, _enc_list),
        _Field("strictARP", "strict_arp", _dec_bool),
        _dur("tcpTimeout", "tcp_timeout"),
        _dur("tcpFinTimeout", "tcp_fin_timeout"),
        _dur("udpTimeout", "udp_timeout"),
    ),
    KubeProxyNFTablesConfiguration: (
        _Field("masqueradeBit", "masquerade_bit", _dec_int(_INT32)),
        _Field("masqueradeAll", "masquerade_all", _dec_bool),
        _dur("syncPeriod", "sync_period", zero_is_unset=True),
        _dur("minSyncPeriod", "min_sync_period", zero_is_unset=True),
    ),
    KubeProxyConntrackConfiguration: (
        _Field("maxPerCore", "max_per_core", _dec_int(_INT32)),
        _Field("min", "min", _dec_int(_INT32)),
        _dur("tcpEstablishedTimeout", "tcp_established_timeout"),
        _dur("tcpCloseWaitTimeout", "tcp_close_wait_timeout"),
        _Field("tcpBeLiberal", "tcp_be_liberal", _dec_bool),
        _dur("udpTimeout", "udp_timeout"),
        _dur("udpStreamTimeout", "udp_stream_timeout"),
    ),
    KubeProxyWinkernelConfiguration: (
        _Field("networkName", "network_name", _dec_str),
        _Field("sourceVip", "source_vip", _dec_str),
        _Field("enableDSR", "enable_dsr", _dec_bool),
        _Field("rootHnsEndpointName", "root_hns_endpoint_name", _dec_str),
        _Field("forwardHealthCheckVip", "forward_health_check_vip", _dec_bool),
    ),
    DetectLocalConfiguration: (
        _Field("bridgeInterface", "bridge_interface", _dec_str),
        _Field("interfaceNamePrefix", "interface_name_prefix", _dec_str),
    ),
    KubeProxyConfiguration: (
        _Field("featureGates", "feature_gates", _dec_feature_gates, _enc_dict, omitempty=True),
        _Field(
            "clientConnection",
            "client_connection",
            _struct(ClientConnectionConfiguration),
            _enc_struct,
        ),
        _Field("logging", "logging", _struct(LoggingConfiguration), _enc_struct, omitempty=True),
        _Field("hostnameOverride", "hostname_override", _dec_str),
        _Field("bindAddress", "bind_address", _dec_str, zero_is_unset=True),
        # Defaulted together with bindAddress, in _decode_root.
        _Field("healthzBindAddress", "healthz_bind_address", _dec_str),
        _Field("metricsBindAddress", "metrics_bind_address", _dec_str),
        _Field("bindAddressHardFail", "bind_address_hard_fail", _dec_bool),
        _Field("enableProfiling", "enable_profiling", _dec_bool),
        _Field("showHiddenMetricsForVersion", "show_hidden_metrics_for_version", _dec_str),
        _Field("mode", "mode", _dec_str),
        _Field("iptables", "iptables", _struct(KubeProxyIPTablesConfiguration), _enc_struct),
        _Field("ipvs", "ipvs", _struct(KubeProxyIPVSConfiguration), _enc_struct),
        _Field("nftables", "nftables", _struct(KubeProxyNFTablesConfiguration), _enc_struct),
        _Field("winkernel", "winkernel", _struct(KubeProxyWinkernelConfiguration), _enc_struct),
        _Field("detectLocalMode", "detect_local_mode", _dec_str),
        _Field("detectLocal", "detect_local", _struct(DetectLocalConfiguration), _enc_struct),
        _Field("clusterCIDR", "cluster_cidr", _dec_str),
        _Field("nodePortAddresses", "node_port_addresses", _dec_str_list, _enc_list),
        _Field("oomScoreAdj", "oom_score_adj", _dec_int(_INT32)),
        _Field("conntrack", "conntrack", _struct(KubeProxyConntrackConfiguration), _enc_struct),
        _dur("configSyncPeriod", "config_sync_period", zero_is_unset=True),
        _Field("portRange", "port_range", _dec_str),
        _Field("windowsRunAsService", "windows_run_as_service", _dec_bool, omitempty=True),
    ),
}


def _is_zero(value: object) -> bool:
    if isinstance(value, Duration):
        return value.nanoseconds == 0
    if isinstance(value, str):
        return value == ""
    return value == 0


def _reject_unknown(raw: Mapping[Any, Any], known: Sequence[str], path: str) -> None:
    for key in raw:
        if key not in known:
            name = str(key)
            hint = difflib.get_close_matches(name, known, n=1)
            suffix = f" (did you mean {hint[0]}?)" if hint else ""
            raise ConfigError(_child(path, name), f"unknown field{suffix}")


def _decode_fields(cls: type[Any], raw: object, path: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"must be a mapping, got {_kind_of(raw)}")
    fields = _SCHEMAS[cls]
    _reject_unknown(raw, [f.key for f in fields], path)
    values: dict[str, Any] = {}
    for spec in fields:
        item = raw.get(spec.key)
        if item is None:
            continue
        value = spec.decode(item, _child(path, spec.key))
        if spec.zero_is_unset and _is_zero(value):
            continue
        values[spec.attr] = value
    return values


def _decode_struct(cls: type[Any], raw: object, path: str) -> Any:
    return cls(**_decode_fields(cls, raw, path))


def _encode_struct(obj: Any) -> dict[str, object]:
    out: dict[str, object] = {}
    for spec in _SCHEMAS[type(obj)]:
        value = spec.encode(getattr(obj, spec.attr))
        if spec.omitempty and value in (None, "", False, [], {}):
            continue
        out[spec.key] = value
    return out


def append_port_if_needed(address: str, port: int) -> str:
    """``address`` with ``:port`` appended when it is a bare IP (IPv6 gets brackets).

    Anything else (already ``IP:port``, or not an IP at all) is returned as is, for
    validation to judge, as upstream's ``AppendPortIfNeeded``.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return f"{address}:{port}" if ip.version == 4 else f"[{address}]:{port}"


def _default_server_hosts(bind_address: str) -> tuple[str, str]:
    try:
        if ipaddress.ip_address(bind_address).version == 4:
            return "0.0.0.0", "127.0.0.1"
    except ValueError:
        pass
    return "[::]", "[::1]"


def _decode_root(raw: object) -> KubeProxyConfiguration:
    if not isinstance(raw, dict):
        raise ConfigError("", f"a configuration file must hold a mapping, got {_kind_of(raw)}")
    api_version = raw.get("apiVersion")
    kind = raw.get("kind")
    if kind is None:
        raise ConfigError("kind", f"missing; must be {KIND}")
    if kind != KIND:
        raise ConfigError("kind", f"must be {KIND}, got {_kind_of(kind)}")
    if api_version is None:
        raise ConfigError("apiVersion", f"missing; must be {API_VERSION}")
    if api_version != API_VERSION:
        raise ConfigError("apiVersion", f"must be {API_VERSION}, got {_kind_of(api_version)}")
    body = {k: v for k, v in raw.items() if k not in ("apiVersion", "kind")}
    values = _decode_fields(KubeProxyConfiguration, body, "")
    bind_address = values.get("bind_address", "0.0.0.0")
    healthz_host, metrics_host = _default_server_hosts(bind_address)
    healthz = values.get("healthz_bind_address", "")
    values["healthz_bind_address"] = (
        append_port_if_needed(healthz, DEFAULT_HEALTHZ_PORT)
        if healthz
        else f"{healthz_host}:{DEFAULT_HEALTHZ_PORT}"
    )
    metrics = values.get("metrics_bind_address", "")
    values["metrics_bind_address"] = (
        append_port_if_needed(metrics, DEFAULT_METRICS_PORT)
        if metrics
        else f"{metrics_host}:{DEFAULT_METRICS_PORT}"
    )
    return KubeProxyConfiguration(**values)


class _StrictLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate keys, as upstream's strict decoder does."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(str(key), f"duplicate field (line {line})")
        seen[key] = loader.construct_object(value_node, deep=True)
    return seen


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(key, "duplicate field")
        out[key] = value
    return out


def parse_config(text: str) -> KubeProxyConfiguration:
    """Decode a configuration (YAML or JSON text), strictly, and apply upstream's defaults.

    Raises :class:`ConfigError` naming the field for anything upstream's strict decoder
    rejects. The result is not validated: see :func:`validate`.
    """
    if text.lstrip().startswith("{"):
        try:
            raw: object = json.loads(text, object_pairs_hook=_json_pairs)
        except json.JSONDecodeError as err:
            raise ConfigError("", f"not valid JSON: {err}") from None
    else:
        try:
            documents = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
        except yaml.YAMLError as err:
            raise ConfigError("", f"not valid YAML: {err}") from None
        if not documents:
            raise ConfigError("", f"empty; expected a {KIND} ({API_VERSION})")
        if len(documents) > 1:
            raise ConfigError("", f"holds {len(documents)} YAML documents; expected one {KIND}")
        raw = documents[0]
    return _decode_root(raw)


def load_config_file(path: str | Path) -> KubeProxyConfiguration:
    """Read and decode a configuration file (see :func:`parse_config`).

    Raises :class:`ConfigError` (an unreadable file included).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("", f"cannot read {path}: {err}") from None
    return parse_config(text)


class _Dumper(yaml.SafeDumper):
    """Writes strings that need quoting (``""``, ``"0"``) in double quotes, as upstream."""


def _represent_str(dumper: _Dumper, value: str) -> yaml.ScalarNode:
    plain_tag = dumper.resolve(yaml.ScalarNode, value, (True, False))  # type: ignore[no-untyped-call]
    style = '"' if plain_tag != "tag:yaml.org,2002:str" else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def config_document(cfg: KubeProxyConfiguration) -> dict[str, object]:
    """The configuration as a ``kubeproxy.config.k8s.io/v1alpha1`` document (plain JSON
    types), every field spelled out: what ``--write-config-to`` and ``/configz`` show."""
    body = _encode_struct(cfg)
    body["apiVersion"] = API_VERSION
    body["kind"] = KIND
    return body


def write_config(cfg: KubeProxyConfiguration) -> str:
    """The configuration as YAML, every field spelled out (upstream's ``--write-config-to``)."""
    body = config_document(cfg)
    return yaml.dump(
        body, Dumper=_Dumper, sort_keys=True, default_flow_style=False, allow_unicode=True
    )


# --- platform defaults and validation -----------------------------------------------------


def effective_mode(cfg: KubeProxyConfiguration) -> str:
    """The mode the proxy runs in: ``mode``, or ``iptables`` when unset (upstream's default)."""
    return cfg.mode or "iptables"


def apply_platform_defaults(cfg: KubeProxyConfiguration) -> KubeProxyConfiguration:
    """What upstream fills in at start-up on Linux, after loading the configuration.

    ``mode`` unset becomes ``iptables``; in nftables mode an unset ``nodePortAddresses``
    becomes ``[primary]``; an unset ``detectLocalMode`` becomes ``ClusterCIDR``.
    """
    mode = effective_mode(cfg)
    node_ports = cfg.node_port_addresses
    if mode == "nftables" and not node_ports:
        node_ports = ("primary",)
    return dataclasses.replace(
        cfg,
        mode=mode,
        node_port_addresses=node_ports,
        detect_local_mode=cfg.detect_local_mode or "ClusterCIDR",
    )


def _parse_cidr(text: str) -> IPNetwork:
    # Upstream's ParseCIDR needs the prefix length; Python would read a bare IP as /32.
    if "/" not in text:
        raise ValueError(text)
    return ipaddress.ip_network(text, strict=False)


def cluster_cidrs(cfg: KubeProxyConfiguration) -> tuple[IPNetwork, ...]:
    """The CIDRs in ``clusterCIDR`` (a comma-separated dual-stack pair at most).

    Raises :class:`ConfigError` naming ``clusterCIDR`` for anything but one CIDR or one
    CIDR of each family.
    """
    if not cfg.cluster_cidr:
        return ()
    parts = cfg.cluster_cidr.split(",")
    if len(parts) > 2:
        raise ConfigError(
            "clusterCIDR",
            f"must be one CIDR or a dual-stack pair of CIDRs, got {cfg.cluster_cidr!r}",
        )
    cidrs: list[IPNetwork] = []
    for part in parts:
        try:
            cidrs.append(_parse_cidr(part))
        except ValueError:
            raise ConfigError(
                "clusterCIDR",
                f"{part!r} is not a CIDR (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
            ) from None
    if len(cidrs) == 2 and cidrs[0].version == cidrs[1].version:
        raise ConfigError(
            "clusterCIDR",
            f"a pair must be one IPv4 and one IPv6 CIDR (dual-stack), got {cfg.cluster_cidr!r}",
        )
    return tuple(cidrs)


def _check_host_port(
    path: str, address: str
) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise ConfigError(path, f"must be IP:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(path, f"must be IP:port (IPv6 in brackets: [::1]:10249), got {address!r}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(path, f"{host!r} is not a valid IP (in {address!r})") from None
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(path, f"port must be in [1, 65535], got {port_text!r} (in {address!r})")
    return ip, int(port_text)


def _covers(
    wildcard: ipaddress.IPv4Address | ipaddress.IPv6Address,
    other: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> bool:
    # A socket bound to [::] is dual-stack on Linux: it takes the IPv4 port too.
    return wildcard.is_unspecified and (wildcard.version == 6 or other.version == 4)


def _check_servers(cfg: KubeProxyConfiguration) -> None:
    servers = {}
    for path, address in (
        ("healthzBindAddress", cfg.healthz_bind_address),
        ("metricsBindAddress", cfg.metrics_bind_address),
    ):
        if address:
            servers[path] = _check_host_port(path, address)
    if len(servers) == 2:
        (h_ip, h_port), (m_ip, m_port) = servers.values()
        overlap = h_ip == m_ip or _covers(h_ip, m_ip) or _covers(m_ip, h_ip)
        if h_port == m_port and overlap:
            raise ConfigError(
                "metricsBindAddress",
                f"{cfg.metrics_bind_address} collides with healthzBindAddress "
                f"{cfg.healthz_bind_address}",
            )


def _check_periods(section: str, sync: Duration, min_sync: Duration) -> None:
    if sync.nanoseconds <= 0:
        raise ConfigError(f"{section}.syncPeriod", f"must be greater than 0, got {sync}")
    if min_sync.nanoseconds < 0:
        raise ConfigError(f"{section}.minSyncPeriod", f"must be 0 or more, got {min_sync}")
    if min_sync > sync:
        raise ConfigError(
            f"{section}.minSyncPeriod",
            f"must not exceed {section}.syncPeriod ({sync}), got {min_sync}",
        )


def _check_non_negative(path: str, value: Duration | int) -> None:
    number = value.nanoseconds if isinstance(value, Duration) else value
    if number < 0:
        raise ConfigError(path, f"must be 0 or more, got {value}")


def _check_bit(path: str, bit: int) -> None:
    if not 0 <= bit <= 31:
        raise ConfigError(path, f"must be in [0, 31], got {bit}")


def _check_interface(path: str, name: str, mode: str) -> None:
    if not name:
        raise ConfigError(path, f"required when detectLocalMode is {mode}")
    if len(name) > 15 or any(c in name for c in "/: \t\n") or name in (".", ".."):
        raise ConfigError(path, f"{name!r} is not a valid interface name")


def _check_node_port_addresses(addresses: Sequence[str]) -> None:
    for i, entry in enumerate(addresses):
        path = f"nodePortAddresses[{i}]"
        if entry == "primary":
            if any(e not in _NODE_PORT_KEYWORDS for e in addresses):
                raise ConfigError(path, "can't use both 'primary' and CIDRs")
            continue
        if entry in _NODE_PORT_KEYWORDS:
            continue
        try:
            _parse_cidr(entry)
        except ValueError:
            raise ConfigError(
                path, f"{entry!r} is neither a CIDR nor one of primary, localhost, all"
            ) from None


def _check_port_range(text: str) -> None:
    value = text.strip()
    if not value:
        return
    match = re.fullmatch(r"(\d+)(?:([-+])(\d+))?", value)
    ok = match is not None
    if match is not None:
        low = int(match.group(1))
        high = low
        if match.group(2) == "-":
            high = int(match.group(3))
        elif match.group(2) == "+":
            high = low + int(match.group(3))
        ok = low <= high <= 65535
    if not ok:
        raise ConfigError("portRange", f"must be a port range such as 30000-32767, got {text!r}")


def _check_logging(cfg: LoggingConfiguration) -> None:
    if cfg.format not in LOG_FORMATS:
        raise ConfigError("logging.format", f"must be one of text, json, got {cfg.format!r}")
    if cfg.flush_frequency.nanoseconds <= 0:
        raise ConfigError(
            "logging.flushFrequency", f"must be greater than 0, got {cfg.flush_frequency}"
        )
    if cfg.vmodule and cfg.format != "text":
        raise ConfigError("logging.vmodule", "only supported with the text log format")
    for i, item in enumerate(cfg.vmodule):
        if not item.file_pattern or any(c in item.file_pattern for c in ",="):
            raise ConfigError(
                f"logging.vmodule[{i}].filePattern",
                f"must be a non-empty pattern without ',' or '=', got {item.file_pattern!r}",
            )


def _check_client(cfg: ClientConnectionConfiguration) -> None:
    if cfg.burst < 0:
        raise ConfigError("clientConnection.burst", f"must be 0 or more, got {cfg.burst}")
    if cfg.content_type not in (CONTENT_TYPE_PROTOBUF, CONTENT_TYPE_JSON):
        raise ConfigError(
            "clientConnection.contentType",
            f"must be {CONTENT_TYPE_PROTOBUF} or {CONTENT_TYPE_JSON}, got {cfg.content_type!r}",
        )


def _check_sections(cfg: KubeProxyConfiguration) -> None:
    _check_bit("iptables.masqueradeBit", cfg.iptables.masquerade_bit)
    _check_periods("iptables", cfg.iptables.sync_period, cfg.iptables.min_sync_period)
    _check_bit("nftables.masqueradeBit", cfg.nftables.masquerade_bit)
    _check_periods("nftables", cfg.nftables.sync_period, cfg.nftables.min_sync_period)
    ipvs = cfg.ipvs
    _check_periods("ipvs", ipvs.sync_period, ipvs.min_sync_period)
    if ipvs.scheduler and ipvs.scheduler not in _IPVS_SCHEDULERS:
        raise ConfigError(
            "ipvs.scheduler",
            f"unknown scheduler {ipvs.scheduler!r}; one of {', '.join(sorted(_IPVS_SCHEDULERS))}",
        )
    for i, cidr in enumerate(ipvs.exclude_cidrs):
        try:
            _parse_cidr(cidr)
        except ValueError:
            raise ConfigError(f"ipvs.excludeCIDRs[{i}]", f"{cidr!r} is not a CIDR") from None
    _check_non_negative("ipvs.tcpTimeout", ipvs.tcp_timeout)
    _check_non_negative("ipvs.tcpFinTimeout", ipvs.tcp_fin_timeout)
    _check_non_negative("ipvs.udpTimeout", ipvs.udp_timeout)
    ct = cfg.conntrack
    _check_non_negative("conntrack.maxPerCore", ct.max_per_core)
    _check_non_negative("conntrack.min", ct.min)
    _check_non_negative("conntrack.tcpEstablishedTimeout", ct.tcp_established_timeout)
    _check_non_negative("conntrack.tcpCloseWaitTimeout", ct.tcp_close_wait_timeout)
    _check_non_negative("conntrack.udpTimeout", ct.udp_timeout)
    _check_non_negative("conntrack.udpStreamTimeout", ct.udp_stream_timeout)


def _check_detect_local(cfg: KubeProxyConfiguration) -> None:
    mode = cfg.detect_local_mode
    if mode and mode not in DETECT_LOCAL_MODES:
        raise ConfigError(
            "detectLocalMode", f"must be one of {', '.join(DETECT_LOCAL_MODES)}, got {mode!r}"
        )
    if mode in ("", "ClusterCIDR"):
        cluster_cidrs(cfg)
    elif mode == "BridgeInterface":
        _check_interface("detectLocal.bridgeInterface", cfg.detect_local.bridge_interface, mode)
    elif mode == "InterfaceNamePrefix":
        _check_interface(
            "detectLocal.interfaceNamePrefix", cfg.detect_local.interface_name_prefix, mode
        )


def validate(cfg: KubeProxyConfiguration, platform: str = "linux") -> None:
    """Check ``cfg`` as upstream does on Linux; raise :class:`ConfigError` at the first problem.

    Beyond upstream: every backend section is checked (not only the active mode's), an
    empty ``metricsBindAddress`` is allowed (it disables the server, as the flag's help
    says), health and metrics servers may not share an address, ``ipvs.scheduler`` must be
    a kernel scheduler, interface names must be valid Linux names, and
    ``clientConnection.contentType`` must be one an API client can speak.
    """
    if platform != "linux":
        raise ValueError(f"unsupported platform {platform!r}: only linux is implemented")
    if cfg.mode and cfg.mode not in PROXY_MODES:
        raise ConfigError(
            "mode",
            f"must be iptables, ipvs, nftables or blank (blank means iptables), got {cfg.mode!r}",
        )
    _check_sections(cfg)
    if cfg.config_sync_period.nanoseconds <= 0:
        raise ConfigError(
            "configSyncPeriod", f"must be greater than 0, got {cfg.config_sync_period}"
        )
    try:
        ipaddress.ip_address(cfg.bind_address)
    except ValueError:
        raise ConfigError("bindAddress", f"{cfg.bind_address!r} is not an IP address") from None
    _check_servers(cfg)
    if not -1000 <= cfg.oom_score_adj <= 1000:
        raise ConfigError("oomScoreAdj", f"must be in [-1000, 1000], got {cfg.oom_score_adj}")
    _check_node_port_addresses(cfg.node_port_addresses)
    _check_detect_local(cfg)
    _check_client(cfg.client_connection)
    _check_logging(cfg.logging)
    _check_port_range(cfg.port_range)
    version = cfg.show_hidden_metrics_for_version
    if version and not _HIDDEN_METRICS_VERSION.fullmatch(version):
        raise ConfigError(
            "showHiddenMetricsForVersion", f"must be <major>.<minor> such as 1.33, got {version!r}"
        )


# --- mapping to what a proxier consumes ---------------------------------------------------


def _local_detector(cfg: KubeProxyConfiguration) -> LocalDetector:
    mode = LocalDetectMode(cfg.detect_local_mode or "ClusterCIDR")
    if mode is LocalDetectMode.CLUSTER_CIDR:
        cidrs = cluster_cidrs(cfg)
        return LocalDetector(mode, cidrs) if cidrs else LocalDetector()
    if mode is LocalDetectMode.NODE_CIDR:
        return LocalDetector(mode)
    if mode is LocalDetectMode.BRIDGE_INTERFACE:
        return LocalDetector(mode, interface=cfg.detect_local.bridge_interface)
    return LocalDetector(mode, interface=cfg.detect_local.interface_name_prefix)


def to_proxier_config(
    cfg: KubeProxyConfiguration,
    node_name: str,
    mode: str | None = None,
    *,
    service_cidrs: Sequence[IPNetwork] = (),
) -> ProxierConfig:
    """The settings a proxier of ``mode`` (default: ``cfg``'s effective mode) takes from ``cfg``.

    As upstream's internal conversion: nftables mode takes the ``nftables`` section's sync
    periods, ``masqueradeAll`` and ``masqueradeBit``; ipvs mode the ``ipvs`` section's
    periods with ``iptables.masqueradeBit``/``masqueradeAll``; iptables mode the
    ``iptables`` section. An unset ``nodePortAddresses`` is ``[primary]`` in nftables mode
    and empty (every local address) otherwise. ``cfg`` should have passed :func:`validate`;
    a bad value still raises :class:`ConfigError` (or ``ValueError`` from ProxierConfig).
    """
    mode = mode or effective_mode(cfg)
    if mode not in PROXY_MODES:
        raise ConfigError("mode", f"must be one of {', '.join(PROXY_MODES)}, got {mode!r}")
    masquerade_all = cfg.iptables.masquerade_all
    masquerade_bit = cfg.iptables.masquerade_bit
    node_ports = cfg.node_port_addresses
    if mode == "nftables":
        sync, min_sync = cfg.nftables.sync_period, cfg.nftables.min_sync_period
        masquerade_all, masquerade_bit = cfg.nftables.masquerade_all, cfg.nftables.masquerade_bit
        node_ports = node_ports or ("primary",)
    elif mode == "ipvs":
        sync, min_sync = cfg.ipvs.sync_period, cfg.ipvs.min_sync_period
    else:
        sync, min_sync = cfg.iptables.sync_period, cfg.iptables.min_sync_period
    return ProxierConfig(
        node_name=node_name,
        masquerade_all=masquerade_all,
        masquerade_bit=masquerade_bit,
        local_detector=_local_detector(cfg),
        node_port_addresses=tuple(node_ports),
        service_cidrs=tuple(service_cidrs),
        sync_period=sync.seconds,
        min_sync_period=min_sync.seconds,
        localhost_node_ports=cfg.iptables.localhost_node_ports,
        tcp_be_liberal=cfg.conntrack.tcp_be_liberal,
        ipvs=IPVSSettings(
            scheduler=cfg.ipvs.scheduler or "rr",
            exclude_cidrs=tuple(
                ipaddress.ip_network(cidr, strict=False) for cidr in cfg.ipvs.exclude_cidrs
            ),
            strict_arp=cfg.ipvs.strict_arp,
            tcp_timeout=cfg.ipvs.tcp_timeout.seconds,
            tcp_fin_timeout=cfg.ipvs.tcp_fin_timeout.seconds,
            udp_timeout=cfg.ipvs.udp_timeout.seconds,
        ),
    )
